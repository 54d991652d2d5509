"""The spec of flash_attention: pure jnp, also the "xla" implementation.

The logits are scale * q k^T in float32 (for bfloat16 and float16 inputs, products of the
inputs accumulated in float32, as ``jax.nn.dot_product_attention`` computes them), then
soft-capped (cap * tanh(logits / cap)), then the bias added, then masked; the softmax runs in
float32, and its probabilities meet v in v's dtype. The bias comes after the cap so that a
large negative bias (a mask written as a bias) still masks. A query that sees no key at all
gets 0 (and zero gradients), not the mean of v; its log-sum-exp is -inf.

It holds the whole (B, N, T, S) matrix: memory quadratic in the sequence. ``compute_dtype``
is for the tests: every step in that dtype (float64: the oracle; the input dtype: the naive
baseline of the numerics rule).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxkernels.ops.attention.common import Window, below_every_float, visible


def attention(q, k, v, *, bias=None, q_segments=None, kv_segments=None,
              window: Window = Window(None, None), scale: float, soft_cap: float | None = None,
              return_lse: bool = False, compute_dtype=None):
  """q (B, T, N, H), k and v (B, S, K, H) with N a multiple of K; bias broadcastable to
  (B, N, T, S); segments (B, T) and (B, S) int32. Returns the (B, T, N, H) output in q's dtype
  and, with ``return_lse``, the (B, T, N) float32 natural log-sum-exp of the masked logits
  (differentiable: a combine of partial attentions, ring attention's say, needs its
  gradient)."""
  b, t, n, h = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  group = n // kv_heads
  logits_dtype = compute_dtype or jnp.promote_types(q.dtype, jnp.float32)
  cast = (lambda a: a.astype(compute_dtype)) if compute_dtype else (lambda a: a)
  qg = cast(q).reshape(b, t, kv_heads, group, h)
  logits = jnp.einsum("btkgh,bskh->bkgts", qg, cast(k), preferred_element_type=logits_dtype,
                      precision=lax.Precision.HIGHEST)
  logits = logits.astype(logits_dtype) * jnp.asarray(scale, logits_dtype)
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  if bias is not None:
    bias = jnp.broadcast_to(cast(bias).astype(logits_dtype), (b, n, t, s))
    logits = logits + bias.reshape(b, kv_heads, group, t, s)
  rows = jnp.arange(t)[None, None, None, :, None]  # (B, K, G, T, S)'s rank: no implicit
  cols = jnp.arange(s)[None, None, None, None, :]  # rank promotion (numpy_rank_promotion)
  qs = None if q_segments is None else q_segments[:, None, None, :, None]
  ks = None if kv_segments is None else kv_segments[:, None, None, None, :]
  mask = visible(rows, cols, window, qs, ks)
  softmax_dtype = compute_dtype or jnp.float32
  logits = logits.astype(softmax_dtype)
  if mask is not None:
    # A finite stand-in for the hidden logits, never -inf: under jax.debug_infs every
    # primitive's output is checked, and an -inf written here tripped it on every causal call.
    # The hidden entries are zeroed after the exp, so the stand-in's value takes no part.
    logits = jnp.where(mask, logits, jnp.finfo(softmax_dtype).min)
  peak = lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  peak = jnp.where(below_every_float(peak), 0, peak)  # a row of -inf bias
  e = jnp.exp(logits - peak)
  if mask is not None:
    e = jnp.where(mask, e, 0)
  total = jnp.sum(e, axis=-1, keepdims=True)
  probs = e / jnp.where(total == 0, 1, total)
  out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(compute_dtype or v.dtype), cast(v),
                   preferred_element_type=compute_dtype or jnp.float32,
                   precision=lax.Precision.HIGHEST)
  out = out.reshape(b, t, n, h).astype(q.dtype if compute_dtype is None else compute_dtype)
  if not return_lse:
    return out
  seen = total > 0
  # -inf where a row sees nothing, made there alone (log of 0), not broadcast everywhere.
  lse = (jnp.where(seen, peak + jnp.log(jnp.where(seen, total, 1)), 0)
         + jnp.log(seen.astype(jnp.float32)))[..., 0]
  lse = jnp.moveaxis(lse.reshape(b, n, t), 1, 2)  # (B, T, N): -inf where nothing is seen
  return out, lse.astype(compute_dtype or jnp.float32)


def block_grads(q, k, v, out, lse, dout, dlse, *, window: Window, scale: float):
  """(dq, dk, dv) of one k/v block's share of an attention whose whole output ``out`` and
  log-sum-exp ``lse`` (B, T, N) are given (ring attention's backward; what the kernels'
  backward computes from them): P = exp(logits - lse) on the block, dv = P^T dout,
  dS = P (dout v^T - rowsum(dout out) + dlse), dq = scale dS k, dk = scale dS^T q. float32."""
  b, t, n, h = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  group = n // kv_heads
  f32 = lambda a: a.astype(jnp.float32)
  hi = lax.Precision.HIGHEST
  qg = f32(q).reshape(b, t, kv_heads, group, h)
  logits = jnp.einsum("btkgh,bskh->bkgts", qg, f32(k), precision=hi) * scale
  row = lambda x: jnp.moveaxis(x.reshape(b, t, kv_heads, group), 1, 3)[..., None]  # bkgt1
  p = jnp.exp(logits - jnp.where(below_every_float(row(lse)), 0.0, row(lse)))
  mask = visible(jnp.arange(t)[None, None, None, :, None],
                 jnp.arange(s)[None, None, None, None, :], window)
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  p = jnp.where(below_every_float(row(lse)), 0.0, p)
  do = f32(dout).reshape(b, t, kv_heads, group, h)
  dv = jnp.einsum("bkgts,btkgh->bskh", p, do, precision=hi)
  dp = jnp.einsum("btkgh,bskh->bkgts", do, f32(v), precision=hi)
  delta = row(jnp.sum(f32(dout) * f32(out), axis=-1))
  ds = p * (dp - delta + row(f32(dlse)))
  dq = jnp.einsum("bkgts,bskh->btkgh", ds, f32(k), precision=hi).reshape(b, t, n, h) * scale
  dk = jnp.einsum("bkgts,btkgh->bskh", ds, qg, precision=hi) * scale
  return dq, dk, dv


def decode_positions(lengths, n_queries: int):
  """(B, Tq) positions of the new queries: the last ``n_queries`` of each sequence's
  ``lengths[b]`` (their keys and values already written into the cache)."""
  return lengths[:, None].astype(jnp.int32) - n_queries + jnp.arange(n_queries)[None, :]


def decode(q, k_cache, v_cache, lengths, *, scale: float, soft_cap: float | None = None,
           window_left: int | None = None, compute_dtype=None):
  """decode_attention's spec: q (B, Tq, N, H), caches (B, S, K, H), lengths (B,). Query t of
  sequence b sits at position lengths[b] - Tq + t and sees keys j <= its position (and
  j >= position - window_left); a query that sees nothing gets 0."""
  b, tq, n, h = q.shape
  s, kv_heads = k_cache.shape[1], k_cache.shape[2]
  group = n // kv_heads
  logits_dtype = compute_dtype or jnp.promote_types(q.dtype, jnp.float32)
  cast = (lambda a: a.astype(compute_dtype)) if compute_dtype else (lambda a: a)
  qg = cast(q).reshape(b, tq, kv_heads, group, h)
  logits = jnp.einsum("btkgh,bskh->bkgts", qg, cast(k_cache),
                      preferred_element_type=logits_dtype, precision=lax.Precision.HIGHEST)
  logits = logits.astype(logits_dtype) * jnp.asarray(scale, logits_dtype)
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  pos = decode_positions(lengths, tq)[:, None, None, :, None]  # (B, 1, 1, Tq, 1)
  cols = jnp.arange(s)[None, None, None, None, :]
  mask = cols <= pos
  if window_left is not None:
    mask = mask & (cols >= pos - window_left)
  softmax_dtype = compute_dtype or jnp.float32
  logits = jnp.where(mask, logits.astype(softmax_dtype), jnp.finfo(softmax_dtype).min)
  peak = lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  peak = jnp.where(below_every_float(peak), 0, peak)
  e = jnp.where(mask, jnp.exp(logits - peak), 0)  # (finite stand-ins: as attention's)
  total = jnp.sum(e, axis=-1, keepdims=True)
  probs = e / jnp.where(total == 0, 1, total)
  out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(compute_dtype or v_cache.dtype),
                   cast(v_cache), preferred_element_type=compute_dtype or jnp.float32,
                   precision=lax.Precision.HIGHEST)
  return out.reshape(b, tq, n, h).astype(q.dtype if compute_dtype is None else compute_dtype)
