"""Pallas Triton kernels for softmax over the last axis, forward and backward (CUDA GPUs, sm80+).

Rows up to ``MAX_ONE_PASS_COLS`` wide stay in registers: one read, one write.
Wider rows (vocabularies) use the online softmax: one pass keeps a running
maximum and a sum rescaled as the maximum grows, a second writes the output.
The backward, dx = y * (dy - sum(dy * y)), is the same shape of work.

Online, one program takes one row, ``unroll`` chunks a step, and keeps its
running maximum and sum per lane (one value per column of a chunk), reducing
across the row once at the end: the loop has no cross-warp reduction, so a
step's loads are all in flight together, and few rows are in flight at once,
so the second read of a row can come from the L2 (not measured). Rows that
are not a whole number of 16-byte vectors are read through a flat view, from
vector boundaries (``_Steps``).
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
from jaxkernels._pallas import (STREAMED, Tile, both, cdiv, check_fields, is_pow2,
                                load_vector, next_pow2, store_vector, triton_params)

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


# The flat view's offsets are int32 (Pallas kernels trace without 64-bit integers): arrays of
# more elements take the 2-D indexing, whose offsets Pallas widens itself.
FLAT_MAX_ELEMENTS = 2**31


class _Steps:
  """The online path's walk over a row block: ``unroll`` chunks of ``block_cols`` a step.

  Rows of a whole number of 16-byte vectors (``vec`` elements) are indexed as (row, column) of
  the (M, N) array. Other rows start and end off a vector boundary, and a load whose columns
  might cross one is issued element by element (16-bit loads for bfloat16: 1.4-1.9 TB/s at
  N = 50257, run 30). Those (``flat``) are read through the flat view of the array: each row's
  body, from the first vector boundary at or after its start to the last one at or before its
  end, is walked in chunks that start on a boundary and are masked at one (vector loads), and
  its head and tail, under ``vec`` elements each, are loaded apart (run 38: 2.1-2.8 TB/s).
  A row shorter than ``vec`` (only under a config's small ``block_cols``) is all head.
  """

  def __init__(self, *, n_rows, n_cols, block_rows, block_cols, unroll, vec, flat):
    self.rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
    self.flat, self.vec = flat, vec
    self.row_mask = self.rows < n_rows if n_rows % block_rows else None
    self.block_rows, self.block_cols, self.unroll = block_rows, block_cols, unroll
    self.n_cols = n_cols
    self.count = cdiv(n_cols, block_cols * unroll)
    # Chunks past the row's (the body's) end, the last step's, are masked out whole.
    self.mask_cols = flat or n_cols % (block_cols * unroll) != 0
    if flat:
      self.start = self.rows * n_cols
      self.end = self.start + n_cols
      self.short = n_cols < vec  # no vector boundary need lie inside the row
      if self.short:
        self.body0 = self.body1 = self.end
      else:  # multiples of vec that Triton's alignment analysis can see through
        self.body0 = (self.start + vec - 1) // vec * vec
        self.body1 = self.end // vec * vec

  def _masked(self, mask):
    return both(mask, None if self.row_mask is None else self.row_mask[:, None])

  def chunks(self, step):
    """(index, mask) of each of a step's chunks, (block_rows, block_cols) each."""
    out = []
    for u in range(self.unroll):
      cols = (step * self.unroll + u) * self.block_cols + jnp.arange(self.block_cols)
      if self.flat:
        offsets = self.body0[:, None] + cols[None, :]
        out.append((offsets, self._masked(offsets < self.body1[:, None])))
      else:
        mask = (cols < self.n_cols)[None, :] if self.mask_cols else None
        out.append(((self.rows[:, None], cols[None, :]), self._masked(mask)))
    return out

  def edges(self):
    """(index, mask) of the elements before the body and after it: none unless flat."""
    if not self.flat:
      return []
    lane = jnp.arange(self.vec)[None, :]
    head = self.start[:, None] + lane
    edges = [(head, self._masked(head < self.body0[:, None]))]
    if not self.short:
      tail = self.body1[:, None] + lane
      edges.append((tail, self._masked(tail < self.end[:, None])))
    return edges

  def lanes(self, value):
    return jnp.full((self.block_rows, self.block_cols), value, jnp.float32)

  def walk(self, load, body, carry, prefetch: bool):
    """carry = body(chunks, load(chunks), carry) for each step's chunks. With ``prefetch`` a
    step's loads are issued before the previous step's body runs (the last step's are issued
    twice, harmlessly, rather than past the row's end)."""
    if not prefetch:
      def step(s, c):
        chunks = self.chunks(s)
        return body(chunks, load(chunks), c)
      return lax.fori_loop(0, self.count, step, carry)

    def step(s, state):
      c, loaded = state
      ahead = load(self.chunks(jnp.minimum(s + 1, self.count - 1)))
      return body(self.chunks(s), loaded, c), ahead

    return lax.fori_loop(0, self.count, step, (carry, load(self.chunks(0))))[0]


def _one_pass_tile(n_rows, n_cols, block_rows, block_cols):
  return Tile.at(pl.program_id(0) * block_rows, block_rows, 0, block_cols, n_rows=n_rows,
                 n_cols=n_cols, mask_rows=n_rows % block_rows != 0,
                 mask_cols=n_cols % block_cols != 0)


def _fwd_kernel(x_ref, y_ref, *, n_rows, n_cols, block_rows, block_cols, unroll, prefetch, vec,
                flat):
  if block_cols >= n_cols:
    t = _one_pass_tile(n_rows, n_cols, block_rows, block_cols)
    x = t.load(x_ref, other=-jnp.inf, streamed=True)
    e = exp(x - _finite(jnp.max(x, axis=1))[:, None])
    total = jnp.sum(e, axis=1)
    t.store(y_ref, e * (1.0 / jnp.where(total == 0, 1.0, total))[:, None])
    return

  steps = _Steps(n_rows=n_rows, n_cols=n_cols, block_rows=block_rows, block_cols=block_cols,
                 unroll=unroll, vec=vec, flat=flat)

  def load(chunks):  # a step's chunks, all in flight before any is used
    return [load_vector(x_ref, o, m, -jnp.inf, STREAMED) for o, m in chunks]

  def online(chunks, xs, carry):  # per lane: the running maximum and the sum rescaled to it
    del chunks
    peak, total = carry
    new_peak = functools.reduce(jnp.maximum, xs, peak)
    safe = _finite(new_peak)
    total = total * exp(peak - safe)
    for x in xs:
      total = total + exp(x - safe)
    return new_peak, total

  peak, total = steps.walk(load, online, (steps.lanes(-jnp.inf), steps.lanes(0.0)), prefetch)
  edges = steps.edges()
  edge_xs = load(edges)
  row_peak = functools.reduce(jnp.maximum, [jnp.max(e, axis=1) for e in edge_xs],
                              jnp.max(peak, axis=1))
  row_peak = _finite(row_peak)
  row_total = jnp.sum(total * exp(peak - row_peak[:, None]), axis=1)
  for e in edge_xs:
    row_total = row_total + jnp.sum(exp(e - row_peak[:, None]), axis=1)
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

  steps = _Steps(n_rows=n_rows, n_cols=n_cols, block_rows=block_rows, block_cols=block_cols,
                 unroll=unroll, vec=vec, flat=flat)

  def load(chunks):
    return [(load_vector(y_ref, o, m, 0.0, STREAMED), load_vector(dy_ref, o, m, 0.0, STREAMED))
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
          and n_rows * n_cols < FLAT_MAX_ELEMENTS)  # the online path's flat view (_Steps)
  out = pl.pallas_call(
      functools.partial(kernel, n_rows=n_rows, n_cols=n_cols, block_rows=block_rows,
                        block_cols=config.block_cols, unroll=unroll,
                        prefetch=config.prefetch, vec=vec, flat=flat),
      out_shape=jax.ShapeDtypeStruct((n_rows * n_cols,) if flat else (n_rows, n_cols),
                                     out_dtype),
      grid=(cdiv(n_rows, block_rows),),
      compiler_params=triton_params(num_warps),
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
