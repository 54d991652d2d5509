"""Pallas Mosaic GPU kernels for softmax, forward and backward (Hopper): the norms' walk over
whole rows (``_mosaic_gpu.Row``), one-warpgroup CTAs each taking a run of rows (or, where
rows are too wide for several CTAs an SM, a persistent grid), each row block brought into
shared memory by a bulk copy ahead of its use and written out from registers.

The forward takes the row's maximum, then its exponentials and their sum, then writes
exp(x - max) / sum; a row that fits registers (``Row.fits_registers``) is read from shared
memory and exponentiated once, a wider one at each use. A fully masked row (all -inf) gives
zeros, as the reference does. The backward writes y (dy - sum(y dy)). Rows must fit shared
memory twice over (two blocks in flight); wider ones, a vocabulary's, go to the Triton
kernel's online softmax.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkernels import _activations, _mosaic_gpu, hardware

@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(_mosaic_gpu.RowConfig):
  """The row walk's blocks, forward (x) and backward (y and dy)."""


def most_stages(problem, chip, *, backward: bool, rows: int, ctas_per_sm: int) -> int:
  """Blocks of ``rows`` rows a CTA's rings hold (x forward; y and dy backward), ``ctas_per_sm``
  CTAs sharing an SM's shared memory (``_mosaic_gpu.ring_stages``)."""
  block = rows * problem.x.shape[1] * jnp.dtype(problem.x.dtype).itemsize
  return _mosaic_gpu.ring_stages(chip, ctas_per_sm, [block] * (2 if backward else 1), [])


# Rows a CTA where the hardware hands out runs of them (``Config.per_cta``), and the CTAs an
# SM whose shared memory must fit for that to pay (else a persistent grid).
RUN = 2
RUN_CTAS_PER_SM = 4


def heuristic(problem, chip: hardware.Chip) -> Config:
  """problem: the call's ``softmax.api.Problem``. One row a step. Runs of RUN rows a CTA, the
  hardware handing them out as CTAs end, where RUN_CTAS_PER_SM CTAs' rings fit an SM: on an
  H200 at (16384, 4096) bf16 the forward 0.067 ms against 0.078 on a persistent grid and
  Triton's 0.069 (notes/mgpurows.md mgpu-rows-2). Rows too wide for that (one or two CTAs an SM)
  take a persistent grid at the most CTAs an SM that fit two blocks, up to three, as many
  blocks in flight as fit, up to 8: a row's chain of two reductions and an exp leaves one warp
  a scheduler mostly waiting, and more CTAs overlap more rows' (mgpu-rows-1)."""
  def walk(backward):
    most = most_stages(problem, chip, backward=backward, rows=1, ctas_per_sm=RUN_CTAS_PER_SM)
    if most >= RUN:
      return RUN_CTAS_PER_SM, min(8, most), _mosaic_gpu.run_length(problem.x.shape[0], RUN,
                                                                   chip)
    for per_sm in (3, 2, 1):
      most = most_stages(problem, chip, backward=backward, rows=1, ctas_per_sm=per_sm)
      if most >= 2:
        return per_sm, min(8, most), 0
    return 1, 1, 0
  per_sm, stages, run = walk(False)
  bwd_per_sm, bwd_stages, bwd_run = walk(True)
  return Config(stages=stages, ctas_per_sm=per_sm, rows=1, bwd_stages=bwd_stages,
                bwd_ctas_per_sm=bwd_per_sm, bwd_rows=1, per_cta=run, bwd_per_cta=bwd_run)


def unsupported(problem, chip) -> str | None:
  reason = _mosaic_gpu.hopper_reason(chip)
  if reason is not None:
    return reason
  n_cols = problem.x.shape[1]
  reason = _mosaic_gpu.width_reason(n_cols, problem.x.dtype, jnp.float32)
  if reason is not None:
    return reason
  if most_stages(problem, chip, backward=True, rows=1, ctas_per_sm=1) < 2:
    return (f"mosaic_gpu holds two rows of y and dy ({n_cols} columns) in shared memory, more "
            f"than the {_mosaic_gpu.cta_smem_bytes(chip)} bytes a CTA has; the Triton kernel's "
            "online softmax takes rows this wide")
  return None


def config_error(problem, config: Config, chip: hardware.Chip) -> str | None:
  return config.error(most_stages, problem, chip)


