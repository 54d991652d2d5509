"""Pallas Mosaic GPU kernel for decode attention (Hopper): a few new queries against a long KV
cache (flash-decoding), the Triton kernel's split on Hopper's TMA and wgmma.

A CTA takes one kv head of one sequence and one chunk of its cache, and every query row of
the kv head's GQA group (G heads x Tq queries, padded to the 64 rows of one warpgroup's wgmma)
against it, so that each key and value is read once for the whole group. Two warpgroups: a
producer issues TMA loads of the chunk's key and value blocks into ``stages``-deep rings, the
consumer runs S = q k^T and P V on wgmma with the online softmax between (base 2, as the
flash forward's). Only the key blocks up to the sequence's length are loaded (the loop's
bounds are the length's), and only those its window reaches. A CTA writes its chunk's partial
output (float32) and log-sum-exp; XLA combines the chunks by their log-sum-exps
(``common.combine``), as for the Triton kernel.

The caches are read in place, (B, S, K, H): a key block is a (block_k, H) box of one kv head
(S a multiple of 8: the bulk copy's tiles of 8 rows). Where the blocks do not divide S, the
last one runs past the cache: the bulk copy fills the missing rows with zeros, and the
position mask drops them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkernels import _mosaic_gpu, hardware
from jaxkernels._activations import LN2, LOG2E
from jaxkernels._mosaic_gpu import iota, layout_cast, load_block
from jaxkernels._online_softmax import finite
from jaxkernels._tiling import cdiv, check_fields
from jaxkernels.ops.attention.common import combine
from jaxkernels.ops.attention.mosaic_gpu.config import scoped_smem_bytes
from jaxkernels.ops.attention.mosaic_gpu.forward import accumulate, scores
from jaxkernels.ops.attention.mosaic_gpu.schedule import ROWS, named, produce

MAX_QUERIES = ROWS  # a group's G x Tq query rows: one warpgroup's wgmma rows
CONSUMER, PRODUCER = 0, 1  # the warpgroups


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  block_k: int  # keys a step
  splits: int  # chunks of the cache a sequence's kv head is cut into
  stages: int  # key and value blocks in flight

  def __post_init__(self):
    check_fields(self, ("block_k",), lambda v: v % 64 == 0 and 64 <= v <= 256,
                 "a multiple of 64 up to 256")
    check_fields(self, ("splits",), lambda v: v >= 1, ">= 1")
    check_fields(self, ("stages",), lambda v: v >= 2, ">= 2")


def smem_bytes(problem, config: Config) -> int:
  """q's rows, the key and value rings, the log-sum-exps and offsets, as the attention
  kernels' scoped buffers are counted (``config.scoped_smem_bytes``)."""
  h, itemsize = problem.head_dim, jnp.dtype(problem.dtype).itemsize
  ring = config.stages * config.block_k * h * itemsize
  return scoped_smem_bytes(ROWS * h * itemsize, ROWS * 4, ROWS * 4, ring, ring)


