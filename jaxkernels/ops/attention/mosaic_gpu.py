"""Pallas Mosaic GPU flash attention forward for Hopper: FlashAttention-3's schedule.

A CTA takes two blocks of ``block_q`` queries of one head; three warpgroups share it. One
issues TMA loads of the key and value blocks into a ``stages``-deep ring of swizzled shared
memory; each of the other two owns one query block and runs S = q k^T and then P V on wgmma,
q and k from shared memory, P from registers, the float32 accumulator in registers. The two
compute warpgroups take turns at the tensor cores (the "schedule barrier", a rendezvous
twice a step): while one runs its softmax, the other's matmuls run. Statistics are the online
softmax's in base 2 (one ex2 per score, the scale folded into an FMA).

Masks as the Triton kernels do them (``common.key_blocks``): each warpgroup walks the key
blocks its window leaves visible in three runs, only the edge runs paying for a position
mask; the ring is filled with the union of the two warpgroups' runs, and a warpgroup idles
through the steps outside its own (it still waits for and releases their slots, so that the
barriers' phases stay in step). Segment ids come with the key blocks (one more TMA copy a
step) and mask every block; a tile visits only the key blocks whose id ranges overlap its own
(``_meeting_blocks``, computed by XLA before the kernel: packed sequences skip each other).
A bias comes the same way, the CTA's (2 block_q, block_kv) tile a stage, each compute
warpgroup reading its half in the WGMMA layout.

Edges: swizzled TMA reads rows in tiles of 8 and no copy may run past an array, so T and S
are padded to whole blocks where they are not (one copy of q, k and v, and of the output);
the keys past S are masked in the last block. The log-sum-exp is written (B, N, T) and
transposed by XLA (a few hundred KiB).

The backward is two more kernels of the same make (a dq kernel, and a dk/dv kernel that walks
the queries for each block of keys), below; with a bias it is the Triton kernels'
(``triton.backward``, with ``Config.backward``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkernels import _mosaic_gpu, hardware
from jaxkernels._online_softmax import finite
from jaxkernels._tiling import cdiv, check_fields, pad_to, round_up
from jaxkernels.ops.attention import triton
from jaxkernels.ops.attention.common import Call, Window, key_blocks, visible

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
PRODUCER_REGISTERS = 40
# The backward kernels past head dim 128: a producer of 24 registers leaves 240 to each compute
# warpgroup; at GQA h256 dk/dv 4.72 -> 4.44 ms, dq 4.75 -> 4.34 (fewer spills), while at 128
# the kernels were no faster (bench/NOTES.md attention-6).
WIDE_PRODUCER_REGISTERS = 24
SMEM_BYTES = 227 * 1024  # a Hopper CTA's shared memory


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
  # The Triton backward's config, for the calls the Mosaic GPU backward does not serve (a
  # bias); None: Triton's heuristic.
  backward: triton.Config | None = None

  def __post_init__(self):
    check_fields(self, ("block_q",), lambda v: v == 64, "64 (a wgmma's rows per warpgroup)")
    check_fields(self, ("block_kv",), lambda v: v % 64 == 0 and 64 <= v <= 256,
                 "a multiple of 64 up to 256")
    check_fields(self, ("bwd_block_q",), lambda v: v in (64, 128), "64 or 128")
    check_fields(self, ("bwd_block_kv",), lambda v: v in (32, 64, 128), "32, 64 or 128")
    check_fields(self, ("stages", "bwd_stages"), lambda v: v >= 2, ">= 2")


def heuristic(problem, chip: hardware.Chip) -> Config:
  """FlashAttention-3's blocks: 2 x 64 queries against 128 keys at head dim 128 (64 keys at
  128 with 3 stages: 0.53 against 0.43 ms), 256 keys at 64 (0.604 against 0.621 ms for 128),
  64 keys past 128 (registers: the accumulator alone takes 128 a thread at 256). H100, B=2
  T=S=4096, bench/NOTES.md attention-4. The dq kernel past 128 takes 32 keys a step, two
  blocks in flight: at 256 its ring of one 64-key block ran 4.26 ms, this 2.63 (attention-7).
  Causal at head dim 64 over up to 4096 keys, 128 keys a step: a query block's last key block
  straddles the diagonal and computes masked products, up to a whole block's, and 256-key
  blocks waste twice 128's. At the 350m model's shape (8 x 2048, 16/4 heads, causal; H100)
  128 keys ran 0.191 ms against 256's 0.213 and cuDNN's 0.194 (bench/NOTES.md model-4)."""
  h = problem.head_dim
  block_kv = 256 if h <= 64 else 128 if h <= 128 else 64
  if h <= 64 and problem.window.plain_causal and problem.kv_len <= 4096:
    block_kv = 128
  if problem.bias is not None:  # a bias tile a stage beside k and v: 64 keys fit
    block_kv = 64
  return Config(block_q=64, block_kv=block_kv, stages=2, bwd_block_kv=64 if h <= 128 else 32,
                backward=triton.heuristic(problem, chip))


def unsupported(problem, chip) -> str | None:
  del chip
  if jnp.dtype(problem.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"{problem.dtype} inputs: the kernel's wgmma takes 16-bit operands (Triton serves them)"
  if problem.head_dim % 64:
    return (f"head dim {problem.head_dim} is not a multiple of 64 (TMA's 128-byte swizzle; "
            "Triton serves it)")
  return None


def smem_bytes(problem, config: Config) -> int:
  itemsize = jnp.dtype(problem.dtype).itemsize
  h = problem.head_dim
  q = 2 * config.block_q * h * itemsize
  kv = 2 * config.stages * config.block_kv * h * itemsize
  extras = 2 * config.block_q * 4 + (
      (2 * config.block_q + config.stages * config.block_kv) * 4 if problem.segments else 0)
  # A bias tile a stage (its dtype is q's at most 4 bytes: counted at 4).
  bias = config.stages * 2 * config.block_q * config.block_kv * 4 if problem.bias else 0
  return q + kv + extras + bias


def backward_smem_bytes(problem, config: Config) -> tuple[int, int]:
  """Shared memory of the (dq, dk/dv) kernels: each holds two blocks of 64 rows (queries with
  their dO; keys with their v, or one block's two head-dim halves) and rings of the other
  side's blocks."""
  h, itemsize = problem.head_dim, jnp.dtype(problem.dtype).itemsize
  segments = bool(problem.segments)
  stages = _dq_stages(h, itemsize, segments, config)
  return (_dq_bytes(h, itemsize, segments, config.bwd_block_kv, stages),
          _dkv_bytes(h, itemsize, segments, config))


def config_error(problem, config: Config, chip) -> str | None:
  del chip
  need = smem_bytes(problem, config)
  if need > SMEM_BYTES:
    return f"it needs {need} bytes of shared memory, over a CTA's {SMEM_BYTES}"
  if problem.head_dim > 128 and config.block_kv > 64:
    return f"block_kv {config.block_kv} at head dim {problem.head_dim} spills registers: use 64"
  if problem.bias is None:  # the Mosaic GPU backward's
    for kernel, need in zip(("dq", "dk/dv"), backward_smem_bytes(problem, config)):
      if need > SMEM_BYTES:
        return (f"its {kernel} kernel needs {need} bytes of shared memory, over a CTA's "
                f"{SMEM_BYTES}: fewer bwd_stages or smaller backward blocks")
  return None


# --------------------------------------------------------------------------- #
# The kernel
# --------------------------------------------------------------------------- #


class _Walk(NamedTuple):
  """A compute warpgroup's key blocks (``common.key_blocks``' runs, empty where its queries
  lie past T) inside the ring's steps [lo, hi): the union of both warpgroups' runs."""

  first: Any
  full_first: Any
  full_end: Any
  end: Any


def _ring(tile, n_rows: int, n_cols: int, block: int, window: Window, meet=None,
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
  walks = [_Walk(*(jnp.where(s, x, hi) for x in r)) for s, r in zip(some, raw)]
  if meet is not None:
    lo = jnp.maximum(lo, meet[0])
    hi = jnp.maximum(jnp.minimum(hi, meet[1]), lo)
    walks = [_Walk(*(jnp.clip(x, lo, hi) for x in w)) for w in walks]
  return lo, hi, walks


def _kernel(q_ref, k_ref, v_ref, *refs, call: Call, config: Config, interpret):
  c = config
  refs = list(refs)
  bias_ref = refs.pop(0) if call.bias_shape is not None else None
  if call.segments:
    q_seg_ref, kv_seg_ref, meet_ref, o_ref, lse_ref = refs
  else:
    (o_ref, lse_ref), q_seg_ref, kv_seg_ref, meet_ref = refs, None, None, None
  transforms = _mosaic_gpu.swizzled(call.head_dim, call.dtype)
  extra_buffers = {}
  if call.segments:
    extra_buffers = dict(q_seg_smem=plgpu.SMEM((2, c.block_q), jnp.int32),
                           kv_seg_smem=plgpu.SMEM((c.stages, c.block_kv), jnp.int32))
  q_copies = 2 if call.segments else 1  # TMA copies arriving on a q or k slot's barrier
  k_copies = q_copies + (bias_ref is not None)
  if bias_ref is not None:  # the CTA's (2 block_q, block_kv) bias tile, a stage
    extra_buffers["bias_smem"] = plgpu.SMEM(
        (c.stages, 2 * c.block_q, c.block_kv), bias_ref.dtype,
        transforms=_mosaic_gpu.swizzled(c.block_kv, bias_ref.dtype))

  @functools.partial(
      pl.run_scoped, collective_axes="wg",
      q_smem=plgpu.SMEM((2, c.block_q, call.head_dim), call.dtype, transforms=transforms),
      k_smem=plgpu.SMEM((c.stages, c.block_kv, call.head_dim), call.dtype,
                        transforms=transforms),
      v_smem=plgpu.SMEM((c.stages, c.block_kv, call.head_dim), call.dtype,
                        transforms=transforms),
      lse_smem=plgpu.SMEM((2, c.block_q), jnp.float32),
      q_full=plgpu.Barrier(num_arrivals=q_copies, num_barriers=2),
      k_full=plgpu.Barrier(num_arrivals=k_copies, num_barriers=c.stages),
      v_full=plgpu.Barrier(num_barriers=c.stages),
      k_free=plgpu.Barrier(num_arrivals=2, num_barriers=c.stages),
      v_free=plgpu.Barrier(num_arrivals=2, num_barriers=c.stages),
      turn=plgpu.Barrier(num_arrivals=2),
      **extra_buffers)
  def _scope(**s):
    _body(q_ref, k_ref, v_ref, bias_ref, q_seg_ref, kv_seg_ref, meet_ref, o_ref, lse_ref,
          call=call, config=c, interpret=interpret, **s)


def _body(q_ref, k_ref, v_ref, bias_ref, q_seg_ref, kv_seg_ref, meet_ref, o_ref, lse_ref, *,
          call: Call, config: Config, interpret, q_smem, k_smem, v_smem, lse_smem, q_full,
          k_full, v_full, k_free, v_free, turn, q_seg_smem=None, kv_seg_smem=None,
          bias_smem=None):
  c = config
  b = lax.axis_index("batch")
  n = lax.axis_index("heads")
  # Query tiles in reverse: under a causal mask the last ones have the most keys, and the
  # longest CTAs should start first.
  tile = lax.axis_size("q") - 1 - lax.axis_index("q")
  kh = lax.div(n, jnp.int32(call.group))
  wg = lax.axis_index("wg")
  meet = None if meet_ref is None else (meet_ref[b, tile, 0], meet_ref[b, tile, 1])
  lo, hi, walks = _ring(tile, call.q_len, call.kv_len, c.block_kv, call.window, meet)
  slot_of = lambda j: lax.rem(j - lo, jnp.int32(c.stages))

  def rendezvous():
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    @pl.loop(lo, hi)
    def _(j):
      slot = slot_of(j)
      keys = pl.ds(j * c.block_kv, c.block_kv)
      refill = j - lo >= c.stages

      @pl.when(refill)
      def _():
        plgpu.barrier_wait(k_free.at[slot])

      plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kh], k_smem.at[slot], k_full.at[slot])
      if call.segments:
        plgpu.copy_gmem_to_smem(kv_seg_ref.at[b, keys], kv_seg_smem.at[slot], k_full.at[slot])
      if bias_ref is not None:
        bb, nb = call.bias_shape[:2]
        rows = pl.ds(tile * 2 * c.block_q, 2 * c.block_q)
        plgpu.copy_gmem_to_smem(bias_ref.at[b if bb > 1 else 0, n if nb > 1 else 0, rows, keys],
                                bias_smem.at[slot], k_full.at[slot])

      @pl.when(refill)
      def _():
        plgpu.barrier_wait(v_free.at[slot])

      plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kh], v_smem.at[slot], v_full.at[slot])

    # The releases that no fill waited for: every barrier ends with each phase observed.
    @pl.loop(jnp.maximum(hi - c.stages, lo), hi)
    def _(j):
      plgpu.barrier_wait(k_free.at[slot_of(j)])
      plgpu.barrier_wait(v_free.at[slot_of(j)])

  @pl.when(wg < 2)
  def _consumer():
    plgpu.set_max_registers(_mosaic_gpu.consumer_registers(PRODUCER_REGISTERS),
                            action="increase")
    row0 = tile * 2 * c.block_q + wg * c.block_q
    walk = _Walk(*(jnp.where(wg == 0, a, b_) for a, b_ in zip(*walks)))
    queries = pl.ds(row0, c.block_q)
    q_tile = q_smem.at[wg]

    plgpu.copy_gmem_to_smem(q_ref.at[b, queries, n], q_tile, q_full.at[wg])
    if call.segments:
      plgpu.copy_gmem_to_smem(q_seg_ref.at[b, queries], q_seg_smem.at[wg], q_full.at[wg])
    plgpu.barrier_wait(q_full.at[wg])

    q_seg = None
    if call.segments:
      q_seg = _load(q_seg_smem.at[wg], plgpu.Layout.WGMMA.reduce(1), interpret)

    def next_keys(j):
      """Waits for step j + 1's keys (each step's own were awaited by the step before)."""
      @pl.when(j + 1 < hi)
      def _():
        plgpu.barrier_wait(k_full.at[slot_of(j + 1)])

    def idle(j, carry):
      slot = slot_of(j)
      next_keys(j)
      plgpu.barrier_arrive(k_free.at[slot])
      rendezvous()
      plgpu.barrier_wait(v_full.at[slot])
      plgpu.barrier_arrive(v_free.at[slot])
      rendezvous()
      return carry

    def step(positions: bool):
      def run(j, carry):
        bias = None
        if bias_smem is not None:
          bias = bias_smem.at[slot_of(j), pl.ds(wg * c.block_q, c.block_q)]
        return _step(j, carry, slot_of(j), row0, q_tile, q_seg, bias, positions, call=call,
                     config=c, interpret=interpret, next_keys=functools.partial(next_keys, j),
                     k_smem=k_smem, v_smem=v_smem, kv_seg_smem=kv_seg_smem, v_full=v_full,
                     k_free=k_free, v_free=v_free, turn=turn)
      return run

    rows = plgpu.Layout.WGMMA.reduce(1)
    acc = _cast(jnp.zeros((c.block_q, call.head_dim), jnp.float32), plgpu.Layout.WGMMA,
                interpret)
    peak = _cast(jnp.full((c.block_q,), -jnp.inf, jnp.float32), rows, interpret)
    total = _cast(jnp.zeros((c.block_q,), jnp.float32), rows, interpret)
    carry = (acc, peak, total)
    pl.when(wg == 1)(rendezvous)  # warpgroup 1 runs half a step behind warpgroup 0

    @pl.when(lo < hi)
    def _():
      plgpu.barrier_wait(k_full.at[slot_of(lo)])

    lax.fori_loop(lo, walk.first, idle, None)
    carry = lax.fori_loop(walk.first, walk.full_first, step(True), carry)
    carry = lax.fori_loop(walk.full_first, walk.full_end, step(False), carry)
    carry = lax.fori_loop(walk.full_end, walk.end, step(True), carry)
    lax.fori_loop(walk.end, hi, idle, None)
    pl.when(wg == 0)(rendezvous)

    acc, peak, total = carry
    seen = total > 0
    inv = jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0)
    q_tile[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(call.dtype)
    lse_smem[wg] = jnp.where(seen, finite(peak) * LN2 + jnp.log(jnp.where(seen, total, 1.0)),
                             -jnp.inf)
    plgpu.commit_smem()

    plgpu.copy_smem_to_gmem(q_tile, o_ref.at[b, queries, n])
    plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, n, queries])

    plgpu.wait_smem_to_gmem(0)


