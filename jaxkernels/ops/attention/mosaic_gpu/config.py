"""The Hopper attention kernels' ``Config``, its heuristic, what they serve, and the shared
memory each of the three kernels (forward, dq, dk/dv) needs of a CTA."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkernels import _mosaic_gpu, hardware
from jaxkernels._tiling import check_fields, pad_to, round_up

PRODUCER_REGISTERS = 40
# The backward kernels past head dim 128: a producer of 24 registers leaves 240 to each compute
# warpgroup; at GQA h256 dk/dv 4.72 -> 4.44 ms, dq 4.75 -> 4.34 (fewer spills), while at 128
# the kernels were no faster (notes/attn.md attention-6).
WIDE_PRODUCER_REGISTERS = 24
# The d(bias) kernel's keys a CTA (beside 2 x 64 queries): its four float32 tiles of 64 x 64
# (S, dP, the bias and the sum) take 128 registers a thread.
DBIAS_BLOCK_KV = 64
# The head dim's unit: TMA's 128-byte swizzle of 16-bit elements. Other head dims (80, 96, 112,
# 32) are zero-padded to the next multiple, which costs a copy of q, k and v and their
# products' share of the padding. Triton's kernels round H up to a power of two in registers,
# as wide as this padding or wider past 32: at h80 and h96 (padded to 128; B2 T=S=2048 N16/K4
# causal bf16, H200) these ran 0.106 / 0.420 ms forward / forward+backward, the copies
# counted, against Triton's 0.122 / 0.523 and cuDNN's 0.082 / 0.329 (notes/attn.md
# attention-8). Up to 32 Triton's tiles are the narrower (16 or 32 against 64): it is
# preferred there (``on_auto``; untimed).
HEAD_TILE = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  block_q: int = 64  # queries of one compute warpgroup (the CTA takes two blocks)
  block_kv: int = 128  # keys a step
  stages: int = 2  # key/value blocks in flight
  bwd_block_q: int = 64  # the dk/dv kernel's queries a step (its CTA takes 2 x 64 keys, or
  # 64 past head dim 128)
  bwd_block_kv: int = 64  # the dq kernel's keys a step (its CTA takes 2 x 64 queries); 32
  # past head dim 128, where two blocks of 64 keys do not fit beside 128 queries' q and dO
  bwd_stages: int = 2  # blocks in flight in either backward kernel (fewer where they do not fit)

  def __post_init__(self):
    check_fields(self, ("block_q",), lambda v: v == 64, "64 (a wgmma's rows per warpgroup)")
    check_fields(self, ("block_kv",), lambda v: v % 64 == 0 and 64 <= v <= 256,
                 "a multiple of 64 up to 256")
    check_fields(self, ("bwd_block_q",), lambda v: v in (64, 128), "64 or 128")
    check_fields(self, ("bwd_block_kv",), lambda v: v in (32, 64, 128), "32, 64 or 128")
    check_fields(self, ("stages", "bwd_stages"), lambda v: v >= 2, ">= 2")


def head_dim(problem) -> int:
  """The head dim the kernels walk: H, or H zero-padded to whole 64-column tiles (TMA's
  128-byte swizzle) where it is not (``pad_head``)."""
  return round_up(problem.head_dim, HEAD_TILE)


def pad_head(x):
  """x (..., H) zero-padded to the head dim the kernels walk (:func:`head_dim`'s): a padded q
  and k column adds 0 to q k^T, a padded v column gives an output column of 0, cropped; their
  gradients are cropped too. x itself where H is whole tiles."""
  return pad_to(x, (*x.shape[:-1], round_up(x.shape[-1], HEAD_TILE)))


def heuristic(problem, chip: hardware.Chip) -> Config:
  """FlashAttention-3's blocks: 2 x 64 queries against 128 keys at head dim 128 (64 keys at
  128 with 3 stages: 0.53 against 0.43 ms), 256 keys at 64 (0.604 against 0.621 ms for 128),
  64 keys past 128 (registers: the accumulator alone takes 128 a thread at 256). H100, B=2
  T=S=4096, notes/attn.md attention-4. The dq kernel past 128 takes 32 keys a step, two
  blocks in flight: at 256 its ring of one 64-key block ran 4.26 ms, this 2.63 (attention-7).
  Causal at head dim 64 over up to 4096 keys, 128 keys a step: a query block's last key block
  straddles the diagonal and computes masked products, up to a whole block's, and 256-key
  blocks waste twice 128's. At the 350m model's shape (8 x 2048, 16/4 heads, causal; H100)
  128 keys ran 0.191 ms against 256's 0.213 and cuDNN's 0.194 (notes/model.md model-4)."""
  h = head_dim(problem)
  block_kv = 256 if h <= 64 else 128 if h <= 128 else 64
  if h <= 64 and problem.window.plain_causal and problem.kv_len <= 4096:
    block_kv = 128
  if problem.bias is not None:  # a bias tile a stage beside k and v: 64 keys fit
    block_kv = 64
  return Config(block_q=64, block_kv=block_kv, stages=2, bwd_block_kv=64 if h <= 128 else 32)


def unsupported(problem, chip) -> str | None:
  if (reason := _mosaic_gpu.hopper_reason(chip)) is not None:
    return reason
  if jnp.dtype(problem.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"{problem.dtype} inputs: the kernel's wgmma takes 16-bit operands (Triton serves them)"
  if problem.bias is not None:
    need, limit = smem_bytes(problem, heuristic(problem, chip)), _mosaic_gpu.cta_smem_bytes(chip)
    if need > limit:  # head dim 256 with segments: q, k, v, the ids and a bias tile
      return (f"a bias at head dim {problem.head_dim}"
              f"{' with segment ids' if problem.segments else ''}: the forward's q, two "
              f"stages of k and v and a bias tile (counted at 4 bytes an element) need {need} "
              f"bytes of shared memory, over a CTA's {limit} (Triton serves it)")
  return None


def on_auto(problem) -> bool:
  """Whether dispatch prefers these kernels: head dims past 32, whole 64-column tiles or
  zero-padded to them, where Triton's power-of-two tiles are as wide (``HEAD_TILE``)."""
  return problem.head_dim > HEAD_TILE // 2


