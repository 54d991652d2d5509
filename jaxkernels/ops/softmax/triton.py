"""Pallas Triton kernels for softmax over the last axis, forward and backward (CUDA GPUs, sm80+).

Rows up to ``MAX_ONE_PASS_COLS`` wide stay in registers: one read, one write.
Wider rows (vocabularies) use the online softmax: one pass keeps a running
maximum and a sum rescaled as the maximum grows, a second writes the output.
The backward, dx = y * (dy - sum(dy * y)), is the same shape of work.

Online, one program takes one row, ``unroll`` chunks a step, and keeps its
running maximum and sum per lane (one value per column of a chunk), reducing
across the row once at the end: the loop has no cross-warp reduction, so a
step's loads are all in flight together, and few rows are in flight at once,
so the second read of a row can come from the L2 (not measured).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkernels import hardware, roofline
from jaxkernels._activations import exp
from jaxkernels._pallas import Tile, cdiv, check_fields, is_pow2, next_pow2, triton_params

MAX_ONE_PASS_COLS = 16384
TARGET_TILE = 8192  # as for the norms (bench/NOTES.md)
# Online path, from the H200 sweeps (bench/NOTES.md, runs 29-30): one program of 32 warps an SM
# (64 registers a thread), so few rows are in flight (132 x 128 KiB at 65536 columns, under the
# 50 MB L2: their second read can come from it, not measured); 4 chunks a step, a step at most
# half the row: 16384 columns, 32768 from 65536 on. Against the former 2 rows x 4096 columns on
# 8 warps with a reduction per chunk: 1024x65536 forward +16-23%, backward +25%; 2048x32768
# forward +39%, backward +25%.
ONLINE_WARPS = 32
ONLINE_UNROLL = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  block_rows: int
  block_cols: int  # next_pow2(N) for one pass, else the chunk width
  num_warps: int
  bwd_block_rows: int
  bwd_num_warps: int
  unroll: int = 1  # online path: chunks a loop step, forward
  bwd_unroll: int = 1  # and backward
  # Online path: a step's loads issued before the previous step's math. Off by default: on the
  # H200 it took the 65536-wide backward to 3040 GB/s (2834 with the default config) but
  # spilled registers at 32768 columns (run 30).
  prefetch: bool = False

  def __post_init__(self):
    check_fields(self, ("block_rows", "block_cols", "num_warps", "bwd_block_rows",
                        "bwd_num_warps"), is_pow2, "a power of two (Triton tiles are)")
    check_fields(self, ("unroll", "bwd_unroll"), lambda v: v >= 1, ">= 1")


def heuristic(x, chip: hardware.Chip) -> Config:
  del chip
  n_rows, n_cols = x.shape
  padded = next_pow2(n_cols)
  if padded > MAX_ONE_PASS_COLS:  # online: one row a program
    chunk = 8192 if n_cols >= 65536 else 4096
    return Config(block_rows=1, block_cols=chunk, num_warps=ONLINE_WARPS,
                  bwd_block_rows=1, bwd_num_warps=ONLINE_WARPS, unroll=ONLINE_UNROLL,
                  bwd_unroll=ONLINE_UNROLL)
  block_rows = max(1, min(TARGET_TILE // padded, next_pow2(n_rows)))
  num_warps = max(4, min(16, block_rows * padded // 1024))
  return Config(block_rows=block_rows, block_cols=padded, num_warps=num_warps,
                bwd_block_rows=block_rows, bwd_num_warps=num_warps)


def unsupported(x, chip) -> str | None:
  del x, chip
  return None


def _finite(m):
  """A fully masked row's maximum (-inf) becomes 0, so exp(x - m) is 0, not NaN."""
  return jnp.where(m == -jnp.inf, 0.0, m)


class _Steps:
  """The online path's walk over a row block: ``unroll`` chunks of ``block_cols`` a step."""

  def __init__(self, *, n_rows, n_cols, block_rows, block_cols, unroll):
    self.row0 = pl.program_id(0) * block_rows
    self.n_rows, self.n_cols = n_rows, n_cols
    self.block_rows, self.block_cols, self.unroll = block_rows, block_cols, unroll
    self.count = cdiv(n_cols, block_cols * unroll)
    # Chunks past the row's end (the last step's) are masked out whole.
    self.mask_cols = n_cols % (block_cols * unroll) != 0

  def tiles(self, step):
    return [Tile.at(self.row0, self.block_rows, (step * self.unroll + u) * self.block_cols,
                    self.block_cols, n_rows=self.n_rows, n_cols=self.n_cols,
                    mask_rows=self.n_rows % self.block_rows != 0, mask_cols=self.mask_cols)
            for u in range(self.unroll)]

  def lanes(self, value):
    return jnp.full((self.block_rows, self.block_cols), value, jnp.float32)

  def walk(self, load, body, carry, prefetch: bool):
    """carry = body(tiles, load(tiles), carry) for each step's tiles. With ``prefetch`` a step's
    loads are issued before the previous step's body runs (the last step's are issued twice,
    harmlessly, rather than past the row's end)."""
    if not prefetch:
      def step(s, c):
        tiles = self.tiles(s)
        return body(tiles, load(tiles), c)
      return lax.fori_loop(0, self.count, step, carry)

    def step(s, state):
      c, loaded = state
      ahead = load(self.tiles(jnp.minimum(s + 1, self.count - 1)))
      return body(self.tiles(s), loaded, c), ahead

    return lax.fori_loop(0, self.count, step, (carry, load(self.tiles(0))))[0]