# The Mosaic GPU interpreter (jax 0.10-0.11) runs the kernel's jaxpr on the CPU, where
# registers have no layouts: it has no layout_cast, layout-taking iota, plgpu.load, run_state,
# accumulator stores, transposed shared-memory views or wgmma operands in registers, so both
# products are dots there. These helpers are the only places the kernel differs for it.


def _cast(x, layout, interpret):
  return x if interpret else plgpu.layout_cast(x, layout)


def _iota(shape, dim, interpret):
  if interpret:
    return lax.broadcasted_iota(jnp.int32, shape, dim)
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _load(ref, layout, interpret):
  """A block of shared memory in registers in ``layout`` (a WGMMA tile, or its rows' or
  columns' vector)."""
  if interpret:
    return ref[...]
  return _mosaic_gpu.load(ref, layout=layout, optimized=False)


def _scores(q_smem, k_smem, then, interpret):
  """q k^T by one wgmma (k^T a transposed view of k's block), ``then()`` run while it is in
  flight; interpreted (no transposed shared-memory views there), a dot of the blocks."""
  if interpret:
    then()
    return lax.dot_general(q_smem[...], k_smem[...], (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32)

  def product(acc_ref):
    plgpu.wgmma(acc_ref, q_smem, _mosaic_gpu.transposed(k_smem))
    then()
    return acc_ref[...]

  return pl.run_scoped(product, plgpu.ACC((q_smem.shape[0], k_smem.shape[0]), jnp.float32))


def _accumulate(acc, a, b_smem, then, interpret):
  """acc + a @ b by one wgmma into the accumulator's registers (``run_state`` with it as the
  initial value), ``then()`` run while it is in flight; interpreted (its wgmma reads no
  registers), a dot added."""
  if interpret:
    then()
    return acc + lax.dot_general(a, b_smem[...], (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)

  def product(acc_ref):
    plgpu.wgmma(acc_ref, a, b_smem)
    then()

  return pl.run_state(product)(plgpu.ACC.init(acc))


def _step(j, carry, slot, row0, q_tile, q_seg, bias, positions: bool, *, call: Call,
          config: Config, interpret, next_keys, k_smem, v_smem, kv_seg_smem, v_full, k_free,
          v_free, turn):
  """One key block of a compute warpgroup: S = q k^T, the online softmax, acc += P V; with
  ``positions`` the window's mask (and the keys' end), with segments theirs."""
  c = config
  acc, peak, total = carry
  shape = (c.block_q, c.block_kv)

  def turn_over():  # the other warpgroup may take the tensor cores
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)

  qk = _scores(q_tile, k_smem.at[slot], turn_over, interpret)
  mask = None
  if positions or call.segments:
    kv_seg = None
    if call.segments:
      kv_seg = lax.broadcast_in_dim(
          _load(kv_seg_smem.at[slot], plgpu.Layout.WGMMA.reduce(0), interpret), shape, [1])
    rows = row0 + _iota(shape, 0, interpret)
    cols = j * c.block_kv + _iota(shape, 1, interpret)
    mask = visible(rows, cols, call.window if positions else Window(None, None),
                   None if q_seg is None else lax.broadcast_in_dim(q_seg, shape, [0]), kv_seg)
    if positions and call.kv_len % c.block_kv:
      end = cols < call.kv_len
      mask = end if mask is None else mask & end
  if bias is not None:  # read before the slot is released
    bias = _load(bias, plgpu.Layout.WGMMA, interpret).astype(jnp.float32) * LOG2E
  plgpu.barrier_arrive(k_free.at[slot])

  # The logits in base 2 are x * scale2: x is q k^T, or with a cap tanh(q k^T scale / cap)
  # (one tanh.approx), so that exp2(x * scale2 - peak) is one FMA and one ex2 either way.
  if call.soft_cap is None:
    x, scale2 = qk, call.scale * LOG2E
  else:
    x, scale2 = jnp.tanh(qk * (call.scale / call.soft_cap)), call.soft_cap * LOG2E
  if bias is None and mask is None:  # every score is finite: x's row maximum, scaled after
    new_peak = jnp.maximum(peak, x.max(axis=1) * scale2)
    p = jnp.exp2(x * scale2 - lax.broadcast_in_dim(new_peak, shape, [0]))
    safe = new_peak
  else:
    s = x * scale2 if bias is None else x * scale2 + bias
    s = s if mask is None else jnp.where(mask, s, -jnp.inf)
    new_peak = jnp.maximum(peak, s.max(axis=1))
    safe = finite(new_peak)  # a row that sees nothing yet (masked, or a bias of -inf)
    p = jnp.exp2(s - lax.broadcast_in_dim(safe, shape, [0]))
  rescale = jnp.exp2(peak - safe)
  acc = acc * lax.broadcast_in_dim(rescale, acc.shape, [0])
  total = total * rescale
  p16 = p.astype(call.dtype)

  def softmax_done():
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(v_full.at[slot])
    plgpu.barrier_wait(turn)  # the tensor cores are free again

  # The order that JAX's example found fastest: the row sum before the rendezvous where the
  # accumulator is small, after it at head dims past 128.
  if call.head_dim <= 128:
    total = total + p.sum(axis=1)
    acc, total, new_peak, p16 = lax.optimization_barrier((acc, total, new_peak, p16))
    softmax_done()
  else:
    softmax_done()
    total = total + p.sum(axis=1)

  # The next step's keys are awaited while this product runs (JAX's example's order).
  acc = _accumulate(acc, p16, v_smem.at[slot], next_keys, interpret)
  plgpu.barrier_arrive(v_free.at[slot])
  return acc, new_peak, total


def forward(q, k, v, bias, q_seg, kv_seg, *, window: Window, scale: float,
            soft_cap: float | None, config: Config, interpret=False):
  """(out (B, T, N, H) in q's dtype, lse (B, T, N) float32, natural log; -inf for a query
  that sees no key)."""
  call = Call.of(q, k, bias, q_seg, window=window, scale=scale, soft_cap=soft_cap)
  c = config
  b, t, n, h = q.shape
  tiles = cdiv(t, 2 * c.block_q)
  t_pad, s_pad = tiles * 2 * c.block_q, round_up(call.kv_len, c.block_kv)
  # Swizzled TMA reads rows in tiles of 8, and no copy may run past an array: T and S are
  # padded to whole blocks where they are not (the padded keys are masked, the padded
  # queries' rows dropped).
  length = lambda x, to: pad_to(x, (x.shape[0], to, *x.shape[2:]))
  operands = [length(q, t_pad), length(k, s_pad), length(v, s_pad)]
  if bias is not None:  # (Bb, Nb, T, S): rows and columns padded to whole blocks
    operands.append(pad_to(bias, (*bias.shape[:2], t_pad, s_pad)))
  if call.segments:
    # Padded with their last ids, so that the padding widens no tile's range of ids.
    edge = lambda x, to: jnp.pad(x.astype(jnp.int32), ((0, 0), (0, to - x.shape[1])),
                                 mode="edge")
    q_seg, kv_seg = edge(q_seg, t_pad), edge(kv_seg, s_pad)
    operands += [q_seg, kv_seg, _meeting_blocks(q_seg, kv_seg, 2 * c.block_q, c.block_kv)]
  out, lse = plgpu.kernel(
      _named("jk_attention_fwd_mgpu", _kernel, call=call, config=c, interpret=bool(interpret)),
      out_type=[jax.ShapeDtypeStruct((b, t_pad, n, h), q.dtype),
                jax.ShapeDtypeStruct((b, n, t_pad), jnp.float32)],
      grid=(n, tiles, b),
      grid_names=("heads", "q", "batch"),
      num_threads=3,
      thread_name="wg",
      # ex2.approx and tanh.approx on the SFU, as the Triton kernel's; 1/l and log once a row.
      compiler_params=plgpu.CompilerParams(approx_math=True),
      **({"interpret": interpret} if interpret else {}),
  )(*operands)
  return out[:, :t], jnp.swapaxes(lse[:, :, :t], 1, 2)


def _named(name: str, body, **kwargs):
  """``body`` with ``kwargs`` bound, named ``name``: plgpu.kernel names its kernel after its
  body (a profile's rows, the lowering's)."""
  out = functools.partial(body, **kwargs)
  out.__name__ = name
  return out


def _meeting_blocks(q_seg, kv_seg, rows: int, cols: int):
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
# The backward: a dq kernel and a dk/dv kernel
# --------------------------------------------------------------------------- #
#
# Both recompute P from q, k and the saved log-sum-exp (base 2, +inf where a query sees nothing
# or is padding, so that its P is 0) and take delta = rowsum(dO * O) - d(lse) from XLA. The dq
# kernel is the forward's CTA: two warpgroups of 64 queries and a producer streaming k and v
# blocks along their walk (of 32 keys past head dim 128, so that two are in flight); a step is dP = dO v^T and S = q k^T (issued together, v's slot
# released as soon as dP is in), dS, and dq += dS k. The dk/dv kernel turns it around: two
# warpgroups of 64 keys each (k and v held in shared memory), the producer streaming q, dO, the
# log-sum-exp and delta along the queries that see them, for every query head of the key head's
# group (GQA's sum stays in the accumulators); a step is S^T = k q^T, P^T, then dP^T = v dO^T
# with dv += P^T dO behind it, dS^T once dP^T is in, and dk += dS^T q. Past head dim 128 (64
# keys' dk and dv would take 256 registers a thread) both warpgroups take the same 64 keys and
# each accumulates its half of dk's and dv's columns, computing the whole S^T and dP^T from both
# halves of k, q, v and dO (``head_parts``: 1.5x the dk/dv kernel's tensor work, no exchange
# between warpgroups). Masks walk as the forward's do, from the other side for dk/dv
# (``common.query_blocks``). The products run as JAX's and tokamax's Mosaic GPU backward kernels
# run theirs (read before writing these).


def backward_unsupported(call: Call) -> str | None:
  """Why the Mosaic GPU backward cannot serve a call (the Triton backward then does), or None."""
  if call.bias_shape is not None:
    return "a bias (its gradient is the Triton kernels')"
  return None


def head_parts(head_dim: int) -> int:
  """The dk/dv kernel's split of the head dim: 1 (each compute warpgroup takes 64 keys with the
  whole of dk and dv), or 2 past head dim 128, where 64 keys' dk and dv accumulators would take
  256 registers a thread: both warpgroups then take the same 64 keys, warpgroup w the w-th half
  of dk and dv's columns (and each computes the whole of S^T and dP^T)."""
  return 1 if head_dim <= 128 else 2


def _backward_producer_registers(head_dim: int) -> int:
  """The backward kernels' producer registers (the compute warpgroups take the rest)."""
  return PRODUCER_REGISTERS if head_dim <= 128 else WIDE_PRODUCER_REGISTERS


def _smem(*buffers: int) -> int:
  """Shared memory of scoped buffers of these byte sizes: each starts on a 1024-byte boundary
  (Pallas Mosaic GPU's alignment), and the barriers take at most one more KiB."""
  return sum(round_up(nbytes, 1024) for nbytes in buffers) + 1024


def _dq_bytes(h: int, itemsize: int, segments: bool, block_kv: int, stages: int) -> int:
  tile = 64 * h * itemsize
  buffers = [2 * tile, 2 * tile, 2 * 64 * 4, 2 * 64 * 4,  # q, dO, lse, delta
             stages * block_kv * h * itemsize, stages * block_kv * h * itemsize]  # k, v
  if segments:
    buffers += [2 * 64 * 4, stages * block_kv * 4]
  return _smem(*buffers)


def _dq_stages(h: int, itemsize: int, segments: bool, config: Config) -> int:
  """The dq kernel's ring depth (keys and values alike): ``bwd_stages``, less where it would
  not fit a CTA's shared memory (past head dim 128, 128 queries' q and dO take 128 KiB: rings
  of 64-key blocks hold one block each, of 32-key blocks two or three)."""
  stages = config.bwd_stages
  while (_dq_bytes(h, itemsize, segments, config.bwd_block_kv, stages) > SMEM_BYTES
         and stages > 1):
    stages -= 1
  return stages


def _dkv_bytes(h: int, itemsize: int, segments: bool, config: Config) -> int:
  stages, bq = config.bwd_stages, config.bwd_block_q
  held = 2 * 64 * (h // head_parts(h)) * itemsize  # k or v: two blocks of 64 rows
  ring = stages * bq * h * itemsize  # q or dO
  buffers = [held, held, ring, ring, stages * bq * 4, stages * bq * 4]
  if segments:
    buffers += [2 * 64 * 4, stages * bq * 4]
  return _smem(*buffers)


def _with_accumulators(shapes, scratch, body, interpret):
  """body(*accumulators): zeroed float32 wgmma accumulators of ``shapes``; interpreted (the
  interpreter's wgmma reads no registers), the warpgroup's float32 shared-memory ``scratch``."""
  if interpret:
    for ref in scratch:
      ref[...] = jnp.zeros(ref.shape, jnp.float32)
    return body(*scratch)
  return pl.run_scoped(body, *[plgpu.ACC(shape, jnp.float32) for shape in shapes])


def _mma(acc, a, b_smem, interpret):
  """acc += a @ b (a in registers, b a shared-memory block), issued; :func:`_wait` for it."""
  if interpret:
    acc[...] += lax.dot_general(a, b_smem[...], (((1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)
  else:
    plgpu.wgmma(acc, a, b_smem)


def _wait(in_flight: int, interpret):
  """Waits until at most ``in_flight`` of this warpgroup's wgmma groups still run."""
  if not interpret:
    plgpu.wgmma_wait(in_flight)


def _dot_t(pairs):
  """The sum of a @ b^T over shared-memory blocks (a, b) (the parts of one contraction)."""
  return sum(lax.dot_general(a[...], b[...], (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32) for a, b in pairs)


def _products(groups, interpret, after_first=None):
  """[sum of a @ b^T over (a, b) in group, for each group] (shared-memory blocks: a group's
  pairs are one contraction's parts along the head dim), issued together; ``after_first()``
  runs as soon as the first group's are done."""
  if interpret:
    out = [_dot_t(group) for group in groups]
    if after_first is not None:
      after_first()
    return out

  def products(*accs):
    for acc, group in zip(accs, groups):
      for a, b in group:
        plgpu.wgmma(acc, a, _mosaic_gpu.transposed(b))
    if after_first is not None:
      plgpu.wgmma_wait(sum(len(group) for group in groups[1:]))
      after_first()
    plgpu.wgmma_wait(0)
    return [acc[...] for acc in accs]

  return pl.run_scoped(products, *[
      plgpu.ACC((group[0][0].shape[0], group[0][1].shape[0]), jnp.float32) for group in groups])


def _dp_and_dv(pairs, do_own, p16, dv_acc, interpret):
  """dP^T = v dO^T (``pairs``: its parts, (v, dO) blocks), with dv += P^T dO (dO's columns of
  this warpgroup, ``do_own``) issued behind it: returns dP^T as soon as its own product is done
  (dv's may still run)."""
  if interpret:
    _mma(dv_acc, p16, do_own, interpret)
    return _dot_t(pairs)

  def products(acc):
    for a, b in pairs:
      plgpu.wgmma(acc, a, _mosaic_gpu.transposed(b))
    plgpu.wgmma(dv_acc, p16, do_own)
    return plgpu.wgmma_accumulator_load(acc, wait_n=1)

  return pl.run_scoped(products, plgpu.ACC((pairs[0][0].shape[0], pairs[0][1].shape[0]),
                                           jnp.float32))


def _probabilities(qk, lse2, mask, axis: int, call: Call):
  """(P, tanh or None) of a block from its raw q k^T (or its transpose: the queries along
  ``axis``): P from the saved log-sum-exp in base 2, 0 where ``mask`` hides a score."""
  if call.soft_cap is None:
    th, x, scale2 = None, qk, call.scale * LOG2E
  else:
    th = jnp.tanh(qk * (call.scale / call.soft_cap))
    x, scale2 = th, call.soft_cap * LOG2E
  p = jnp.exp2(x * scale2 - lax.broadcast_in_dim(lse2, qk.shape, [axis]))
  return p if mask is None else jnp.where(mask, p, 0.0), th


def _capped(p, th):
  """P times the cap's derivative (1 - tanh^2), or P without a cap: taken as soon as P is, so
  that one tile (not P and tanh) stays in registers through dP's product."""
  return p if th is None else p * (1.0 - th * th)


def _grad_logits(p_capped, dp, delta, axis: int):
  """dS, the gradient of q k^T before the scale: P (dP - delta), with the cap's derivative."""
  return p_capped * (dp - lax.broadcast_in_dim(delta, p_capped.shape, [axis]))


def _produce(lo, end, stages: int, streams):
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


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, call: Call,
               config: Config, interpret):
  c = config
  if call.segments:
    q_seg_ref, kv_seg_ref, meet_ref, dq_ref = refs
  else:
    (dq_ref,), q_seg_ref, kv_seg_ref, meet_ref = refs, None, None, None
  h, bkv = call.head_dim, c.bwd_block_kv
  stages = _dq_stages(h, jnp.dtype(call.dtype).itemsize, call.segments, c)
  producer_registers = _backward_producer_registers(h)
  # dq's product contracts over the keys: wgmma's K (bkv) is a multiple of the swizzle's lanes
  # (a 64-byte swizzle for 32 keys a step).
  transforms = _mosaic_gpu.swizzled(min(h, bkv), call.dtype)
  extra = {}
  if call.segments:
    extra = dict(q_seg_smem=plgpu.SMEM((2, 64), jnp.int32),
                 kv_seg_smem=plgpu.SMEM((stages, bkv), jnp.int32))
  if interpret:
    extra["scratch"] = plgpu.SMEM((2, 64, h), jnp.float32)
  segs = int(call.segments)

  @functools.partial(
      pl.run_scoped, collective_axes="wg",
      q_smem=plgpu.SMEM((2, 64, h), call.dtype, transforms=transforms),
      do_smem=plgpu.SMEM((2, 64, h), call.dtype, transforms=transforms),
      lse_smem=plgpu.SMEM((2, 64), jnp.float32),
      delta_smem=plgpu.SMEM((2, 64), jnp.float32),
      k_smem=plgpu.SMEM((stages, bkv, h), call.dtype, transforms=transforms),
      v_smem=plgpu.SMEM((stages, bkv, h), call.dtype, transforms=transforms),
      q_full=plgpu.Barrier(num_arrivals=4 + segs, num_barriers=2),
      k_full=plgpu.Barrier(num_arrivals=1 + segs, num_barriers=stages),
      v_full=plgpu.Barrier(num_barriers=stages),
      k_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      v_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      **extra)
  def _scope(q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, q_full, k_full, v_full,
             k_free, v_free, q_seg_smem=None, kv_seg_smem=None, scratch=None):
    b = lax.axis_index("batch")
    n = lax.axis_index("heads")
    tile = lax.axis_size("q") - 1 - lax.axis_index("q")  # the longest causal tiles first
    kh = lax.div(n, jnp.int32(call.group))
    wg = lax.axis_index("wg")
    meet = None if meet_ref is None else (meet_ref[b, tile, 0], meet_ref[b, tile, 1])
    lo, hi, walks = _ring(tile, call.q_len, call.kv_len, bkv, call.window, meet)
    slot_of = lambda j: lax.rem(j - lo, jnp.int32(stages))

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(producer_registers, action="decrease")

      def load_k(j, slot):
        keys = pl.ds(j * bkv, bkv)
        plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kh], k_smem.at[slot], k_full.at[slot])
        if call.segments:
          plgpu.copy_gmem_to_smem(kv_seg_ref.at[b, keys], kv_seg_smem.at[slot],
                                  k_full.at[slot])

      def load_v(j, slot):
        plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(j * bkv, bkv), kh], v_smem.at[slot],
                                v_full.at[slot])

      _produce(lo, hi, stages, [(k_free, load_k), (v_free, load_v)])

    @pl.when(wg < 2)
    def _consumer():
      plgpu.set_max_registers(_mosaic_gpu.consumer_registers(producer_registers),
                              action="increase")
      row0 = tile * 128 + wg * 64
      walk = _Walk(*(jnp.where(wg == 0, x, y) for x, y in zip(*walks)))
      queries = pl.ds(row0, 64)
      q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
      arrive = q_full.at[wg]
      plgpu.copy_gmem_to_smem(q_ref.at[b, queries, n], q_tile, arrive)
      plgpu.copy_gmem_to_smem(do_ref.at[b, queries, n], do_tile, arrive)
      plgpu.copy_gmem_to_smem(lse_ref.at[b, n, queries], lse_smem.at[wg], arrive)
      plgpu.copy_gmem_to_smem(delta_ref.at[b, n, queries], delta_smem.at[wg], arrive)
      if call.segments:
        plgpu.copy_gmem_to_smem(q_seg_ref.at[b, queries], q_seg_smem.at[wg], arrive)
      plgpu.barrier_wait(arrive)
      rows = plgpu.Layout.WGMMA.reduce(1)
      lse2 = _load(lse_smem.at[wg], rows, interpret)
      delta = _load(delta_smem.at[wg], rows, interpret)
      q_seg = _load(q_seg_smem.at[wg], rows, interpret) if call.segments else None

      def idle(j, carry):
        slot = slot_of(j)
        plgpu.barrier_wait(k_full.at[slot])
        plgpu.barrier_wait(v_full.at[slot])
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])
        return carry

      def step(dq_acc, positions: bool):
        def run(j, carry):
          slot = slot_of(j)
          plgpu.barrier_wait(k_full.at[slot])
          plgpu.barrier_wait(v_full.at[slot])
          k_block = k_smem.at[slot]
          # dP's product first: its value slot is released (and refilled) while S's runs.
          dp, qk = _products([[(do_tile, v_smem.at[slot])], [(q_tile, k_block)]], interpret,
                             after_first=lambda: plgpu.barrier_arrive(v_free.at[slot]))
          shape = qk.shape
          mask = None
          if positions or call.segments:
            kv_seg = None
            if call.segments:
              kv_seg = lax.broadcast_in_dim(
                  _load(kv_seg_smem.at[slot], plgpu.Layout.WGMMA.reduce(0), interpret),
                  shape, [1])
            q_pos = row0 + _iota(shape, 0, interpret)
            k_pos = j * bkv + _iota(shape, 1, interpret)
            mask = visible(q_pos, k_pos, call.window if positions else Window(None, None),
                           None if q_seg is None else lax.broadcast_in_dim(q_seg, shape, [0]),
                           kv_seg)
            if positions and call.kv_len % bkv:  # padded keys: their P would not be 0
              end = k_pos < call.kv_len
              mask = end if mask is None else mask & end
          p, th = _probabilities(qk, lse2, mask, 0, call)
          ds = _grad_logits(_capped(p, th), dp, delta, 0)
          _mma(dq_acc, ds.astype(call.dtype), k_block, interpret)
          _wait(0, interpret)
          plgpu.barrier_arrive(k_free.at[slot])
          return carry
        return run

      def accumulate(dq_acc):
        lax.fori_loop(lo, walk.first, idle, None)
        lax.fori_loop(walk.first, walk.full_first, step(dq_acc, True), None)
        lax.fori_loop(walk.full_first, walk.full_end, step(dq_acc, False), None)
        lax.fori_loop(walk.full_end, walk.end, step(dq_acc, True), None)
        lax.fori_loop(walk.end, hi, idle, None)
        _wait(0, interpret)
        return dq_acc[...]

      dq = _with_accumulators([(64, h)], [] if scratch is None else [scratch.at[wg]],
                              accumulate, interpret)
      q_tile[...] = (dq * call.scale).astype(call.dtype)  # q's block is free: every product ran
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[b, queries, n])
      plgpu.wait_smem_to_gmem(0)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, call: Call,
                config: Config, interpret):
  c = config
  if call.segments:
    q_seg_ref, kv_seg_ref, meet_ref, dk_ref, dv_ref = refs
  else:
    (dk_ref, dv_ref), q_seg_ref, kv_seg_ref, meet_ref = refs, None, None, None
  h, bq, stages = call.head_dim, c.bwd_block_q, c.bwd_stages
  parts = head_parts(h)
  part = h // parts
  producer_registers = _backward_producer_registers(h)

  def in_part(ref, i):
    """Columns [i part, (i + 1) part) of a gmem block of whole head-dim rows."""
    return ref if parts == 1 else ref.at[..., pl.ds(i * part, part)]

  transforms = _mosaic_gpu.swizzled(part, call.dtype)
  extra = {}
  if call.segments:
    extra = dict(kv_seg_smem=plgpu.SMEM((2, 64), jnp.int32),
                 q_seg_smem=plgpu.SMEM((stages, bq), jnp.int32))
  if interpret:
    extra["scratch"] = plgpu.SMEM((2, 2, 64, part), jnp.float32)
  if parts > 1:
    extra["done"] = plgpu.Barrier(num_arrivals=2)
  segs = int(call.segments)

  # k and v: two blocks of 64 keys (one a warpgroup), or the two head-dim halves of one
  # block. q and dO: a ring of blocks of bq queries, each in its head-dim parts.
  @functools.partial(
      pl.run_scoped, collective_axes="wg",
      k_smem=plgpu.SMEM((2, 64, part), call.dtype, transforms=transforms),
      v_smem=plgpu.SMEM((2, 64, part), call.dtype, transforms=transforms),
      q_smem=plgpu.SMEM((stages, parts, bq, part), call.dtype, transforms=transforms),
      do_smem=plgpu.SMEM((stages, parts, bq, part), call.dtype, transforms=transforms),
      lse_smem=plgpu.SMEM((stages, bq), jnp.float32),
      delta_smem=plgpu.SMEM((stages, bq), jnp.float32),
      kv_full=plgpu.Barrier(num_arrivals=2 + segs, num_barriers=2),
      q_full=plgpu.Barrier(num_arrivals=parts + 1 + segs, num_barriers=stages),
      do_full=plgpu.Barrier(num_arrivals=parts + 1, num_barriers=stages),
      q_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      do_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      **extra)
  def _scope(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_full, q_full, do_full,
             q_free, do_free, kv_seg_smem=None, q_seg_smem=None, scratch=None, done=None):
    b = lax.axis_index("batch")
    kh = lax.axis_index("heads")
    tile = lax.axis_index("kv")  # under a causal mask the first key tiles see the most queries
    wg = lax.axis_index("wg")
    meet = None if meet_ref is None else (meet_ref[b, tile, 0], meet_ref[b, tile, 1])
    # The keys' side of the window: query i sees key j iff j - right <= i <= j + left.
    lo, hi, walks = _ring(tile, call.kv_len, call.q_len, bq,
                          Window(call.window.right, call.window.left), meet,
                          shared=parts > 1)
    span = hi - lo
    # Steps run over the group's query heads, each over the query blocks [lo, hi).
    slot_of = lambda step: lax.rem(step, jnp.int32(stages))

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(producer_registers, action="decrease")

      def block(step):
        g = lax.div(step, jnp.maximum(span, 1))
        return kh * call.group + g, pl.ds((lo + step - g * span) * bq, bq)

      def load_q(step, slot):
        n, queries = block(step)
        arrive = q_full.at[slot]
        for i in range(parts):
          plgpu.copy_gmem_to_smem(in_part(q_ref.at[b, queries, n], i), q_smem.at[slot, i],
                                  arrive)
        plgpu.copy_gmem_to_smem(lse_ref.at[b, n, queries], lse_smem.at[slot], arrive)
        if call.segments:
          plgpu.copy_gmem_to_smem(q_seg_ref.at[b, queries], q_seg_smem.at[slot], arrive)

      def load_do(step, slot):
        n, queries = block(step)
        arrive = do_full.at[slot]
        for i in range(parts):
          plgpu.copy_gmem_to_smem(in_part(do_ref.at[b, queries, n], i), do_smem.at[slot, i],
                                  arrive)
        plgpu.copy_gmem_to_smem(delta_ref.at[b, n, queries], delta_smem.at[slot], arrive)

      _produce(jnp.int32(0), call.group * span, stages, [(q_free, load_q), (do_free, load_do)])

    @pl.when(wg < 2)
    def _consumer():
      plgpu.set_max_registers(_mosaic_gpu.consumer_registers(producer_registers),
                              action="increase")
      row0 = tile * 128 + wg * 64 if parts == 1 else tile * 64
      walk = _Walk(*(jnp.where(wg == 0, x, y) for x, y in zip(*walks)))
      keys = pl.ds(row0, 64)
      # Each warpgroup loads its block of k and v (its keys, or its half of the head dim).
      arrive = kv_full.at[wg]
      plgpu.copy_gmem_to_smem(in_part(k_ref.at[b, keys, kh], wg), k_smem.at[wg], arrive)
      plgpu.copy_gmem_to_smem(in_part(v_ref.at[b, keys, kh], wg), v_smem.at[wg], arrive)
      if call.segments:
        plgpu.copy_gmem_to_smem(kv_seg_ref.at[b, keys], kv_seg_smem.at[wg], arrive)
      if parts == 1:
        k_parts, v_parts = [k_smem.at[wg]], [v_smem.at[wg]]
        plgpu.barrier_wait(arrive)
      else:  # S^T and dP^T contract over both halves
        k_parts, v_parts = [k_smem.at[0], k_smem.at[1]], [v_smem.at[0], v_smem.at[1]]
        plgpu.barrier_wait(kv_full.at[0])
        plgpu.barrier_wait(kv_full.at[1])
      own = wg if parts > 1 else 0  # this warpgroup's columns of dk and dv, q and dO
      kv_seg = None
      if call.segments:
        kv_seg = _load(kv_seg_smem.at[wg], plgpu.Layout.WGMMA.reduce(1), interpret)
      cols = plgpu.Layout.WGMMA.reduce(0)  # a vector along the queries

      def idle(base):
        def run(i, carry):
          slot = slot_of(base + i)
          plgpu.barrier_wait(q_full.at[slot])
          plgpu.barrier_wait(do_full.at[slot])
          plgpu.barrier_arrive(q_free.at[slot])
          plgpu.barrier_arrive(do_free.at[slot])
          return carry
        return run

      def step(base, dk_acc, dv_acc, positions: bool):
        def run(i, carry):
          slot = slot_of(base + i)
          q_parts = [q_smem.at[slot, p] for p in range(parts)]
          do_parts = [do_smem.at[slot, p] for p in range(parts)]
          plgpu.barrier_wait(q_full.at[slot])
          (kq,) = _products([list(zip(k_parts, q_parts))], interpret)
          shape = kq.shape
          lse2 = _load(lse_smem.at[slot], cols, interpret)
          mask = None
          if positions or call.segments:
            q_seg = None
            if call.segments:
              q_seg = lax.broadcast_in_dim(_load(q_seg_smem.at[slot], cols, interpret),
                                           shape, [1])
            k_pos = row0 + _iota(shape, 0, interpret)
            q_pos = i * bq + _iota(shape, 1, interpret)
            mask = visible(q_pos, k_pos, call.window if positions else Window(None, None),
                           q_seg, None if kv_seg is None else
                           lax.broadcast_in_dim(kv_seg, shape, [0]))
          plgpu.barrier_wait(do_full.at[slot])
          delta = _load(delta_smem.at[slot], cols, interpret)
          p, th = _probabilities(kq, lse2, mask, 1, call)
          p16, p = p.astype(call.dtype), _capped(p, th)
          # dv's product is issued behind dP^T's, and runs on while dS^T is computed.
          dp = _dp_and_dv(list(zip(v_parts, do_parts)), do_smem.at[slot, own], p16, dv_acc,
                          interpret)
          ds = _grad_logits(p, dp, delta, 1)
          _mma(dk_acc, ds.astype(call.dtype), q_smem.at[slot, own], interpret)
          _wait(1, interpret)  # dv's product is done: dO's slot is free
          plgpu.barrier_arrive(do_free.at[slot])
          _wait(0, interpret)
          plgpu.barrier_arrive(q_free.at[slot])
          return carry
        return run

      def accumulate(dk_acc, dv_acc):
        def head(g, carry):
          base = g * span - lo  # the step of query block i is base + i
          lax.fori_loop(lo, walk.first, idle(base), None)
          lax.fori_loop(walk.first, walk.full_first, step(base, dk_acc, dv_acc, True), None)
          lax.fori_loop(walk.full_first, walk.full_end, step(base, dk_acc, dv_acc, False),
                        None)
          lax.fori_loop(walk.full_end, walk.end, step(base, dk_acc, dv_acc, True), None)
          lax.fori_loop(walk.end, hi, idle(base), None)
          return carry

        lax.fori_loop(0, call.group, head, None)
        _wait(0, interpret)
        return dk_acc[...], dv_acc[...]

      scratch_ = [] if scratch is None else [scratch.at[0, wg], scratch.at[1, wg]]
      dk, dv = _with_accumulators([(64, part), (64, part)], scratch_, accumulate, interpret)
      if done is not None:  # the other warpgroup's products may still read this one's halves
        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)
      k_tile, v_tile = k_smem.at[wg], v_smem.at[wg]
      k_tile[...] = (dk * call.scale).astype(call.dtype)  # every product has run
      v_tile[...] = dv.astype(call.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(k_tile, in_part(dk_ref.at[b, keys, kh], wg))
      plgpu.copy_smem_to_gmem(v_tile, in_part(dv_ref.at[b, keys, kh], wg))
      plgpu.wait_smem_to_gmem(0)


def backward(q, k, v, bias, q_seg, kv_seg, out, lse, dout, dlse, *, window: Window,
             scale: float, soft_cap: float | None, config: Config, interpret=False):
  """(dq, dk, dv, dbias or None) from the saved output and log-sum-exp: the Mosaic GPU dq and
  dk/dv kernels, or where they do not serve the call (:func:`backward_unsupported`) the Triton
  kernels' backward with ``config.backward`` (None: the Triton heuristic's)."""
  call = Call.of(q, k, bias, q_seg, window=window, scale=scale, soft_cap=soft_cap)
  if backward_unsupported(call) is not None:
    bwd = config.backward
    if bwd is None:
      shape = types.SimpleNamespace(head_dim=q.shape[-1], q_len=q.shape[1], kv_len=k.shape[1])
      bwd = triton.heuristic(shape, hardware.DEFAULT_GPU)
    return triton.backward(q, k, v, bias, q_seg, kv_seg, out, lse, dout, dlse, window=window,
                           scale=scale, soft_cap=soft_cap, config=bwd,
                           interpret=bool(interpret))
  c = config
  b, t, n, h = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  # Whole tiles of 2 x 64 rows on both sides (TMA reads rows in swizzle tiles of 8, and no copy
  # may run past an array). The padded queries get P = 0 (their lse is +inf); the padded keys
  # are masked in the dq kernel and their dk and dv rows dropped.
  t_pad, s_pad = round_up(t, 128), round_up(s, 128)
  length = lambda x, to: pad_to(x, (x.shape[0], to, *x.shape[2:]))
  delta = jnp.einsum("btnh,btnh->bnt", dout.astype(jnp.float32), out.astype(jnp.float32))
  if dlse is not None:
    delta = delta - jnp.swapaxes(dlse.astype(jnp.float32), 1, 2)
  lse2 = jnp.swapaxes(lse, 1, 2) * LOG2E
  lse2 = jnp.where(lse2 == -jnp.inf, jnp.inf, lse2)  # a query that sees nothing: P = 0
  stats = lambda x, fill: jnp.pad(x, ((0, 0), (0, 0), (0, t_pad - t)), constant_values=fill)
  operands = [length(q, t_pad), length(k, s_pad), length(v, s_pad), length(dout, t_pad),
              stats(lse2, jnp.inf), stats(delta, 0.0)]
  dq_extra = dkv_extra = []
  if call.segments:
    edge = lambda x, to: jnp.pad(x.astype(jnp.int32), ((0, 0), (0, to - x.shape[1])),
                                 mode="edge")
    q_seg, kv_seg = edge(q_seg, t_pad), edge(kv_seg, s_pad)
    dq_extra = [q_seg, kv_seg, _meeting_blocks(q_seg, kv_seg, 128, c.bwd_block_kv)]
    dkv_extra = [q_seg, kv_seg, _meeting_blocks(kv_seg, q_seg, 128 // head_parts(h), c.bwd_block_q)]
  params = dict(
      num_threads=3, thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True),
      **({"interpret": interpret} if interpret else {}))
  dq = plgpu.kernel(
      _named("jk_attention_dq_mgpu", _dq_kernel, call=call, config=c, interpret=bool(interpret)),
      out_type=jax.ShapeDtypeStruct((b, t_pad, n, h), q.dtype),
      grid=(n, t_pad // 128, b), grid_names=("heads", "q", "batch"), **params,
  )(*operands, *dq_extra)
  dk, dv = plgpu.kernel(
      _named("jk_attention_dkdv_mgpu", _dkv_kernel, call=call, config=c,
             interpret=bool(interpret)),
      out_type=[jax.ShapeDtypeStruct((b, s_pad, kv_heads, h), k.dtype)] * 2,
      grid=(kv_heads, s_pad // (128 // head_parts(h)), b), grid_names=("heads", "kv", "batch"),
      **params,
  )(*operands, *dkv_extra)
  return dq[:, :t], dk[:, :s], dv[:, :s], None
