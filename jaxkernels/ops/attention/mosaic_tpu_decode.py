"""Pallas Mosaic TPU kernel for decode attention: a few new queries against a long KV cache.

A program takes one sequence, one block of kv heads and one chunk of the cache; its grid's last
axis walks the chunk's key blocks ("arbitrary": the running maximum, sum and output stay in
VMEM across it), every other axis is "parallel", so that megacore chips (v4, v5p) split them
between their TensorCores. Every query row of a kv head's GQA group (G heads x Tq queries)
meets each key block at once, so the cache is read once for the whole group. The cache is read
in place: a TPU tiles an array's last two dims, here (K, H), so a block spans whole tiles of kv
heads (all K heads, or a multiple of the sublane tile where K is larger), and the kernel takes
each head's (keys, H) slice out of VMEM. Reshaping the cache to (B, S, K x H) would have made
XLA copy all of it every call.

The lengths are prefetched into SMEM: the key blocks a sequence does not reach, and those its
window leaves behind, repeat the nearest block it does reach in their index maps (Pallas
fetches nothing for a repeated block) and are not computed. With more than one chunk a
sequence, XLA combines the chunks' partial outputs by their log-sum-exps (``common.combine``,
as the Triton kernel's).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxkernels import _mosaic_tpu, hardware
from jaxkernels._online_softmax import finite
from jaxkernels._tiling import cdiv, check_fields, round_up
from jaxkernels.ops.attention import mosaic_tpu
from jaxkernels.ops.attention.common import combine


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  block_k: int  # keys a grid step
  splits: int  # chunks of the cache a sequence's kv heads are cut into
  vmem_limit_bytes: int

  def __post_init__(self):
    check_fields(self, ("block_k",), lambda v: v >= 16 and v % 16 == 0,
                 "a multiple of 16 (sublanes of packed bfloat16)")
    check_fields(self, ("splits", "vmem_limit_bytes"), lambda v: v >= 1, ">= 1")


def heads_per_block(kv_heads: int, dtype) -> int:
  """kv heads a cache block spans: all of them, or a sublane tile's worth (8 rows of 32 bits,
  16 of bfloat16) where there are more and they divide evenly."""
  tile = _mosaic_tpu.sublanes(dtype)
  return tile if kv_heads > tile and kv_heads % tile == 0 else kv_heads


def heuristic(problem, chip: hardware.Chip) -> Config:
  """Key blocks of about 1 MiB of k a buffer (at most 512 keys): long DMAs, and k and v double
  buffered in a few MiB of VMEM; a second chunk a sequence only where the programs would not
  cover every TensorCore twice."""
  heads = heads_per_block(problem.kv_heads, problem.dtype)
  row_bytes = heads * problem.head_dim * jnp.dtype(problem.dtype).itemsize
  block_k = max(16, min(512, (hardware.MiB // row_bytes) // 16 * 16))
  block_k = min(block_k, round_up(problem.kv_len, 16))
  programs = problem.batch * problem.kv_heads // heads
  splits = max(1, min(cdiv(2 * chip.cores, programs), cdiv(problem.kv_len, block_k)))
  return Config(block_k=block_k, splits=splits, vmem_limit_bytes=_mosaic_tpu.vmem_limit(chip))


# What the flash_attention kernels take (dtype and head dim) is what this kernel takes.
unsupported = mosaic_tpu.unsupported


def _kernel(lengths_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, peak_ref, total_ref, acc_ref, *,
            tq: int, h: int, s_len: int, heads: int, blocks: int, block_k: int, scale: float,
            soft_cap: float | None, window_left: int | None, precision):
  b, sp, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  step = sp * blocks + j  # the key block, before the index maps' clamp
  length = lengths_ref[b]
  cached = jnp.minimum(length, s_len)  # a length past S sees the whole cache, as the reference
  first, end = _visible_blocks(length, tq, block_k, s_len, window_left)

  @pl.when(j == 0)
  def _():
    peak_ref[...] = jnp.full(peak_ref.shape, -jnp.inf, jnp.float32)
    total_ref[...] = jnp.zeros(total_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when((step >= first) & (step < end))
  def _():
    rows = q_ref.shape[1]
    keys = step * block_k + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
    # Row r is query r % Tq of its head: position length - Tq + r % Tq.
    pos = length - tq + lax.rem(lax.broadcasted_iota(jnp.int32, (rows, block_k), 0), tq)
    mask = (keys <= pos) & (keys < cached)  # also a partial last block's tail
    if window_left is not None:
      mask = mask & (keys >= pos - window_left)
    # A partial last block's tail is whatever VMEM held: zeroed in v so that 0 x it is 0.
    tail = (step * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)) < cached
    for head in range(heads):
      k = k_ref[:, head, :]
      v = jnp.where(tail, v_ref[:, head, :], jnp.zeros((), v_ref.dtype))
      s = lax.dot_general(q_ref[head], k, (((1,), (1,)), ((), ())), precision=precision,
                          preferred_element_type=jnp.float32) * scale
      if soft_cap is not None:
        s = soft_cap * jnp.tanh(s * (1.0 / soft_cap))
      s = jnp.where(mask, s, -jnp.inf)
      peak = peak_ref[head]
      new_peak = jnp.maximum(peak, jnp.max(s, axis=1, keepdims=True))
      safe = finite(new_peak)
      p = jnp.exp(s - safe)
      rescale = jnp.exp(peak - safe)
      total_ref[head] = rescale * total_ref[head] + jnp.sum(p, axis=1, keepdims=True)
      acc_ref[head] = rescale * acc_ref[head] + lax.dot_general(
          p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
          preferred_element_type=jnp.float32)
      peak_ref[head] = new_peak

  @pl.when(j == blocks - 1)
  def _():
    total = total_ref[...]
    seen = total > 0
    o_ref[...] = acc_ref[...] / jnp.where(seen, total, 1.0)
    lse_ref[...] = jnp.where(seen, finite(peak_ref[...]) + jnp.log(jnp.where(seen, total, 1.0)),
                             -jnp.inf)


def _visible_blocks(length, tq: int, block_k: int, s_len: int, window_left: int | None):
  """[first, end): the key blocks holding a key that one of the sequence's new queries sees."""
  first = 0
  if window_left is not None:
    first = jnp.maximum(length - tq - window_left, 0) // block_k
  return first, (jnp.minimum(length, s_len) + block_k - 1) // block_k