# --------------------------------------------------------------------------- #
# Kernels
# --------------------------------------------------------------------------- #


def _fwd_kernel(x_g, y_g, *, n_blocks, rows, row, stages, ctas, per_cta):
  cta = lax.axis_index("cta")
  count, block, spec = _mosaic_gpu.row_blocks(cta, ctas, n_blocks, rows, row, per_cta)
  resident = row.fits_registers(rows)  # each row read and exponentiated once

  def body(indices, x_block):
    (i,) = indices
    first = block(i) * rows
    stats = []
    for j in range(rows):  # every row's statistics, then the outputs, the rows side by side
      x = row.held(lambda c, j=j: row.load(x_block.at[j], c), resident)
      peak = row.peak(x)
      peak = jnp.where(peak == -jnp.inf, 0.0, peak)  # a fully masked row: zeros, not NaN
      e = row.held(lambda c, x=x, peak=peak: _activations.exp(x(c) - peak), resident)
      (total,) = row.sums(lambda c, e=e: (e(c),))
      stats.append((e, 1.0 / jnp.where(total == 0.0, 1.0, total)))
    for c in row.chunks:
      for j, (e, scale) in enumerate(stats):
        y_g.at[first + j, row.cols(c)][...] = (e(c) * scale).astype(y_g.dtype)
    plgpu.commit_smem()  # every thread's reads done before the slot is refilled

  plgpu.emit_pipeline(body, grid=(count,), in_specs=[spec], max_concurrent_steps=stages)(x_g)


def _bwd_kernel(y_g, dy_g, dx_g, *, n_blocks, rows, row, stages, ctas, per_cta):
  cta = lax.axis_index("cta")
  count, block, spec = _mosaic_gpu.row_blocks(cta, ctas, n_blocks, rows, row, per_cta)
  resident = row.fits_registers(2 * rows)

  def body(indices, y_block, dy_block):
    (i,) = indices
    first = block(i) * rows
    ys = [row.held(lambda c, j=j: row.load(y_block.at[j], c), resident) for j in range(rows)]
    dys = [row.held(lambda c, j=j: row.load(dy_block.at[j], c), resident) for j in range(rows)]
    inner = [row.sums(lambda c, y=y, dy=dy: (y(c) * dy(c),))[0] for y, dy in zip(ys, dys)]
    for c in row.chunks:
      for j in range(rows):
        dx = ys[j](c) * (dys[j](c) - inner[j])
        dx_g.at[first + j, row.cols(c)][...] = dx.astype(dx_g.dtype)
    plgpu.commit_smem()

  plgpu.emit_pipeline(body, grid=(count,), in_specs=[spec, spec],
                      max_concurrent_steps=stages)(y_g, dy_g)


def _call(kernel, operands, out_dtype, *, stages, ctas_per_sm, rows, per_cta, name, interpret):
  n_rows, n_cols = operands[0].shape
  row = _mosaic_gpu.Row.of(n_cols, interpret, *operands)
  rows = rows if n_rows % rows == 0 else 1
  n_blocks = n_rows // rows
  per_cta, ctas, stages = _mosaic_gpu.row_launch(n_blocks, ctas_per_sm, per_cta, stages)
  body = functools.partial(kernel, n_blocks=n_blocks, rows=rows, row=row, stages=stages,
                           ctas=ctas, per_cta=per_cta)
  out_type = jax.ShapeDtypeStruct(row.pieces(operands[0]).shape, out_dtype)
  out = _mosaic_gpu.row_kernel(body, out_type, [], ctas, name=name, interpret=interpret,
                               approx_math=not interpret)(*[row.pieces(a) for a in operands])
  return out.reshape(n_rows, n_cols)


def forward(x, *, config: Config, interpret=False):
  return _call(_fwd_kernel, (x,), x.dtype, stages=config.stages,
               ctas_per_sm=config.ctas_per_sm, rows=config.rows, per_cta=config.per_cta,
               name="jk_softmax_fwd_mgpu", interpret=interpret)


def backward(y, dy, *, config: Config, interpret=False):
  return _call(_bwd_kernel, (y, dy), dy.dtype, stages=config.bwd_stages,
               ctas_per_sm=config.bwd_ctas_per_sm, rows=config.bwd_rows,
               per_cta=config.bwd_per_cta, name="jk_softmax_bwd_mgpu", interpret=interpret)
