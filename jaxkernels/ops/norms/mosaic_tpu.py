"""Pallas Mosaic TPU kernels for rms_norm and layer_norm, forward and backward.

Each grid step holds ``block_rows`` whole rows in VMEM (any width: Mosaic
pads lanes to 128 and masks the reductions), computes in float32 and writes
y (and h). The backward recomputes the row statistics from h instead of
saving them: the VPU has cycles to spare in a memory-bound kernel, and a
(rows, 1) output would be lane-sparse. d(scale) and d(bias) accumulate in a
VMEM-resident output block across the "arbitrary" row axis; the leading
"parallel" axis gives each TensorCore of a megacore chip (v4, v5p) its own
partial row.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkernels import _mosaic_tpu, hardware, roofline
from jaxkernels._mosaic_tpu import MAX_BLOCK_ROWS, sublanes, vmem_limit
from jaxkernels._tiling import cdiv, check_fields, round_up


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  block_rows: int
  bwd_block_rows: int
  vmem_limit_bytes: int

  def __post_init__(self):
    check_fields(self, ("block_rows", "bwd_block_rows", "vmem_limit_bytes"), lambda v: v >= 1, ">= 1")

  def rows(self, name: str, n_rows: int, *dtypes) -> int:
    """The block's row count for an (n_rows, N) array, checked against TPU tiling."""
    rows = min(getattr(self, name), n_rows)
    packing = sublanes(*dtypes)
    if rows != n_rows and rows % packing:
      raise ValueError(
          f"{name}={rows} must be a multiple of {packing} (TPU sublanes for {dtypes}) "
          f"or cover all {n_rows=}")
    return rows


