"""The Hopper matmul's epilogue: what the epilogue reads and writes (``Epilogue``: the
outputs, their shared-memory buffers, the bias and scale vectors), and each warpgroup's float32
tile written out through shared memory by TMA in pieces: scales, bias, activation, residual,
and under glu act(gate) * up from its two accumulators."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkernels import _mosaic_gpu
from jaxkernels._activations import apply as activation_apply
from jaxkernels.ops.matmul.common import Problem
from jaxkernels.ops.matmul.mosaic_gpu.config import Config


class Epilogue(NamedTuple):
  """Refs the epilogue reads and writes (outputs in gmem, their shared-memory buffers,
  vectors) and the 1/x its activation takes (None: division)."""

  y_smem: Any
  z_smem: Any
  bias_smem: Any
  as_smem: Any
  bs_smem: Any
  vec_barrier: Any
  res_barrier: Any
  bias_gmem: Any
  res_gmem: Any
  as_gmem: Any
  bs_gmem: Any
  y_gmem: Any
  z_gmem: Any
  math: Any  # _activations.Math

  @staticmethod
  def scratch(p: Problem, c: Config) -> dict:
    """The shared-memory allocations behind the first seven fields."""
    out_transforms = _mosaic_gpu.swizzled(c.epi_tile_n, p.out_dtype)
    out_buffers = lambda: plgpu.SMEM((2, c.epi_slots, c.epi_tile_m, c.epi_tile_n), p.out_dtype,
                                     transforms=out_transforms)
    return dict(
        y_smem=out_buffers(),
        z_smem=(plgpu.SMEM((2, c.epi_slots * (2 if p.glu else 1), c.epi_tile_m, c.epi_tile_n),
                           p.out_dtype, transforms=out_transforms)
                if p.save_preactivation else None),
        # Epilogue vectors, per warpgroup and per tile parity (so that the next tile's load
        # never lands while a lagging warp still reads this tile's).
        bias_smem=plgpu.SMEM((2, 2, c.tile_n), jnp.float32) if p.has_bias else None,
        as_smem=plgpu.SMEM((2, 2, c.tile_m), jnp.float32) if p.has_scales else None,
        bs_smem=plgpu.SMEM((2, 2, c.tile_n), jnp.float32) if p.has_scales else None,
        vec_barrier=(plgpu.Barrier(num_barriers=2 * 2 * 3)
                     if p.has_bias or p.has_scales else None),
        res_barrier=plgpu.Barrier(num_barriers=2 * c.epi_slots) if p.has_residual else None,
    )

  def load_vectors(self, p: Problem, wg, parity, rows, cols, when=None) -> list:
    """Starts the TMA loads of this warpgroup's bias and scale pieces (only where ``when``
    holds, if given); returns their barriers."""
    loads = []
    if p.has_bias:
      loads.append((self.bias_gmem, self.bias_smem, cols))
    if p.has_scales:
      loads += [(self.as_gmem, self.as_smem, rows), (self.bs_gmem, self.bs_smem, cols)]
    barriers = [self.vec_barrier.at[(wg * 2 + parity) * 3 + which] for which in range(len(loads))]

    def start():
      for (gmem, smem, index), barrier in zip(loads, barriers):
        plgpu.copy_gmem_to_smem(gmem.at[index], smem.at[wg, parity], barrier)

    if loads:
      start() if when is None else pl.when(when)(start)
    return barriers


def sub(cta_slice, wg_slice, size):
  """The warpgroup's part of a CTA range, as one pl.ds."""
  if isinstance(wg_slice, slice):
    return cta_slice
  return pl.ds(cta_slice.start + wg_slice.start, size)


