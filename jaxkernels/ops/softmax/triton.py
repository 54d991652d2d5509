"""Pallas Triton kernels for softmax over the last axis, forward and backward (CUDA GPUs, sm80+).

Rows up to ``_triton.ONE_PASS_COLS`` wide stay in registers: one read, one write.
Wider rows (vocabularies) use the online softmax: one pass keeps a running
maximum and a sum rescaled as the maximum grows, a second writes the output.
The backward, dx = y * (dy - sum(dy * y)), is the same shape of work.

Online, one program takes one row, ``unroll`` chunks a step, and keeps its
running maximum and sum per lane (one value per column of a chunk), reducing
across the row once at the end: the loop has no cross-warp reduction, so a
step's loads are all in flight together, and few rows are in flight at once,
so the second read of a row can come from the L2 (not measured). Rows that
are not a whole number of 16-byte vectors are read through a flat view, from
vector boundaries (``_triton.RowSteps``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxkernels import _online_softmax, _triton, hardware, roofline
from jaxkernels._activations import exp
from jaxkernels._online_softmax import finite
from jaxkernels._tiling import cdiv
from jaxkernels._triton import FLAT_MAX_ELEMENTS, RowSteps, Tile, load_vector, store_vector

@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(_triton.RowWalkConfig):
  # Online path: a step's loads issued before the previous step's math. Off by default: on the
  # H200 it took the 65536-wide backward to 3040 GB/s (2834 with the default config) but
  # spilled registers at 32768 columns (run 30).
  prefetch: bool = False


def heuristic(problem, chip: hardware.Chip) -> Config:
  """problem: the call's ``softmax.api.Problem`` (x the (M, N) rows view); the row walk's
  shape (``_triton.row_walk``)."""
  del chip
  return Config(**_triton.row_walk(*problem.x.shape))


def unsupported(problem, chip) -> str | None:
  del problem, chip
  return None


def _one_pass_tile(n_rows, n_cols, block_rows, block_cols):
  return Tile.at(pl.program_id(0) * block_rows, block_rows, 0, block_cols, n_rows=n_rows,
                 n_cols=n_cols, mask_rows=n_rows % block_rows != 0,
                 mask_cols=n_cols % block_cols != 0)


def _fwd_kernel(x_ref, y_ref, *, n_rows, n_cols, block_rows, block_cols, unroll, prefetch, vec,
                flat):
  if block_cols >= n_cols:
    t = _one_pass_tile(n_rows, n_cols, block_rows, block_cols)
    x = t.load(x_ref, other=-jnp.inf, streamed=True)
    e = exp(x - finite(jnp.max(x, axis=1))[:, None])
    total = jnp.sum(e, axis=1)
    t.store(y_ref, e * (1.0 / jnp.where(total == 0, 1.0, total))[:, None])
    return

  steps = RowSteps(n_rows=n_rows, n_cols=n_cols, block_rows=block_rows, block_cols=block_cols,
                   unroll=unroll, vec=vec, flat=flat)

  def load(chunks):  # a step's chunks, all in flight before any is used
    return [load_vector(x_ref, o, m, -jnp.inf, _triton.stream_cache_modifier()) for o, m in chunks]

  def online(chunks, xs, state):  # per lane: the running maximum and the sum rescaled to it
    del chunks
    return _online_softmax.lanes_update(state, xs)

  lanes = steps.walk(load, online, _online_softmax.Running(steps.lanes(-jnp.inf),
                                                           steps.lanes(0.0)), prefetch)
  edges = steps.edges()
  edge_xs = load(edges)
  row_peak, row_total = _online_softmax.merge_lanes(lanes, edge_xs)
  scale = 1.0 / jnp.where(row_total == 0, 1.0, row_total)

  def write(chunks, xs, carry):
    for (o, m), x in zip(chunks, xs):
      store_vector(y_ref, o, exp(x - row_peak[:, None]) * scale[:, None], m)
    return carry

  steps.walk(load, write, jnp.int32(0), prefetch)
  write(edges, edge_xs, None)


def _bwd_kernel(y_ref, dy_ref, dx_ref, *, n_rows, n_cols, block_rows, block_cols, unroll,
                prefetch, vec, flat):
  if block_cols >= n_cols:
    t = _one_pass_tile(n_rows, n_cols, block_rows, block_cols)
    y, dy = t.load(y_ref, streamed=True), t.load(dy_ref, streamed=True)
    t.store(dx_ref, y * (dy - jnp.sum(y * dy, axis=1)[:, None]))
    return

  steps = RowSteps(n_rows=n_rows, n_cols=n_cols, block_rows=block_rows, block_cols=block_cols,
                   unroll=unroll, vec=vec, flat=flat)

  def load(chunks):
    return [(load_vector(y_ref, o, m, 0.0, _triton.stream_cache_modifier()),
             load_vector(dy_ref, o, m, 0.0, _triton.stream_cache_modifier()))
            for o, m in chunks]

  def dot(chunks, loaded, acc):  # per lane, reduced across the row once after the loop
    del chunks
    for y, dy in loaded:
      acc = acc + y * dy
    return acc

  edges = steps.edges()
  edge_loaded = load(edges)
  inner = jnp.sum(steps.walk(load, dot, steps.lanes(0.0), prefetch), axis=1)
  for y, dy in edge_loaded:
    inner = inner + jnp.sum(y * dy, axis=1)

  def write(chunks, loaded, carry):
    for (o, m), (y, dy) in zip(chunks, loaded):
      store_vector(dx_ref, o, y * (dy - inner[:, None]), m)
    return carry

  steps.walk(load, write, jnp.int32(0), prefetch)
  write(edges, edge_loaded, None)


def _row_call(kernel, operands, out_dtype, block_rows, num_warps, unroll, config, cost, name,
              interpret):
  n_rows, n_cols = operands[0].shape
  # A 16-byte vector of the narrowest operand: rows of a multiple of it start on a boundary.
  vec = 16 // min(jnp.dtype(d).itemsize for d in (*(a.dtype for a in operands), out_dtype))
  flat = (config.block_cols < n_cols and n_cols % vec != 0
          and n_rows * n_cols < FLAT_MAX_ELEMENTS)  # the online path's flat view (_triton.RowSteps)
  out = pl.pallas_call(
      functools.partial(kernel, n_rows=n_rows, n_cols=n_cols, block_rows=block_rows,
                        block_cols=config.block_cols, unroll=unroll,
                        prefetch=config.prefetch, vec=vec, flat=flat),
      out_shape=jax.ShapeDtypeStruct((n_rows * n_cols,) if flat else (n_rows, n_cols),
                                     out_dtype),
      grid=(cdiv(n_rows, block_rows),),
      compiler_params=_triton.params(num_warps),
      cost_estimate=cost.estimate(),
      interpret=interpret,
      name=name,
  )(*[a.reshape(-1) if flat else a for a in operands])
  return out.reshape(n_rows, n_cols)


def forward(x, *, config: Config, interpret=False):
  return _row_call(_fwd_kernel, (x,), x.dtype, config.block_rows, config.num_warps,
                   config.unroll, config, roofline.softmax_fwd(x), "jk_softmax_fwd", interpret)


def backward(y, dy, *, config: Config, interpret=False):
  return _row_call(_bwd_kernel, (y, dy), dy.dtype, config.bwd_block_rows, config.bwd_num_warps,
                   config.bwd_unroll, config, roofline.softmax_bwd(y), "jk_softmax_bwd",
                   interpret)