def heuristic(problem, chip: hardware.Chip) -> Config:
  """128 keys a step at head dim 64, else 64; as many blocks in flight as fit two CTAs an SM
  (two to four); and the chunks a sequence's kv head is cut into so that the CTAs fill the
  SMs in one wave (each chunk at least four blocks long). At B=8 S=32768 N=32 K=8 H=128 on an
  H200 (notes/mgpurows.md mgpu-decode-1): 64 keys, two stages, four chunks ran the full cache in
  0.254-0.255 ms (Triton 0.253-0.262, cuDNN 0.255) and ragged lengths in 0.151-0.170 (Triton
  0.160-0.170, cuDNN 0.152); eight chunks (two waves) 0.253 and 0.157, within that spread;
  five (1.2 waves) 0.311 on the full cache."""
  block_k = 128 if problem.head_dim <= 64 else 64
  fits = lambda stages, ctas: smem_bytes(
      problem, Config(block_k=block_k, splits=1, stages=stages)) <= (
          _mosaic_gpu.cta_smem_bytes(chip) // ctas)
  stages = next((n for n in (4, 3) if fits(n, 2)), 2)
  slots = chip.cores * (2 if fits(stages, 2) else 1)  # CTAs resident at once
  programs = problem.batch * problem.kv_heads
  splits = max(1, min(slots // programs, problem.kv_len // (4 * block_k)))
  return Config(block_k=block_k, splits=splits, stages=stages)


def unsupported(problem, chip) -> str | None:
  if (reason := _mosaic_gpu.hopper_reason(chip)) is not None:
    return reason
  if jnp.dtype(problem.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"{problem.dtype} inputs: the kernel's wgmma takes 16-bit operands"
  if problem.head_dim % 64 or problem.head_dim > 256:
    return (f"head dim {problem.head_dim} is not a multiple of 64 up to 256 (TMA's 128-byte "
            "swizzle, wgmma's widest product)")
  if problem.kv_len % 8:
    return (f"the caches' length {problem.kv_len} is not a multiple of 8 (the bulk copy's "
            "tiles of 8 rows)")
  rows = problem.q_len * problem.heads // problem.kv_heads
  if rows > MAX_QUERIES:
    return (f"{problem.q_len} queries x {problem.heads // problem.kv_heads} heads a group is "
            f"{rows} rows, over a warpgroup's {MAX_QUERIES}")
  return None


def config_error(problem, config: Config, chip) -> str | None:
  limit = _mosaic_gpu.cta_smem_bytes(chip)
  need = smem_bytes(problem, config)
  if need > limit:
    return (f"block_k={config.block_k} at stages={config.stages} needs {need} bytes of shared "
            f"memory, over a CTA's {limit}")
  return None


@dataclasses.dataclass(frozen=True)
class _Call:
  """One launch, static: the caches' length and kv heads, the chunk a CTA takes, the mask's
  and the logits' extras."""

  tq: int
  kv_len: int
  kv_heads: int
  head_dim: int
  chunk: int
  scale: float
  soft_cap: float | None
  window_left: int | None
  dtype: jnp.dtype


def _kernel(q_ref, k_ref, v_ref, lengths_ref, offsets_ref, o_ref, lse_ref, *, call: _Call,
            config: Config, interpret):
  c, h = config, call.head_dim
  transforms = _mosaic_gpu.swizzled(h, call.dtype)

  @functools.partial(
      pl.run_scoped, collective_axes="wg",
      q_smem=plgpu.SMEM((ROWS, h), call.dtype, transforms=transforms),
      lse_smem=plgpu.SMEM((ROWS,), jnp.float32),
      offsets_smem=plgpu.SMEM((ROWS,), jnp.int32),
      k_smem=plgpu.SMEM((c.stages, c.block_k, h), call.dtype, transforms=transforms),
      v_smem=plgpu.SMEM((c.stages, c.block_k, h), call.dtype, transforms=transforms),
      q_full=plgpu.Barrier(num_arrivals=2),
      k_full=plgpu.Barrier(num_barriers=c.stages),
      v_full=plgpu.Barrier(num_barriers=c.stages),
      k_free=plgpu.Barrier(num_barriers=c.stages),
      v_free=plgpu.Barrier(num_barriers=c.stages))
  def _scope(**s):
    _body(q_ref, k_ref, v_ref, lengths_ref, offsets_ref, o_ref, lse_ref, call=call, config=c,
          interpret=interpret, **s)


def _body(q_ref, k_ref, v_ref, lengths_ref, offsets_ref, o_ref, lse_ref, *, call: _Call,
          config: Config, interpret, q_smem, lse_smem, offsets_smem, k_smem, v_smem,
          q_full, k_full, v_full, k_free, v_free):
  c = config
  split, program = lax.axis_index("split"), lax.axis_index("program")
  b, kh = lax.div(program, jnp.int32(call.kv_heads)), lax.rem(program, jnp.int32(call.kv_heads))
  wg = lax.axis_index("wg")
  length = lengths_ref[b]
  # The chunk's keys that any query sees: up to the length (a length past S: the whole
  # cache, as the reference), from the window's first block.
  lo = split * call.chunk
  hi = jnp.minimum(jnp.minimum(lo + call.chunk, length), call.kv_len)
  if call.window_left is not None:
    first = jnp.maximum(length - call.tq - call.window_left, 0)
    lo = jnp.maximum(lo, first // c.block_k * c.block_k)
  first_block = lo // c.block_k
  end_block = jnp.maximum((hi + c.block_k - 1) // c.block_k, first_block)
  slot_of = lambda j: lax.rem(j - first_block, jnp.int32(c.stages))

  @pl.when(wg == PRODUCER)
  def _producer():
    def stream(ref, smem, full):
      def load(j, slot):
        keys = pl.ds(j * c.block_k, c.block_k)
        plgpu.copy_gmem_to_smem(ref.at[b, keys, kh], smem.at[slot], full.at[slot])
      return load
    produce(first_block, end_block, c.stages,
            [(k_free, stream(k_ref, k_smem, k_full)), (v_free, stream(v_ref, v_smem, v_full))])

  @pl.when(wg == CONSUMER)
  def _consumer():
    plgpu.copy_gmem_to_smem(q_ref.at[program], q_smem, q_full)
    plgpu.copy_gmem_to_smem(offsets_ref, offsets_smem, q_full)
    plgpu.barrier_wait(q_full)
    shape = (ROWS, c.block_k)
    # Row r's query sits at position length + offsets[r] (offsets: t - Tq for its query t).
    position = lax.broadcast_in_dim(
        length + load_block(offsets_smem, plgpu.Layout.WGMMA.reduce(1), interpret),
        shape, [0])
    if call.soft_cap is None:
      scale2 = call.scale * LOG2E
    else:
      scale2 = call.soft_cap * LOG2E

    def step(j, carry):
      acc, peak, total = carry
      slot = slot_of(j)
      plgpu.barrier_wait(k_full.at[slot])
      qk = scores(q_smem, k_smem.at[slot], lambda: None, interpret)
      plgpu.barrier_arrive(k_free.at[slot])
      keys = j * c.block_k + iota(shape, 1, interpret)
      mask = (keys <= position) & (keys < hi)
      if call.window_left is not None:
        mask = mask & (keys >= position - call.window_left)
      x = qk if call.soft_cap is None else jnp.tanh(qk * (call.scale / call.soft_cap))
      s = jnp.where(mask, x * scale2, -jnp.inf)
      new_peak = jnp.maximum(peak, s.max(axis=1))
      safe = finite(new_peak)  # a row that sees nothing yet
      p = jnp.exp2(s - lax.broadcast_in_dim(safe, shape, [0]))
      rescale = jnp.exp2(peak - safe)
      acc = acc * lax.broadcast_in_dim(rescale, acc.shape, [0])
      total = total * rescale + p.sum(axis=1)
      plgpu.barrier_wait(v_full.at[slot])
      acc = accumulate(acc, p.astype(call.dtype), v_smem.at[slot], lambda: None, interpret)
      plgpu.barrier_arrive(v_free.at[slot])
      return acc, new_peak, total

    rows = plgpu.Layout.WGMMA.reduce(1)
    carry = (layout_cast(jnp.zeros((ROWS, call.head_dim), jnp.float32), plgpu.Layout.WGMMA,
                         interpret),
             layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), rows, interpret),
             layout_cast(jnp.zeros((ROWS,), jnp.float32), rows, interpret))
    acc, peak, total = lax.fori_loop(first_block, end_block, step, carry)
    seen = total > 0
    inv = jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0)
    # The partial output from registers straight to global memory (a few KiB against the
    # chunk's MiBs of keys and values).
    o_ref.at[split, program][...] = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
    lse_smem[...] = jnp.where(seen, finite(peak) * LN2 + jnp.log(jnp.where(seen, total, 1.0)),
                              -jnp.inf)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, program])
    plgpu.wait_smem_to_gmem(0)


def forward(q, k_cache, v_cache, lengths, *, scale: float, soft_cap: float | None,
            window_left: int | None, config: Config, interpret=False):
  """(B, Tq, N, H) in q's dtype."""
  b, tq, n, h = q.shape
  s, kv_heads = k_cache.shape[1], k_cache.shape[2]
  group = n // kv_heads
  rows = group * tq
  splits = max(1, min(config.splits, cdiv(s, config.block_k)))
  chunk = cdiv(cdiv(s, splits), config.block_k) * config.block_k
  splits = cdiv(s, chunk)  # none left empty by the rounding up
  # q as each kv head's rows, head g's query t at row g Tq + t, padded to a warpgroup's 64.
  q_rows = q.reshape(b, tq, kv_heads, group, h).transpose(0, 2, 3, 1, 4)
  q_rows = jnp.pad(q_rows.reshape(b * kv_heads, rows, h), ((0, 0), (0, ROWS - rows), (0, 0)))
  offsets = jnp.arange(ROWS, dtype=jnp.int32) % tq - tq
  call = _Call(tq, s, kv_heads, h, chunk, float(scale), soft_cap, window_left,
               jnp.dtype(q.dtype))
  o_part, lse_part = plgpu.kernel(
      named("jk_decode_attention_mgpu", _kernel, call=call, config=config,
            interpret=bool(interpret)),
      out_type=[jax.ShapeDtypeStruct((splits, b * kv_heads, ROWS, h), jnp.float32),
                jax.ShapeDtypeStruct((splits, b * kv_heads, ROWS), jnp.float32)],
      grid=(splits, b * kv_heads),
      grid_names=("split", "program"),
      num_threads=2,
      thread_name="wg",
      # ex2.approx and tanh.approx on the SFU, as the flash forward's; 1/l and log once a row.
      compiler_params=plgpu.CompilerParams(approx_math=True),
      # Interpreted, the last key block's copy past the cache reads zeros, as on the GPU.
      **({"interpret": _mosaic_gpu.reading_zeros_past_the_end(interpret)} if interpret
         else {}),
  )(q_rows, k_cache, v_cache, lengths.astype(jnp.int32), offsets)
  unrows = lambda x: jnp.moveaxis(
      x[:, :, :rows].reshape(splits, b, kv_heads, group, tq, *x.shape[3:]), 4, 2)
  o_part = unrows(o_part).reshape(splits, b, tq, n, h)
  lse_part = unrows(lse_part).reshape(splits, b, tq, n)
  return combine(o_part, lse_part, q.dtype)