def _fitting_rows(n_cols, streamed, f32_temps, vectors, chip) -> int:
  """Rows per block whose double-buffered streams and float32 temporaries fit the budget."""
  lanes = round_up(n_cols, 128)
  budget = vmem_limit(chip) * 2 // 3  # the rest is Mosaic's own scratch and our estimate's slack
  fixed = vectors * 2 * 8 * lanes * 4  # (1, N) vectors pad to 8 sublanes, double-buffered
  per_row = lanes * (2 * sum(streamed) + 4 * f32_temps)
  return max(0, (budget - fixed) // per_row)


def _streams(x, bias, residual, backward: bool):
  r = residual if residual is not None else None
  fwd = [x.dtype.itemsize, x.dtype.itemsize]  # x in, y out
  if r is not None:
    fwd += [r.dtype.itemsize, r.dtype.itemsize]  # residual in, h out
  if not backward:
    return fwd, 4, 2 if bias is not None else 1
  h = (r if r is not None else x).dtype.itemsize
  bwd = [h, x.dtype.itemsize, x.dtype.itemsize]  # h, dy in; dx out
  if r is not None:
    bwd += [r.dtype.itemsize] * (1 if r.dtype == x.dtype else 2)  # dh in (+ dr out)
  return bwd, 6, 2 * (2 if bias is not None else 1)


def _block_rows(n_rows, fitting, packing) -> int:
  """A power of two >= the sublane packing (so it divides the usual row counts), or all rows."""
  fitting = min(fitting, MAX_BLOCK_ROWS)
  if n_rows <= fitting:
    return n_rows  # one block spanning every row: always a legal block shape
  if fitting < packing:
    return 0
  return 1 << (fitting.bit_length() - 1)


def _rows_fwd_bwd(x, bias, residual, chip) -> tuple[int, int]:
  n_rows, n_cols = x.shape[:-1], x.shape[-1]
  n_rows = max(math.prod(n_rows), 1)
  packing = sublanes(*(a.dtype for a in (x, residual) if a is not None))
  return tuple(
      _block_rows(n_rows, _fitting_rows(n_cols, *_streams(x, bias, residual, bwd), chip), packing)
      for bwd in (False, True))


def heuristic(problem, chip: hardware.Chip) -> Config:
  """problem: the call's ``norms.api.Problem`` (x, residual its (M, N) views). The TPU tiles
  do not depend on the kind of norm."""
  fwd, bwd = _rows_fwd_bwd(problem.x, problem.bias, problem.residual, chip)
  if not (fwd and bwd):
    raise ValueError(unsupported(problem, chip))
  return Config(block_rows=fwd, bwd_block_rows=bwd, vmem_limit_bytes=vmem_limit(chip))


def unsupported(problem, chip: hardware.Chip) -> str | None:
  x, bias, residual = problem.x, problem.bias, problem.residual
  if jnp.float16 in (x.dtype, getattr(residual, "dtype", None)):
    return "float16 is not a TPU dtype (use bfloat16 or float32)"
  if not all(_rows_fwd_bwd(x, bias, residual, chip)):
    return (f"rows of {x.shape[-1]} x {x.dtype} are too wide for {chip.name}'s VMEM "
            f"at {sublanes(x.dtype)} rows a block")
  return None


# --------------------------------------------------------------------------- #
# Kernels
# --------------------------------------------------------------------------- #


def _stats(h, layer, eps):
  """(h - mean or h, rstd) over the last axis, float32."""
  centered = h - jnp.mean(h, axis=1, keepdims=True) if layer else h
  return centered, lax.rsqrt(jnp.mean(centered * centered, axis=1, keepdims=True) + eps)


def _fwd_kernel(*refs, layer, has_residual, has_bias, eps):
  refs = list(refs)
  x_ref = refs.pop(0)
  r_ref = refs.pop(0) if has_residual else None
  s_ref = refs.pop(0)
  b_ref = refs.pop(0) if has_bias else None
  y_ref = refs.pop(0)
  h_ref = refs.pop(0) if has_residual else None

  h = x_ref[...].astype(jnp.float32)
  if has_residual:
    h = h + r_ref[...].astype(jnp.float32)
    h_ref[...] = h.astype(h_ref.dtype)
  centered, rstd = _stats(h, layer, eps)
  y = centered * rstd * s_ref[...].astype(jnp.float32)
  if has_bias:
    y = y + b_ref[...].astype(jnp.float32)
  y_ref[...] = y.astype(y_ref.dtype)


def _bwd_kernel(*refs, layer, has_dh, has_bias, dual_dx, eps, n_rows, block_rows,
                blocks_per_core, mask_rows):
  refs = list(refs)
  h_ref, s_ref, dy_ref = refs.pop(0), refs.pop(0), refs.pop(0)
  dh_ref = refs.pop(0) if has_dh else None
  dx_ref = refs.pop(0)
  dr_ref = refs.pop(0) if dual_dx else None
  ds_ref = refs.pop(0)
  db_ref = refs.pop(0) if has_bias else None

  core, step = pl.program_id(0), pl.program_id(1)
  centered, rstd = _stats(h_ref[...].astype(jnp.float32), layer, eps)
  n = centered * rstd
  dy = dy_ref[...].astype(jnp.float32)
  g = dy * s_ref[...].astype(jnp.float32)
  dh = g - n * jnp.mean(g * n, axis=1, keepdims=True)
  if layer:
    dh = dh - jnp.mean(g, axis=1, keepdims=True)
  dh = dh * rstd
  if has_dh:
    dh = dh + dh_ref[...].astype(jnp.float32)
  dx_ref[...] = dh.astype(dx_ref.dtype)
  if dual_dx:
    dr_ref[...] = dh.astype(dr_ref.dtype)

  dyn = dy * n
  if mask_rows:  # rows past the end hold stale VMEM: keep them out of the column sums
    inside = _mosaic_tpu.row_mask(core * blocks_per_core + step, block_rows, n_rows)
    dyn = jnp.where(inside, dyn, 0.0)
    dy = jnp.where(inside, dy, 0.0)

  @pl.when(step == 0)
  def _():
    ds_ref[...] = jnp.zeros_like(ds_ref)
    if has_bias:
      db_ref[...] = jnp.zeros_like(db_ref)

  ds_ref[...] += jnp.sum(dyn, axis=0, keepdims=True)
  if has_bias:
    db_ref[...] += jnp.sum(dy, axis=0, keepdims=True)


# --------------------------------------------------------------------------- #
# Wrappers
# --------------------------------------------------------------------------- #


def forward(x, scale, bias, residual, *, layer: bool, eps: float, config: Config,
            interpret=False):
  """x, residual: (M, N). Returns (y, h or None, ()) -- no saved statistics."""
  n_rows, n_cols = x.shape
  rows = config.rows("block_rows", n_rows, *(a.dtype for a in (x, residual) if a is not None))
  row_block = pl.BlockSpec((rows, n_cols), lambda i: (i, 0))
  vector = pl.BlockSpec((1, n_cols), lambda i: (0, 0))
  in_specs = [row_block]
  inputs = [x]
  if residual is not None:
    in_specs.append(row_block)
    inputs.append(residual)
  in_specs.append(vector)
  inputs.append(scale.reshape(1, n_cols))
  if bias is not None:
    in_specs.append(vector)
    inputs.append(bias.reshape(1, n_cols))
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
  if residual is not None:
    out_shape.append(jax.ShapeDtypeStruct(residual.shape, residual.dtype))
  outs = pl.pallas_call(
      functools.partial(_fwd_kernel, layer=layer, has_residual=residual is not None,
                        has_bias=bias is not None, eps=eps),
      out_shape=out_shape,
      grid=(cdiv(n_rows, rows),),
      in_specs=in_specs,
      out_specs=[row_block] * len(out_shape),
      compiler_params=_mosaic_tpu.params(("parallel",), config.vmem_limit_bytes, interpret),
      cost_estimate=roofline.norm_fwd(x, scale, bias, residual, layer=layer).estimate(),
      interpret=interpret,
      name=f"jk_{'layer' if layer else 'rms'}_norm_fwd",
  )(*inputs)
  return outs[0], (outs[1] if residual is not None else None), ()


def backward(h, scale, bias, stats, dy, dh, *, layer: bool, eps: float, config: Config,
             residual_dtype=None, interpret=False):
  """Returns (dx, dresidual or None, dscale, dbias or None); see triton.backward."""
  del stats
  n_rows, n_cols = h.shape
  rows = config.rows("bwd_block_rows", n_rows, h.dtype, dy.dtype)
  n_blocks = cdiv(n_rows, rows)
  cores = 2 if n_blocks % 2 == 0 else 1  # a megacore split needs an even block count
  per_core = n_blocks // cores
  dual_dx = residual_dtype is not None and jnp.dtype(residual_dtype) != dy.dtype

  row_block = pl.BlockSpec((rows, n_cols), lambda c, i: (c * per_core + i, 0))
  vector = pl.BlockSpec((1, n_cols), lambda c, i: (0, 0))
  partial_row = pl.BlockSpec((pl.squeezed, 1, n_cols), lambda c, i: (c, 0, 0))
  inputs = [h, scale.reshape(1, n_cols), dy] + ([dh] if dh is not None else [])
  in_specs = [row_block, vector, row_block] + ([row_block] if dh is not None else [])
  out_shape = [jax.ShapeDtypeStruct(h.shape, dy.dtype)]
  if dual_dx:
    out_shape.append(jax.ShapeDtypeStruct(h.shape, residual_dtype))
  out_specs = [row_block] * len(out_shape)
  partial_sums = jax.ShapeDtypeStruct((cores, 1, n_cols), jnp.float32)
  out_shape += [partial_sums] * (2 if bias is not None else 1)
  out_specs += [partial_row] * (2 if bias is not None else 1)

  outs = pl.pallas_call(
      functools.partial(_bwd_kernel, layer=layer, has_dh=dh is not None,
                        has_bias=bias is not None, dual_dx=dual_dx, eps=eps, n_rows=n_rows,
                        block_rows=rows, blocks_per_core=per_core,
                        mask_rows=n_rows % rows != 0),
      out_shape=out_shape,
      grid=(cores, per_core),
      in_specs=in_specs,
      out_specs=out_specs,
      compiler_params=_mosaic_tpu.params(("parallel", "arbitrary"), config.vmem_limit_bytes, interpret),
      cost_estimate=roofline.norm_bwd(dy, scale, bias, dh, layer=layer).estimate(),
      interpret=interpret,
      name=f"jk_{'layer' if layer else 'rms'}_norm_bwd",
  )(*inputs)
  outs = list(outs)
  dx = outs.pop(0)
  dr = outs.pop(0) if dual_dx else None
  dscale = outs.pop(0).sum(axis=(0, 1)).astype(scale.dtype)
  dbias = outs.pop(0).sum(axis=(0, 1)).astype(bias.dtype) if bias is not None else None
  return dx, dr, dscale, dbias