def forward(q, k_cache, v_cache, lengths, *, scale: float, soft_cap: float | None,
            window_left: int | None, config: Config, interpret=False):
  """(B, Tq, N, H) in q's dtype."""
  b, tq, n, h = q.shape
  s, kv_heads = k_cache.shape[1], k_cache.shape[2]
  group = n // kv_heads
  heads = heads_per_block(kv_heads, q.dtype)
  bk = config.block_k
  splits = max(1, min(config.splits, cdiv(s, bk)))
  blocks = cdiv(cdiv(s, bk), splits)  # key blocks a chunk
  rows = group * tq
  # q's rows by kv head: (B, K, G x Tq, H), row g x Tq + t (a few KiB).
  qg = jnp.transpose(q.reshape(b, tq, kv_heads, group, h), (0, 2, 3, 1, 4)).reshape(
      b, kv_heads, rows, h)

  def cache_map(b_, kb, sp, j, lengths_ref):
    first, end = _visible_blocks(lengths_ref[b_], tq, bk, s, window_left)
    last = jnp.maximum(end - 1, 0)
    return b_, jnp.clip(sp * blocks + j, jnp.minimum(first, last), last), kb, 0

  part = lambda b_, kb, sp, j, lengths_ref: (sp, b_, kb, 0, 0)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(b, kv_heads // heads, splits, blocks),
      in_specs=[pl.BlockSpec((None, heads, rows, h),
                             lambda b_, kb, sp, j, lengths_ref: (b_, kb, 0, 0)),
                pl.BlockSpec((None, bk, heads, h), cache_map),
                pl.BlockSpec((None, bk, heads, h), cache_map)],
      out_specs=[pl.BlockSpec((None, None, heads, rows, h), part),
                 pl.BlockSpec((None, None, heads, rows, 1), part)],
      scratch_shapes=[pltpu.VMEM((heads, rows, 1), jnp.float32),
                      pltpu.VMEM((heads, rows, 1), jnp.float32),
                      pltpu.VMEM((heads, rows, h), jnp.float32)])
  kernel = functools.partial(
      _kernel, tq=tq, h=h, s_len=s, heads=heads, blocks=blocks, block_k=bk, scale=float(scale),
      soft_cap=soft_cap, window_left=window_left,
      precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)
  o_part, lse_part = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct((splits, b, kv_heads, rows, h), jnp.float32),
                 jax.ShapeDtypeStruct((splits, b, kv_heads, rows, 1), jnp.float32)],
      compiler_params=_mosaic_tpu.params(("parallel", "parallel", "parallel", "arbitrary"),
                                         config.vmem_limit_bytes, interpret),
      interpret=interpret,
      name="jk_decode_attention",
  )(lengths.astype(jnp.int32), qg, k_cache, v_cache)
  # Back to (splits, B, Tq, N, H): head kh x G + g, query t.
  o_part = jnp.transpose(o_part.reshape(splits, b, kv_heads, group, tq, h), (0, 1, 4, 2, 3, 5))
  lse_part = jnp.transpose(lse_part.reshape(splits, b, kv_heads, group, tq), (0, 1, 4, 2, 3))
  return combine(o_part.reshape(splits, b, tq, n, h), lse_part.reshape(splits, b, tq, n),
                 q.dtype)
