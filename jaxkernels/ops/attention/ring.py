"""Ring attention: flash attention with the sequence split over mesh axes (sequence, or
context, parallelism), run per shard inside ``jaxkernels.partitioning``'s shard_map.

Each shard holds its queries and one block of keys and values; the k/v blocks go around the
ring (``lax.ppermute``), one step at a time, and each step's block is attended by the same
flash kernels as an unsplit call (Triton, Mosaic GPU, Mosaic TPU, or the reference), whose
(output, log-sum-exp) pairs merge as the online softmax merges blocks. The backward goes
around the ring again with the saved output and the whole log-sum-exp: each step's kernel
backward gives that block's exact share of dq, dk and dv (the softmax against the whole
row's log-sum-exp), and dk and dv travel with their block back to its shard. Nothing a
shard saves or holds at once is bigger than its own share of q, k and v (and two k/v blocks
in flight), so the memory per device is 1 / shards of one device's.

Causal attention on a contiguous split leaves shard i idle for the blocks of later shards
(shard 0 works one step of n). The zig-zag layout (``partitioning.zigzag``) balances it: the sequence in
2n chunks, shard i holding chunks i and 2n - 1 - i, every step is the same work on every
shard: half a block-pair of full attention per chunk pair, the diagonal once.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

LAYOUTS = ("contiguous", "zigzag")


@dataclasses.dataclass(frozen=True)
class Blocks:
  """One shard's flash attention of a query block against a k/v block, as the op runs it
  there: ``forward(q, k, v, causal)`` -> (out, lse); ``backward(q, k, v, out, lse, dout,
  dlse, causal)`` -> (dq, dk, dv), from the given output and log-sum-exp (the whole row's:
  the block's exact share). Arrays (B, T, N, H), lse (B, T, N)."""

  forward: Callable[..., Any]
  backward: Callable[..., Any]


def _merge(out, lse, o, l):
  """The online softmax's merge of (out, lse) with a block's (o, l): float32 out."""
  new = jnp.logaddexp(lse, l)
  safe = jnp.where(jnp.isneginf(new), 0.0, new)
  a = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(lse - safe))[..., None]
  b = jnp.where(jnp.isneginf(l), 0.0, jnp.exp(l - safe))[..., None]
  return out * a + o.astype(jnp.float32) * b, new


def _rotate(axes, n, *xs):
  """Each x to the next shard along the ring (shard d's to d + 1)."""
  perm = [(d, (d + 1) % n) for d in range(n)]
  return tuple(lax.ppermute(x, axes, perm) for x in xs)


def _empty(q):
  return jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:-1], -jnp.inf, jnp.float32)


def _forward(blocks: Blocks, axes, n: int, causal: bool, layout: str, q, k, v):
  i = lax.axis_index(axes)
  half = q.shape[1] // 2
  o, l = blocks.forward(q, k, v, causal)  # the shard's own block: the diagonal
  out, lse = _merge(*_empty(q), o, l)

  def step(s, carry):
    out, lse, k, v = carry
    k, v = _rotate(axes, n, k, v)
    j = (i - s) % n  # whose block this is
    if not causal:
      o, l = blocks.forward(q, k, v, False)
    elif layout == "contiguous":  # an earlier shard's block, whole; a later one's, nothing
      o, l = lax.cond(j < i, lambda: _as_f32(blocks.forward(q, k, v, False)),
                      lambda: _empty(q))
    else:  # zig-zag: every query against j's first chunk, or the second half against both
      def early():
        return _as_f32(blocks.forward(q, k[:, :half], v[:, :half], False))

      def late():
        o, l = blocks.forward(q[:, half:], k, v, False)
        zo, zl = _empty(q[:, :half])
        return (jnp.concatenate([zo, o.astype(jnp.float32)], axis=1),
                jnp.concatenate([zl, l], axis=1))
      o, l = lax.cond(j < i, early, late)
    out, lse = _merge(out, lse, o, l)
    return out, lse, k, v

  out, lse, _, _ = lax.fori_loop(1, n, step, (out, lse, k, v))
  return out.astype(q.dtype), lse


def _as_f32(pair):
  o, l = pair
  return o.astype(jnp.float32), l


def _backward(blocks: Blocks, axes, n: int, causal: bool, layout: str, q, k, v, out, lse,
              dout, dlse):
  i = lax.axis_index(axes)
  half = q.shape[1] // 2
  f32 = lambda *xs: tuple(x.astype(jnp.float32) for x in xs)
  dq, dk, dv = f32(*blocks.backward(q, k, v, out, lse, dout, dlse, causal))

  def step(s, carry):
    dq, k, v, dk, dv = carry
    k, v, dk, dv = _rotate(axes, n, k, v, dk, dv)  # dk, dv travel with their block
    j = (i - s) % n
    if not causal:
      gq, gk, gv = f32(*blocks.backward(q, k, v, out, lse, dout, dlse, False))
    elif layout == "contiguous":
      gq, gk, gv = lax.cond(
          j < i, lambda: f32(*blocks.backward(q, k, v, out, lse, dout, dlse, False)),
          lambda: (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
                   jnp.zeros(v.shape, jnp.float32)))
    else:
      def early():
        gq, gk, gv = f32(*blocks.backward(q, k[:, :half], v[:, :half], out, lse, dout, dlse,
                                          False))
        pad = lambda g: jnp.concatenate([g, jnp.zeros_like(g)], axis=1)
        return gq, pad(gk), pad(gv)

      def late():
        rows = lambda x: x[:, half:]
        gq, gk, gv = f32(*blocks.backward(rows(q), k, v, rows(out), rows(lse), rows(dout),
                                          rows(dlse), False))
        return jnp.concatenate([jnp.zeros_like(gq), gq], axis=1), gk, gv
      gq, gk, gv = lax.cond(j < i, early, late)
    return dq + gq, k, v, dk + gk, dv + gv

  dq, _, _, dk, dv = lax.fori_loop(1, n, step, (dq, k, v, dk, dv))
  if n > 1:
    dk, dv = _rotate(axes, n, dk, dv)  # the last step's block home
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def attention(blocks: Blocks, axes: tuple[str, ...], n: int, causal: bool, layout: str, q, k,
              v):
  """(out, lse) of q (B, L, N, H) against the whole ring's keys and values, this shard's
  k and v (B, L, K, H) its block; under shard_map, the sequence split over ``axes`` (``n``
  shards). ``layout``: "contiguous" (shard i holds positions [i L, (i + 1) L)) or "zigzag"
  (:func:`zigzag`'s order: L even)."""
  return _forward(blocks, axes, n, causal, layout, q, k, v)


def _attention_fwd(blocks, axes, n, causal, layout, q, k, v):
  out, lse = _forward(blocks, axes, n, causal, layout, q, k, v)
  return (out, lse), (q, k, v, out, lse)


def _attention_bwd(blocks, axes, n, causal, layout, saved, cotangents):
  q, k, v, out, lse = saved
  dout, dlse = cotangents
  return _backward(blocks, axes, n, causal, layout, q, k, v, out, lse, dout, dlse)


attention.defvjp(_attention_fwd, _attention_bwd)