def bias_in_ring(head_dim: int) -> bool:
  """Whether the forward's bias tiles ride k's ring, a (2 x 64 queries, block_kv) tile a
  stage (up to head dim 128), or each compute warpgroup loads its own 64 rows into one buffer,
  the next tile as soon as it has read one (past 128, where q and two stages of k and v take
  192 KiB and a ring of bias tiles would not fit beside them)."""
  return head_dim <= 128


def smem_bytes(problem, config: Config) -> int:
  """The forward's shared memory (each buffer in whole KiB, as Mosaic GPU places them); a bias
  is counted at 4 bytes an element (its dtype is not the problem's: at most 4)."""
  itemsize = jnp.dtype(problem.dtype).itemsize
  h, bq, bk, stages = head_dim(problem), config.block_q, config.block_kv, config.stages
  buffers = [2 * bq * h * itemsize, stages * bk * h * itemsize, stages * bk * h * itemsize,
             2 * bq * 4]  # q, k, v, lse
  if problem.segments:
    buffers += [2 * bq * 4, stages * bk * 4]
  if problem.bias is not None:
    tiles = stages if bias_in_ring(h) else 1
    buffers.append(tiles * 2 * bq * bk * 4)
  return scoped_smem_bytes(*buffers)


def backward_smem_bytes(problem, config: Config) -> tuple[int, int]:
  """Shared memory of the (dq, dk/dv) kernels: each holds two blocks of 64 rows (queries with
  their dO; keys with their v, or one block's two head-dim halves) and rings of the other
  side's blocks, with a bias its tiles (counted at 4 bytes)."""
  h, itemsize = head_dim(problem), jnp.dtype(problem.dtype).itemsize
  segments, bias = bool(problem.segments), 4 if problem.bias is not None else 0
  return (_dq_bytes(h, itemsize, segments, config.bwd_block_kv,
                    dq_stages(h, itemsize, segments, config, bias), bias),
          _dkv_bytes(h, itemsize, segments, config,
                     dkv_stages(h, itemsize, segments, config, bias), bias))


def config_error(problem, config: Config, chip) -> str | None:
  limit = _mosaic_gpu.cta_smem_bytes(chip)
  need = smem_bytes(problem, config)
  if need > limit:
    return f"it needs {need} bytes of shared memory, over a CTA's {limit}"
  if head_dim(problem) > 128 and config.block_kv > 64:
    return f"block_kv {config.block_kv} at head dim {problem.head_dim} spills registers: use 64"
  for kernel, need in zip(("dq", "dk/dv"), backward_smem_bytes(problem, config)):
    if need > limit:
      return (f"its {kernel} kernel needs {need} bytes of shared memory, over a CTA's "
              f"{limit}: fewer bwd_stages or smaller backward blocks")
  return None


