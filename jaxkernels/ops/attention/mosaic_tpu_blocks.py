"""What both Mosaic TPU flash attention layouts share (``mosaic_tpu``, heads-major, and
``mosaic_tpu_in_place``): the logits, the key and query blocks a mask lets a block visit (and
what a skipped step's index map repeats), the kernels' stated costs, segment ids padded."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxkernels import roofline
from jax import lax

from jaxkernels.ops.attention.common import Call, key_blocks, query_blocks, visible


def scores(qk, bias, call: Call):
  """Natural-log logits from q k^T (scaled, capped, biased) and tanh for the cap's slope."""
  s = qk * call.scale
  th = None
  if call.soft_cap is not None:
    th = jnp.tanh(s * (1.0 / call.soft_cap))
    s = call.soft_cap * th
  if bias is not None:
    s = s + bias.astype(jnp.float32)
  return s, th


def mask(i, j, bq: int, bk: int, call: Call, q_seg, kv_seg, *, keys_down: bool = False):
  """Query block i against key block j: the window, the keys' end and segments as a (bq, bk)
  mask, or (bk, bq) with ``keys_down`` (the in-place kernels' transposed scores; ``q_seg`` then
  a (1, bq) row, ``kv_seg`` a (bk, 1) column); None where every pair is visible."""
  shape, query_axis = ((bk, bq), 1) if keys_down else ((bq, bk), 0)
  queries = i * bq + lax.broadcasted_iota(jnp.int32, shape, query_axis)
  keys = j * bk + lax.broadcasted_iota(jnp.int32, shape, 1 - query_axis)
  out = visible(queries, keys, call.window, q_seg, kv_seg)
  if call.kv_len % bk:
    edge = keys < call.kv_len
    out = edge if out is None else out & edge
  return out


def visit(i, j, bq, bk, call: Call):
  """Whether key block j holds a key that query block i sees, and the last block that does
  (what a skipped step's index map repeats)."""
  first, _, _, end = key_blocks(i * bq, jnp.minimum(bq, call.q_len - i * bq), bk, call.kv_len,
                                call.window)
  return (j >= first) & (j < end), repeat(j, first, end, -(-call.kv_len // bk))


def visit_queries(j, i, bq, bk, call: Call):
  first, _, _, end = query_blocks(j * bk, jnp.minimum(bk, call.kv_len - j * bk), bq,
                                  call.q_len, call.window)
  return (i >= first) & (i < end), repeat(i, first, end, -(-call.q_len // bq))


def block_visits(call: Call, bq: int, bk: int) -> int:
  """(query block, key block) pairs the kernels visit for one (batch, head): the window's
  hidden blocks are skipped (``visit``; ``key_blocks``' bounds, in Python integers: under a
  trace its jnp arithmetic would be staged)."""
  left, right = call.window.span
  visits = 0
  for i in range(-(-call.q_len // bq)):
    row0, last = i * bq, min((i + 1) * bq, call.q_len) - 1
    lo, hi = max(row0 - left, 0), min(last + right + 1, call.kv_len)
    if hi > lo:
      visits += -(-hi // bk) - lo // bk
  return visits


def costs(call: Call, bq: int, bk: int, *, shared_kv: bool = False
          ) -> dict[str, pl.CostEstimate]:
  """What each kernel computes and moves with (bq, bk) blocks, for the compiler (its cost
  analysis cannot look inside a Mosaic kernel, and counted 0 FLOPs without this;
  notes/report.md, TPU columns). Per visited block pair: the forward's two products (4 bq bk h
  FLOPs) and bq bk exponentials, reading that key block's k and v; dk/dv's four products
  (8 bq bk h: scores, dp, dv, dk), reading q, dout and the statistics; dq's three (6 bq bk h:
  scores, dp, dq), reading k and v (roofline.attention_traffic: the bytes; ``shared_kv``: a
  key block read once for its GQA group, as the in-place kernels do). Each kernel's
  exponentials once a pair."""
  visits = block_visits(call, bq, bk)
  pairs = call.batch * call.heads * visits * bq * bk
  h = call.head_dim
  moved = roofline.attention_traffic(call.batch, call.q_len, call.kv_len, call.heads,
                                     call.kv_heads, h, visits=visits, block_q=bq, block_k=bk,
                                     itemsize=call.dtype.itemsize, shared_kv=shared_kv)
  flops = dict(fwd=4 * pairs * h, dkdv=8 * pairs * h, dq=6 * pairs * h)
  return {kernel: pl.CostEstimate(flops=flops[kernel], transcendentals=pairs,
                                  bytes_accessed=int(moved[kernel])) for kernel in flops}


def repeat(step, first, end, count: int):
  """The block a step fetches: its own where visible, else the nearest visible one (the
  pipeline then fetches nothing new), inside the array even where no block is visible."""
  return jnp.clip(jnp.clip(step, first, jnp.maximum(end - 1, first)), 0, count - 1)


def segments(seg, length: int, fill: int):
  pad = length - seg.shape[1]
  seg = seg.astype(jnp.int32)
  return jnp.pad(seg, ((0, 0), (0, pad)), constant_values=fill) if pad else seg
