"""Pallas Mosaic TPU kernels for bias_activation and glu, forward and backward.

(rows, cols) blocks in VMEM: whole rows up to ``MAX_BLOCK_COLS`` wide (any
width), else lane-aligned column blocks. d(bias) accumulates in a
VMEM-resident (1, cols) output block across the "arbitrary" row axis, inside
a "parallel" column axis.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxkernels import _activations, _mosaic_tpu, hardware, roofline
from jaxkernels._mosaic_tpu import MAX_BLOCK_ROWS, sublanes, vmem_limit
from jaxkernels._tiling import cdiv

# Widest block: rows up to this wide are whole; wider ones are cut into lane-aligned blocks.
MAX_BLOCK_COLS = 4096


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(_mosaic_tpu.BlockConfig):
  """Blocks of the (M, N) rows view (``_mosaic_tpu.BlockConfig``)."""


# Arrays of x's size that move per step, the most of any pass (glu's backward: gate, up, dy in;
# dgate, dup out): the rows of a block are sized for it.
STREAMS = 5


def heuristic(problem, chip: hardware.Chip) -> Config:
  """problem: the call's ``elementwise.api.Problem`` (x the (M, N) view of its first operand).
  One tiling serves every op and activation here."""
  x, streams = problem.x, STREAMS
  n_rows, n_cols = x.shape
  cols = n_cols if n_cols <= MAX_BLOCK_COLS else MAX_BLOCK_COLS
  lanes = -(-cols // 128) * 128
  budget = vmem_limit(chip) * 2 // 3
  per_row = lanes * (2 * streams * x.dtype.itemsize + 4 * 4)  # double-buffered + f32 temps
  fitting = min(budget // per_row, MAX_BLOCK_ROWS)
  packing = sublanes(x.dtype)
  rows = n_rows if n_rows <= fitting else 1 << (max(fitting, packing).bit_length() - 1)
  return Config(block_rows=rows, block_cols=cols, vmem_limit_bytes=vmem_limit(chip))


def unsupported(problem, chip) -> str | None:
  del chip  # blocks are cut to fit any width
  if jnp.dtype(problem.x.dtype) == jnp.float16:
    return "float16 is not a TPU dtype (use bfloat16 or float32)"
  return None


# --------------------------------------------------------------------------- #
# Kernels
# --------------------------------------------------------------------------- #


def _bias_act_fwd_kernel(x_ref, b_ref, y_ref, *, activation):
  z = x_ref[...].astype(jnp.float32) + b_ref[...].astype(jnp.float32)
  y_ref[...] = _activations.apply(activation, z).astype(y_ref.dtype)


def _bias_act_bwd_kernel(x_ref, b_ref, dy_ref, dx_ref, db_ref, *, activation, n_rows,
                         block_rows, mask_rows):
  row_block = pl.program_id(1)
  z = x_ref[...].astype(jnp.float32) + b_ref[...].astype(jnp.float32)
  _, slope = _activations.value_and_grad(activation, z)
  dx = dy_ref[...].astype(jnp.float32) * slope
  dx_ref[...] = dx.astype(dx_ref.dtype)
  if mask_rows:  # rows past the end hold stale VMEM: keep them out of the column sum
    dx = jnp.where(_mosaic_tpu.row_mask(row_block, block_rows, n_rows), dx, 0.0)

  @pl.when(row_block == 0)
  def _():
    db_ref[...] = jnp.zeros_like(db_ref)

  db_ref[...] += jnp.sum(dx, axis=0, keepdims=True)


def _glu_fwd_kernel(g_ref, u_ref, y_ref, *, activation):
  g = g_ref[...].astype(jnp.float32)
  y_ref[...] = (_activations.apply(activation, g) * u_ref[...].astype(jnp.float32)).astype(
      y_ref.dtype)


def _glu_bwd_kernel(g_ref, u_ref, dy_ref, dg_ref, du_ref, *, activation):
  value, slope = _activations.value_and_grad(activation, g_ref[...].astype(jnp.float32))
  dy = dy_ref[...].astype(jnp.float32)
  dg_ref[...] = (dy * u_ref[...].astype(jnp.float32) * slope).astype(dg_ref.dtype)
  du_ref[...] = (dy * value).astype(du_ref.dtype)


# --------------------------------------------------------------------------- #
# Wrappers
# --------------------------------------------------------------------------- #


def _call(kernel, inputs, outputs, x, config, *, cost, name, interpret):
  rows, cols = config.blocks(x)
  block = pl.BlockSpec((rows, cols), lambda i, j: (i, j))
  return pl.pallas_call(
      kernel,
      out_shape=outputs,
      grid=(cdiv(x.shape[0], rows), cdiv(x.shape[1], cols)),
      in_specs=[block] * len(inputs),
      out_specs=[block] * len(outputs) if isinstance(outputs, list) else block,
      compiler_params=_mosaic_tpu.params(("parallel", "parallel"), config.vmem_limit_bytes, interpret),
      cost_estimate=cost.estimate(),
      interpret=interpret,
      name=name,
  )(*inputs)


def bias_activation_fwd(x, bias, *, activation, config: Config, interpret=False):
  rows, cols = config.blocks(x)
  return pl.pallas_call(
      functools.partial(_bias_act_fwd_kernel, activation=activation),
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(cdiv(x.shape[0], rows), cdiv(x.shape[1], cols)),
      in_specs=[pl.BlockSpec((rows, cols), lambda i, j: (i, j)),
                pl.BlockSpec((1, cols), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((rows, cols), lambda i, j: (i, j)),
      compiler_params=_mosaic_tpu.params(("parallel", "parallel"), config.vmem_limit_bytes, interpret),
      cost_estimate=roofline.bias_activation_fwd(x, bias, activation).estimate(),
      interpret=interpret,
      name=f"jk_bias_{activation}_fwd",
  )(x, bias.reshape(1, -1))


def bias_activation_bwd(x, bias, dy, *, activation, config: Config, interpret=False):
  n_rows, n_cols = x.shape
  rows, cols = config.blocks(x)
  block = pl.BlockSpec((rows, cols), lambda j, i: (i, j))
  vector = pl.BlockSpec((1, cols), lambda j, i: (0, j))
  dx, db = pl.pallas_call(
      functools.partial(_bias_act_bwd_kernel, activation=activation, n_rows=n_rows,
                        block_rows=rows, mask_rows=n_rows % rows != 0),
      out_shape=[jax.ShapeDtypeStruct(x.shape, dy.dtype),
                 jax.ShapeDtypeStruct((1, n_cols), jnp.float32)],
      grid=(cdiv(n_cols, cols), cdiv(n_rows, rows)),  # column blocks outer: d(bias) stays put
      in_specs=[block, vector, block],
      out_specs=[block, vector],
      compiler_params=_mosaic_tpu.params(("parallel", "arbitrary"), config.vmem_limit_bytes, interpret),
      cost_estimate=roofline.bias_activation_bwd(x, bias, activation).estimate(),
      interpret=interpret,
      name=f"jk_bias_{activation}_bwd",
  )(x, bias.reshape(1, -1), dy)
  return dx, db.reshape(-1).astype(bias.dtype)


def _halves(x):
  n = x.shape[-1] // 2
  return x[:, :n], x[:, n:]


def glu_fwd(gate, up, *, activation, config: Config, interpret=False):
  """glu's rows; ``up=None``: gate holds [gate | up] side by side, taken as two slices."""
  if up is None:
    gate, up = _halves(gate)
  return _call(functools.partial(_glu_fwd_kernel, activation=activation), [gate, up],
               jax.ShapeDtypeStruct(gate.shape, gate.dtype), gate, config,
               cost=roofline.glu_fwd(gate, up, activation), name=f"jk_glu_{activation}_fwd",
               interpret=interpret)


def glu_bwd(gate, up, dy, *, activation, config: Config, interpret=False):
  """(d gate, d up); ``up=None``: (d[gate | up], None), the halves' gradients concatenated."""
  packed = up is None
  if packed:
    gate, up = _halves(gate)
  dg, du = _call(functools.partial(_glu_bwd_kernel, activation=activation), [gate, up, dy],
                 [jax.ShapeDtypeStruct(gate.shape, gate.dtype),
                  jax.ShapeDtypeStruct(up.shape, up.dtype)], gate, config,
                 cost=roofline.glu_bwd(gate, up, activation), name=f"jk_glu_{activation}_bwd",
                 interpret=interpret)
  return (jnp.concatenate([dg, du], axis=-1), None) if packed else (dg, du)