def write_tile(acc, e: Epilogue, wg, parity, cta_rows, cta_cols, wg_rows, wg_cols, *,
                problem, config):
  """The epilogue on a warpgroup's float32 tile, written through shared memory by TMA.

  Where C is not a whole number of CTA tiles, pieces that would start past its end are not
  stored (a TMA copy starting past an array's end came out wrong, ``_padded_extent``), so C
  needs no padding to whole tiles; pieces that start inside and run past the end are clipped.
  """
  p, c = problem, config
  if p.glu:
    return write_glu_tile(acc, e, wg, cta_rows, cta_cols, wg_rows, problem=p, config=c)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  pieces_n = c.tile_n // c.epi_tile_n
  c_rows, c_cols = e.y_gmem.shape
  ragged = c_rows % c.cta_m != 0 or c_cols % c.cta_n != 0
  row0 = sub(cta_rows, wg_rows, c.tile_m).start
  col0 = sub(cta_cols, wg_cols, c.tile_n).start
  for pm in range(c.tile_m // c.epi_tile_m):
    for pn in range(pieces_n):
      rows = slice(pm * c.epi_tile_m, (pm + 1) * c.epi_tile_m)
      cols = slice(pn * c.epi_tile_n, (pn + 1) * c.epi_tile_n)
      slot = (pm * pieces_n + pn) % c.epi_slots
      dest = lambda gmem: gmem.at[cta_rows, cta_cols].at[wg_rows, wg_cols].at[rows, cols]
      shape = (c.epi_tile_m, c.epi_tile_n)
      z = acc[rows, cols]
      if p.has_scales:
        a_scale = e.as_smem[wg, parity, rows]
        b_scale = e.bs_smem[wg, parity, cols]
        z = z * lax.broadcast_in_dim(a_scale, shape, [0]) * lax.broadcast_in_dim(b_scale, shape, [1])
      if p.has_bias:
        z = z + lax.broadcast_in_dim(e.bias_smem[wg, parity, cols], shape, [1])
      y = z if p.activation is None else activation_apply(p.activation, z, e.math)
      # Buffer `slot` was last stored epi_slots pieces ago: wait until that store has read it.
      # Only now, so that this piece's arithmetic runs while the earlier store drains (the
      # wait is a barrier the compiler cannot hoist the arithmetic across).
      plgpu.wait_smem_to_gmem(c.epi_slots - 1, wait_read_only=True)
      if p.has_residual:
        barrier = e.res_barrier.at[wg * c.epi_slots + slot]
        plgpu.copy_gmem_to_smem(dest(e.res_gmem), e.y_smem.at[wg, slot], barrier)
        plgpu.barrier_wait(barrier)
        y = y + e.y_smem[wg, slot].astype(jnp.float32)
      e.y_smem[wg, slot] = y.astype(p.out_dtype)
      if e.z_smem is not None:
        e.z_smem[wg, slot] = z.astype(p.out_dtype)
      plgpu.commit_smem()

      def store(slot=slot, dest=dest):
        plgpu.copy_smem_to_gmem(e.y_smem.at[wg, slot], dest(e.y_gmem))
        if e.z_smem is not None:
          plgpu.copy_smem_to_gmem(e.z_smem.at[wg, slot], dest(e.z_gmem))

      if ragged:
        pl.when((row0 + rows.start < c_rows) & (col0 + cols.start < c_cols))(store)
      else:
        store()


def write_glu_tile(acc, e: Epilogue, wg, cta_rows, cta_cols, wg_rows, *, problem, config):
  """The gated epilogue: y = act(gate) * up from the warpgroup's two float32 accumulators
  (each ``tile_m x tile_n / 2``), and with ``save_preactivation`` both of them into z's
  halves, through shared memory by TMA in ``epi_tile_m x epi_tile_n`` pieces.

  The warpgroup's y columns start at half its accumulator columns' start (a CTA tile of
  ``cta_n`` product columns writes ``cta_n / 2`` of y); they are whole CTA tiles
  (``config._glu_error``), so only rows can be ragged.
  """
  p, c = problem, config
  gate, up = acc
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  c_rows = e.y_gmem.shape[0]
  row0 = sub(cta_rows, wg_rows, c.tile_m).start
  col0 = cta_cols.start  # y's (_tile_slices)
  if c.cooperative and c.split == "n":
    col0 = col0 + wg * (c.tile_n // 2)
  pieces_n = c.tile_n // 2 // c.epi_tile_n
  copies = 3 if e.z_smem is not None else 1  # a piece's stores, one bulk group each
  for pm in range(c.tile_m // c.epi_tile_m):
    for pn in range(pieces_n):
      rows = slice(pm * c.epi_tile_m, (pm + 1) * c.epi_tile_m)
      cols = slice(pn * c.epi_tile_n, (pn + 1) * c.epi_tile_n)
      slot = (pm * pieces_n + pn) % c.epi_slots
      out_rows = pl.ds(row0 + rows.start, c.epi_tile_m)
      out_cols = lambda offset, cols=cols: pl.ds(offset + col0 + cols.start, c.epi_tile_n)
      g, u = gate[rows, cols], up[rows, cols]
      y = activation_apply(p.activation, g, e.math) * u
      # Buffer `slot` was last stored epi_slots pieces ago: wait until those stores have read
      # it, and no longer (the later pieces' may still run).
      plgpu.wait_smem_to_gmem((c.epi_slots - 1) * copies, wait_read_only=True)
      e.y_smem[wg, slot] = y.astype(p.out_dtype)
      if e.z_smem is not None:
        e.z_smem[wg, 2 * slot] = g.astype(p.out_dtype)
        e.z_smem[wg, 2 * slot + 1] = u.astype(p.out_dtype)
      plgpu.commit_smem()

      def store(slot=slot, out_rows=out_rows, out_cols=out_cols):
        plgpu.copy_smem_to_gmem(e.y_smem.at[wg, slot], e.y_gmem.at[out_rows, out_cols(0)])
        if e.z_smem is not None:
          for half, offset in enumerate((0, p.out_n)):
            plgpu.copy_smem_to_gmem(e.z_smem.at[wg, 2 * slot + half],
                                    e.z_gmem.at[out_rows, out_cols(offset)])

      if c_rows % c.cta_m:
        pl.when(row0 + rows.start < c_rows)(store)
      else:
        store()
