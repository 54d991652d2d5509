"""What the forward and the backward kernels share: the warpgroups' roles, the ring of key
(or query) blocks each CTA walks and each compute warpgroup's runs of it, the producer's loop,
the segments' meeting blocks, the kernels' names; and the backward kernels' (dq, dk/dv,
d(bias)) arithmetic: P from the saved log-sum-exp, dS, products of transposed blocks.

Every kernel here is a CTA of three warpgroups: two compute ("consumer") warpgroups, 0 and 1,
each with its own block of rows and accumulators, and one producer, 2, that issues the TMA
loads of the blocks the consumers walk. A ring slot is released by both consumers (each
arrives on its ``free`` barrier), and the forward's consumers take turns at the tensor cores
on a barrier that both arrive at.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkernels import _mosaic_gpu
from jaxkernels._activations import LOG2E
from jaxkernels.ops.attention.common import Call, Window, key_blocks

CONSUMERS = 2  # compute warpgroups, 0 and 1: the arrivals that release a slot
PRODUCER = CONSUMERS  # the producer warpgroup's index
WARPGROUPS = CONSUMERS + 1
ROWS = 64  # a consumer's rows: a wgmma's M for one warpgroup


def is_producer(wg):
  return wg == PRODUCER


def is_consumer(wg):
  return wg < CONSUMERS


class Walk(NamedTuple):
  """A compute warpgroup's key blocks (``common.key_blocks``' runs, empty where its queries
  lie past T) inside the ring's steps [lo, hi): the union of both warpgroups' runs."""

  first: Any
  full_first: Any
  full_end: Any
  end: Any


def ring(tile, n_rows: int, n_cols: int, block: int, window: Window, meet=None,
          shared: bool = False):
  """(lo, hi, walks): the ring's blocks of ``block`` columns for a CTA's two blocks of 64 rows
  (queries against keys: the forward's and dq's; keys against queries, ``window`` seen from
  the keys: dk/dv's), and each block's walk; with ``shared``, the two warpgroups' rows are the
  same 64 (tile's; dk/dv's head-dim halves); with ``meet`` (first, end), only the column
  blocks in [first, end) (those whose segments can meet the tile's)."""
  raw, some = [], []
  for w in (0, 1):
    row0 = tile * 64 if shared else (2 * tile + w) * 64
    rows = jnp.clip(n_rows - row0, 0, 64)  # none past the end
    raw.append(key_blocks(row0, rows, block, n_cols, window))
    some.append((rows > 0) & (raw[-1][3] > raw[-1][0]))
  big = jnp.int32(1 << 30)
  lo = jnp.minimum(*(jnp.where(s, r[0], big) for s, r in zip(some, raw)))
  hi = jnp.maximum(*(jnp.where(s, r[3], 0) for s, r in zip(some, raw)))
  lo = jnp.where(hi > 0, lo, 0)
  walks = [Walk(*(jnp.where(s, x, hi) for x in r)) for s, r in zip(some, raw)]
  if meet is not None:
    lo = jnp.maximum(lo, meet[0])
    hi = jnp.maximum(jnp.minimum(hi, meet[1]), lo)
    walks = [Walk(*(jnp.clip(x, lo, hi) for x in w)) for w in walks]
  return lo, hi, walks


def produce(lo, end, stages: int, streams):
  """A producer warpgroup's rings of ``stages`` slots: for every step j in [lo, end) and each
  stream ``(free, load)``, ``load(j, slot)`` into slot (j - lo) mod stages, a refill first
  waiting for the slot's release on ``free`` (each stream on its own, so that one ring's
  refill does not wait for another's release); then the releases that no refill waited for,
  so that every barrier ends with each phase observed."""
  slot = lambda j: lax.rem(j - lo, jnp.int32(stages))

  @pl.loop(lo, end)
  def _(j):
    for free, load in streams:
      @pl.when(j - lo >= stages)
      def _():
        plgpu.barrier_wait(free.at[slot(j)])
      load(j, slot(j))

  @pl.loop(jnp.maximum(end - stages, lo), end)
  def _(j):
    for free, _ in streams:
      plgpu.barrier_wait(free.at[slot(j)])


def named(name: str, body, **kwargs):
  """``body`` with ``kwargs`` bound, named ``name``: plgpu.kernel names its kernel after its
  body (a profile's rows, the lowering's)."""
  out = functools.partial(body, **kwargs)
  out.__name__ = name
  return out


def meeting_blocks(q_seg, kv_seg, rows: int, cols: int):
  """(B, query tiles, 2) int32: for each tile of ``rows`` queries, [first, end) of the key
  blocks of ``cols`` keys whose id ranges overlap the tile's (all of them that can share a
  segment with it, and those between); [0, 0) where none can. Packed sequences have sorted
  ids, so that a tile of one sequence visits only that sequence's blocks."""
  b = q_seg.shape[0]
  q = q_seg.reshape(b, -1, rows)
  k = kv_seg.reshape(b, -1, cols)
  meet = ((k.min(-1)[:, None, :] <= q.max(-1)[:, :, None]) &
          (k.max(-1)[:, None, :] >= q.min(-1)[:, :, None]))
  blocks = meet.shape[-1]
  index = jnp.arange(blocks, dtype=jnp.int32)
  first = jnp.min(jnp.where(meet, index, blocks), axis=-1)
  end = jnp.max(jnp.where(meet, index + 1, 0), axis=-1)
  first = jnp.minimum(first, end)
  return jnp.stack([first, end], axis=-1).astype(jnp.int32)


# --------------------------------------------------------------------------- #
# The backward kernels' arithmetic
# --------------------------------------------------------------------------- #


def dot_t(pairs):
  """The sum of a @ b^T over shared-memory blocks (a, b) (the parts of one contraction)."""
  return sum(lax.dot_general(a[...], b[...], (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32) for a, b in pairs)


def probabilities(qk, lse2, mask, axis: int, call: Call, bias2=None):
  """(P, tanh or None) of a block from its raw q k^T (or its transpose: the queries along
  ``axis``): P from the saved log-sum-exp in base 2, the block's bias (base 2, as the
  forward adds it: after the cap) where there is one, 0 where ``mask`` hides a score."""
  if call.soft_cap is None:
    th, x, scale2 = None, qk, call.scale * LOG2E
  else:
    th = jnp.tanh(qk * (call.scale / call.soft_cap))
    x, scale2 = th, call.soft_cap * LOG2E
  s = x * scale2 if bias2 is None else x * scale2 + bias2
  p = jnp.exp2(s - lax.broadcast_in_dim(lse2, qk.shape, [axis]))
  return p if mask is None else jnp.where(mask, p, 0.0), th


def capped(p, th):
  """P times the cap's derivative (1 - tanh^2), or P without a cap: taken as soon as P is, so
  that one tile (not P and tanh) stays in registers through dP's product."""
  return p if th is None else p * (1.0 - th * th)


def bias_tile(ref, interpret):
  """A (rows, keys) block of the bias from shared memory, in registers in the WGMMA layout and
  in base 2 (float32), as every kernel adds it to its logits."""
  return _mosaic_gpu.load_block(ref, plgpu.Layout.WGMMA, interpret).astype(jnp.float32) * LOG2E


def itemsize(ref) -> int:
  """Bytes of an element of ``ref`` (0 for None: no bias)."""
  return 0 if ref is None else jnp.dtype(ref.dtype).itemsize


def bias_at(call: Call, b, n) -> tuple:
  """The (batch, head) index of query head ``n`` of batch ``b``'s bias: 0 where the bias
  broadcasts over that dimension."""
  bb, nb = call.bias_shape[:2]
  return (b if bb > 1 else 0, n if nb > 1 else 0)


def grad_logits(p_capped, dp, delta, axis: int):
  """dS, the gradient of q k^T before the scale: P (dP - delta), with the cap's derivative."""
  return p_capped * (dp - lax.broadcast_in_dim(delta, p_capped.shape, [axis]))


def mma_t(acc, a, b, interpret):
  """acc += a @ b^T (shared-memory blocks), issued; :func:`mma_wait` for it."""
  if interpret:
    acc[...] += dot_t([(a, b)])
  else:
    plgpu.wgmma(acc, a, _mosaic_gpu.transposed(b))