def head_parts(head_dim: int) -> int:
  """The dk/dv kernel's split of the head dim: 1 (each compute warpgroup takes 64 keys with the
  whole of dk and dv), or 2 past head dim 128, where 64 keys' dk and dv accumulators would take
  256 registers a thread: both warpgroups then take the same 64 keys, warpgroup w the w-th half
  of dk and dv's columns (and each computes the whole of S^T and dP^T)."""
  return 1 if head_dim <= 128 else 2


def backward_producer_registers(head_dim: int) -> int:
  """The backward kernels' producer registers (the compute warpgroups take the rest)."""
  return PRODUCER_REGISTERS if head_dim <= 128 else WIDE_PRODUCER_REGISTERS


def scoped_smem_bytes(*buffers: int) -> int:
  """Shared memory of scoped buffers of these byte sizes: each starts on a 1024-byte boundary
  (Pallas Mosaic GPU's alignment), and the barriers take at most one more KiB."""
  return sum(round_up(nbytes, 1024) for nbytes in buffers) + 1024


def _dq_bytes(h: int, itemsize: int, segments: bool, block_kv: int, stages: int,
              bias: int = 0) -> int:
  tile = 64 * h * itemsize
  buffers = [2 * tile, 2 * tile, 2 * 64 * 4, 2 * 64 * 4,  # q, dO, lse, delta
             stages * block_kv * h * itemsize, stages * block_kv * h * itemsize]  # k, v
  if segments:
    buffers += [2 * 64 * 4, stages * block_kv * 4]
  if bias:  # the CTA's 128 queries' bias against a block of keys, a stage
    buffers.append(stages * 128 * block_kv * bias)
  return scoped_smem_bytes(*buffers)


def _fitting(need, stages: int) -> int:
  """The largest ring depth up to ``stages`` (at least 1) whose ``need(stages)`` fits a CTA's
  shared memory."""
  limit = _mosaic_gpu.cta_smem_bytes()
  while need(stages) > limit and stages > 1:
    stages -= 1
  return stages


def dq_stages(h: int, itemsize: int, segments: bool, config: Config, bias: int = 0) -> int:
  """The dq kernel's ring depth (keys and values alike): ``bwd_stages``, less where it would
  not fit a CTA's shared memory (past head dim 128, 128 queries' q and dO take 128 KiB: rings
  of 64-key blocks hold one block each, of 32-key blocks two or three). ``bias``: its
  itemsize, 0 without one."""
  return _fitting(
      lambda st: _dq_bytes(h, itemsize, segments, config.bwd_block_kv, st, bias),
      config.bwd_stages)


def _dkv_bytes(h: int, itemsize: int, segments: bool, config: Config, stages: int,
               bias: int = 0) -> int:
  bq = config.bwd_block_q
  held = 2 * 64 * (h // head_parts(h)) * itemsize  # k or v: two blocks of 64 rows
  ring = stages * bq * h * itemsize  # q or dO
  buffers = [held, held, ring, ring, stages * bq * 4, stages * bq * 4]
  if segments:
    buffers += [2 * 64 * 4, stages * bq * 4]
  if bias:  # the CTA's keys' (transposed) bias against a block of queries, a stage
    buffers.append(stages * (128 // head_parts(h)) * bq * bias)
  return scoped_smem_bytes(*buffers)


def dkv_stages(h: int, itemsize: int, segments: bool, config: Config, bias: int = 0) -> int:
  """The dk/dv kernel's ring depth: ``bwd_stages`` without a bias (a config that does not fit
  is refused by :func:`config_error`), with one as many as fit beside its tiles."""
  if not bias:
    return config.bwd_stages
  return _fitting(lambda st: _dkv_bytes(h, itemsize, segments, config, st, bias),
                  config.bwd_stages)


def _dbias_bytes(itemsize: int, segments: bool, stages: int, bias: int) -> int:
  q = stages * 128 * 64 * itemsize  # q or dO: 2 x 64 queries' block of 64 of the head dim
  kv = stages * DBIAS_BLOCK_KV * 64 * itemsize
  buffers = [q, q, kv, kv, stages * 128 * 4, stages * 128 * 4, 128 * DBIAS_BLOCK_KV * bias]
  if segments:
    buffers += [stages * 128 * 4, stages * DBIAS_BLOCK_KV * 4]
  return scoped_smem_bytes(*buffers)


def dbias_stages(itemsize: int, segments: bool, bias: int) -> int:
  """The d(bias) kernel's ring depth: up to 4 blocks (of q, dO, k and v) in flight."""
  return _fitting(lambda st: _dbias_bytes(itemsize, segments, st, bias), 4)
