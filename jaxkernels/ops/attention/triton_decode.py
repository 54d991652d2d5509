"""Pallas Triton kernel for decode attention: a few new queries against a long KV cache
(flash-decoding).

With one query a head there is too little work along the queries to fill the GPU, so the
cache is split along its length: a program takes one kv head of one sequence and one chunk of
its keys, and every query row of the kv head's GQA group (G heads x Tq queries, padded to 16
rows for the tensor cores) against it, so each key and value is read once for the whole group.
It writes a partial output and its log-sum-exp; XLA then combines the chunks by their
log-sum-exps (``common.combine``) into the output. Keys past a sequence's
length are never read: a chunk's loop stops there.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkernels import _online_softmax, _triton, hardware
from jaxkernels._activations import LN2, LOG2E
from jaxkernels._online_softmax import Running, finite
from jaxkernels._tiling import cdiv, check_fields, is_pow2, next_pow2
from jaxkernels._triton import pltriton
from jaxkernels.ops.attention.common import MAX_HEAD_DIM, combine

MAX_QUERIES = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  block_k: int  # keys a loop step
  splits: int  # chunks of the cache a sequence's kv head is cut into
  num_warps: int
  num_stages: int

  def __post_init__(self):
    check_fields(self, ("block_k",), lambda v: is_pow2(v) and v >= 16, "a power of two >= 16")
    check_fields(self, ("num_warps",), is_pow2, "a power of two")
    check_fields(self, ("splits", "num_stages"), lambda v: v >= 1, ">= 1")


def heuristic(problem, chip: hardware.Chip) -> Config:
  """Enough chunks for two programs an SM, each at least a few blocks long."""
  block_k = 64 if problem.head_dim > 128 else 128
  programs = problem.batch * problem.kv_heads
  want = cdiv(2 * chip.cores, programs)
  splits = max(1, min(want, cdiv(problem.kv_len, 4 * block_k)))
  return Config(block_k=block_k, splits=splits, num_warps=4, num_stages=3)


def unsupported(problem, chip) -> str | None:
  del chip
  if problem.head_dim > MAX_HEAD_DIM:
    return f"head dim {problem.head_dim} is over {MAX_HEAD_DIM}"
  if problem.q_len * problem.heads // problem.kv_heads > MAX_QUERIES:
    return (f"{problem.q_len} queries x {problem.heads // problem.kv_heads} heads a group is "
            f"over {MAX_QUERIES} rows")
  return None


def _kernel(q_ref, k_ref, v_ref, len_ref, o_ref, lse_ref, *, batch, tq, heads, kv_heads, h,
            s_len, rows, chunk, block_k, scale, soft_cap, window_left, precision, math_):
  sp, bk_ = pl.program_id(0), pl.program_id(1)
  b, kh = bk_ // kv_heads, bk_ % kv_heads
  group = heads // kv_heads
  hp = max(16, next_pow2(h))
  # Rows past the group's G x Tq (padding to the tensor cores' 16) repeat its first rows: they
  # compute the same values and store them to the same places, so no store needs a mask
  # (a masked store's duplicate indices would race with the live row's).
  r = jnp.arange(rows) % (group * tq)
  g, t = r // tq, r % tq
  head = kh * group + g
  cols = jnp.arange(hp)
  col_mask = (cols < h) if hp != h else None
  # q viewed as (B*Tq, N*H): row b*Tq + t, column head*H + d.
  q_index = ((b * tq + t)[:, None], (head * h)[:, None] + cols[None, :])
  q_mask = None if col_mask is None else jnp.broadcast_to(col_mask[None, :], (rows, hp))
  q = _load(q_ref, q_index, q_mask)
  length = pltriton.load(len_ref.at[b]).astype(jnp.int32)
  pos = length - tq + t  # each row's query position
  lo = sp * chunk
  hi = jnp.minimum(jnp.minimum(lo + chunk, length), s_len)  # a length past S: the whole cache
  if window_left is not None:
    lo = jnp.maximum(lo, (jnp.maximum(length - tq - window_left, 0) // block_k) * block_k)

  def body(step, carry):
    acc, state = carry
    k_pos = step * block_k + jnp.arange(block_k)
    k_index = ((b * s_len + k_pos)[:, None], (kh * h + cols)[None, :])
    k_mask = (k_pos < hi)[:, None]
    if col_mask is not None:
      k_mask = k_mask & col_mask[None, :]
    k, v = _load(k_ref, k_index, k_mask), _load(v_ref, k_index, k_mask)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * scale
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s * (1.0 / soft_cap))
    s = s * LOG2E
    mask = (k_pos[None, :] <= pos[:, None]) & (k_pos[None, :] < hi)
    if window_left is not None:
      mask = mask & (k_pos[None, :] >= pos[:, None] - window_left)
    s = jnp.where(mask, s, -jnp.inf)
    state, rescale, p = _online_softmax.rows_update(state, s, exp=math_.exp2)
    acc = acc * rescale[:, None] + lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
        preferred_element_type=jnp.float32)
    return acc, state

  acc = jnp.zeros((rows, hp), jnp.float32)
  acc, (peak, total) = lax.fori_loop(lo // block_k, cdiv_traced(hi, block_k), body,
                                     (acc, Running.start((rows,))))
  seen = total > 0
  out = acc / jnp.where(seen, total, 1.0)[:, None]
  lse = jnp.where(seen, (finite(peak) + jnp.log2(jnp.where(seen, total, 1.0))) * LN2, -jnp.inf)
  # Partials: o (splits, B*Tq, N*Hp) float32, the head dim padded so that no row's padding
  # lanes alias the next head's (a store with duplicate indices), and lse (splits, B*Tq*N).
  o_index = (sp, (b * tq + t)[:, None], (head * hp)[:, None] + cols[None, :])
  pltriton.store(o_ref.at[o_index], out)
  pltriton.store(lse_ref.at[(sp, (b * tq + t) * heads + head)], lse)


def _load(ref, index, mask):
  if mask is None:
    return pltriton.load(ref.at[index])
  return pltriton.load(ref.at[index], mask=mask, other=0)


def cdiv_traced(a, b: int):
  return (a + b - 1) // b


def forward(q, k_cache, v_cache, lengths, *, scale: float, soft_cap: float | None,
            window_left: int | None, config: Config, interpret=False):
  """(B, Tq, N, H) in q's dtype."""
  b, tq, n, h = q.shape
  s, kv_heads = k_cache.shape[1], k_cache.shape[2]
  group = n // kv_heads
  rows = max(16, next_pow2(group * tq))
  hp = max(16, next_pow2(h))
  splits = max(1, min(config.splits, cdiv(s, config.block_k)))
  chunk = cdiv(cdiv(s, splits), config.block_k) * config.block_k
  kernel = functools.partial(
      _kernel, batch=b, tq=tq, heads=n, kv_heads=kv_heads, h=h, s_len=s, rows=rows, chunk=chunk,
      block_k=config.block_k, scale=float(scale), soft_cap=soft_cap, window_left=window_left,
      precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
      math_=_triton.math(interpret))
  o_part, lse_part = pl.pallas_call(
      kernel,
      grid=(splits, b * kv_heads),
      out_shape=[jax.ShapeDtypeStruct((splits, b * tq, n * hp), jnp.float32),
                 jax.ShapeDtypeStruct((splits, b * tq * n), jnp.float32)],
      compiler_params=_triton.params(config.num_warps, config.num_stages),
      interpret=interpret, name="jk_decode_attention",
  )(q.reshape(b * tq, n * h), k_cache.reshape(b * s, kv_heads * h),
    v_cache.reshape(b * s, kv_heads * h), lengths.astype(jnp.int32))
  o_part = o_part.reshape(splits, b, tq, n, hp)[..., :h]
  return combine(o_part, lse_part.reshape(splits, b, tq, n), q.dtype)