def _one_pass_tile(n_rows, n_cols, block_rows, block_cols):
  return Tile.at(pl.program_id(0) * block_rows, block_rows, 0, block_cols, n_rows=n_rows,
                 n_cols=n_cols, mask_rows=n_rows % block_rows != 0,
                 mask_cols=n_cols % block_cols != 0)


def _fwd_kernel(x_ref, y_ref, *, n_rows, n_cols, block_rows, block_cols, unroll, prefetch):
  if block_cols >= n_cols:
    t = _one_pass_tile(n_rows, n_cols, block_rows, block_cols)
    x = t.load(x_ref, other=-jnp.inf)
    e = exp(x - _finite(jnp.max(x, axis=1))[:, None])
    total = jnp.sum(e, axis=1)
    t.store(y_ref, e * (1.0 / jnp.where(total == 0, 1.0, total))[:, None])
    return

  steps = _Steps(n_rows=n_rows, n_cols=n_cols, block_rows=block_rows, block_cols=block_cols,
                 unroll=unroll)

  def load(tiles):  # a step's chunks, all in flight before any is used
    return [t.load(x_ref, other=-jnp.inf) for t in tiles]

  def online(tiles, xs, carry):  # per lane: the running maximum and the sum rescaled to it
    del tiles
    peak, total = carry
    new_peak = functools.reduce(jnp.maximum, xs, peak)
    safe = _finite(new_peak)
    total = total * exp(peak - safe)
    for x in xs:
      total = total + exp(x - safe)
    return new_peak, total

  peak, total = steps.walk(load, online, (steps.lanes(-jnp.inf), steps.lanes(0.0)), prefetch)
  row_peak = _finite(jnp.max(peak, axis=1))
  row_total = jnp.sum(total * exp(peak - row_peak[:, None]), axis=1)
  scale = 1.0 / jnp.where(row_total == 0, 1.0, row_total)

  def write(tiles, xs, carry):
    for t, x in zip(tiles, xs):
      t.store(y_ref, exp(x - row_peak[:, None]) * scale[:, None])
    return carry

  steps.walk(load, write, jnp.int32(0), prefetch)


def _bwd_kernel(y_ref, dy_ref, dx_ref, *, n_rows, n_cols, block_rows, block_cols, unroll,
                prefetch):
  if block_cols >= n_cols:
    t = _one_pass_tile(n_rows, n_cols, block_rows, block_cols)
    y, dy = t.load(y_ref), t.load(dy_ref)
    t.store(dx_ref, y * (dy - jnp.sum(y * dy, axis=1)[:, None]))
    return

  steps = _Steps(n_rows=n_rows, n_cols=n_cols, block_rows=block_rows, block_cols=block_cols,
                 unroll=unroll)

  def load(tiles):
    return [(t.load(y_ref), t.load(dy_ref)) for t in tiles]

  def dot(tiles, loaded, acc):  # per lane, reduced across the row once after the loop
    del tiles
    for y, dy in loaded:
      acc = acc + y * dy
    return acc

  inner = jnp.sum(steps.walk(load, dot, steps.lanes(0.0), prefetch), axis=1)

  def write(tiles, loaded, carry):
    for t, (y, dy) in zip(tiles, loaded):
      t.store(dx_ref, y * (dy - inner[:, None]))
    return carry

  steps.walk(load, write, jnp.int32(0), prefetch)


def _row_call(kernel, operands, out_dtype, block_rows, num_warps, unroll, config, cost, name,
              interpret):
  n_rows, n_cols = operands[0].shape
  return pl.pallas_call(
      functools.partial(kernel, n_rows=n_rows, n_cols=n_cols, block_rows=block_rows,
                        block_cols=config.block_cols, unroll=unroll,
                        prefetch=config.prefetch),
      out_shape=jax.ShapeDtypeStruct(operands[0].shape, out_dtype),
      grid=(cdiv(n_rows, block_rows),),
      compiler_params=triton_params(num_warps),
      cost_estimate=cost.estimate(),
      interpret=interpret,
      name=name,
  )(*operands)


def forward(x, *, config: Config, interpret=False):
  return _row_call(_fwd_kernel, (x,), x.dtype, config.block_rows, config.num_warps,
                   config.unroll, config, roofline.softmax_fwd(x), "jk_softmax_fwd", interpret)


def backward(y, dy, *, config: Config, interpret=False):
  return _row_call(_bwd_kernel, (y, dy), dy.dtype, config.bwd_block_rows, config.bwd_num_warps,
                   config.bwd_unroll, config, roofline.softmax_bwd(y), "jk_softmax_bwd",
                   interpret)
