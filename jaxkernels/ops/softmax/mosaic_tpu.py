"""Pallas Mosaic TPU kernels for softmax over the last axis, forward and backward.

Each grid step holds ``block_rows`` whole rows in VMEM (any width that fits;
Mosaic pads lanes to 128 and masks the reductions), float32 inside.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxkernels import _mosaic_tpu, hardware, roofline
from jaxkernels._activations import exp
from jaxkernels._mosaic_tpu import MAX_BLOCK_ROWS, sublanes, vmem_limit
from jaxkernels._tiling import cdiv, check_fields, round_up


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  block_rows: int
  vmem_limit_bytes: int

  def __post_init__(self):
    check_fields(self, ("block_rows", "vmem_limit_bytes"), lambda v: v >= 1, ">= 1")

  def rows(self, x) -> int:
    n_rows = x.shape[0]
    rows = min(self.block_rows, n_rows)
    packing = sublanes(x.dtype)
    if rows != n_rows and rows % packing:
      raise ValueError(f"block_rows={rows} must be a multiple of {packing} or cover all {n_rows=}")
    return rows


def _fitting_rows(x, chip) -> int:
  """Rows of the backward (3 streams, double-buffered, + float32 temporaries) that fit VMEM."""
  lanes = round_up(x.shape[-1], 128)
  per_row = lanes * (2 * 3 * x.dtype.itemsize + 3 * 4)
  return min(vmem_limit(chip) * 2 // 3 // per_row, MAX_BLOCK_ROWS)


def heuristic(problem, chip: hardware.Chip) -> Config:
  """problem: the call's ``softmax.api.Problem`` (x the (M, N) rows view)."""
  x = problem.x
  n_rows = x.shape[0]
  fitting = _fitting_rows(x, chip)
  if fitting < sublanes(x.dtype) and fitting < n_rows:
    raise ValueError(unsupported(problem, chip))
  rows = n_rows if n_rows <= fitting else 1 << (fitting.bit_length() - 1)
  return Config(block_rows=rows, vmem_limit_bytes=vmem_limit(chip))


def unsupported(problem, chip) -> str | None:
  x = problem.x
  if jnp.dtype(x.dtype) == jnp.float16:
    return "float16 is not a TPU dtype (use bfloat16 or float32)"
  rows = 1
  for d in x.shape[:-1]:
    rows *= d
  if _fitting_rows(x, chip) < min(sublanes(x.dtype), rows):
    return (f"rows of {x.shape[-1]} x {x.dtype} are too wide for {chip.name}'s VMEM "
            f"at {sublanes(x.dtype)} rows a block")
  return None


def _fwd_kernel(x_ref, y_ref):
  x = x_ref[...].astype(jnp.float32)
  peak = jnp.max(x, axis=1, keepdims=True)
  e = exp(x - jnp.where(peak == -jnp.inf, 0.0, peak))
  total = jnp.sum(e, axis=1, keepdims=True)
  y_ref[...] = (e * (1.0 / jnp.where(total == 0, 1.0, total))).astype(y_ref.dtype)


def _bwd_kernel(y_ref, dy_ref, dx_ref):
  y, dy = y_ref[...].astype(jnp.float32), dy_ref[...].astype(jnp.float32)
  dx_ref[...] = (y * (dy - jnp.sum(y * dy, axis=1, keepdims=True))).astype(dx_ref.dtype)


def _call(kernel, inputs, out_dtype, config, cost, name, interpret):
  x = inputs[0]
  rows = config.rows(x)
  block = pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0))
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(x.shape, out_dtype),
      grid=(cdiv(x.shape[0], rows),),
      in_specs=[block] * len(inputs),
      out_specs=block,
      compiler_params=_mosaic_tpu.params(("parallel",), config.vmem_limit_bytes, interpret),
      cost_estimate=cost.estimate(),
      interpret=interpret,
      name=name,
  )(*inputs)


def forward(x, *, config: Config, interpret=False):
  return _call(_fwd_kernel, [x], x.dtype, config, roofline.softmax_fwd(x), "jk_softmax_fwd",
               interpret)


def backward(y, dy, *, config: Config, interpret=False):
  return _call(_bwd_kernel, [y, dy], dy.dtype, config, roofline.softmax_bwd(y),
               "jk_softmax_bwd", interpret)
