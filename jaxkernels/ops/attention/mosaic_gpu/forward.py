"""The forward kernel: FlashAttention-3's schedule (the package's docstring tells it)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkernels import _mosaic_gpu
from jaxkernels._activations import LN2, LOG2E
from jaxkernels._mosaic_gpu import iota, layout_cast, load_block
from jaxkernels._online_softmax import finite
from jaxkernels._tiling import cdiv, pad_to, round_up
from jaxkernels.ops.attention.common import Call, Window, visible
from jaxkernels.ops.attention.mosaic_gpu.config import (PRODUCER_REGISTERS, Config,
                                                        bias_in_ring, pad_head)
from jaxkernels.ops.attention.mosaic_gpu.schedule import (CONSUMERS, WARPGROUPS, Walk, bias_at,
                                                          bias_tile, is_consumer, is_producer,
                                                          meeting_blocks, named, ring)


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
  in_ring = bias_ref is not None and bias_in_ring(call.head_dim)
  k_copies = q_copies + in_ring
  if in_ring:  # the CTA's (2 block_q, block_kv) bias tile, a stage
    extra_buffers["bias_smem"] = plgpu.SMEM(
        (c.stages, 2 * c.block_q, c.block_kv), bias_ref.dtype,
        transforms=_mosaic_gpu.swizzled(c.block_kv, bias_ref.dtype))
  elif bias_ref is not None:  # each compute warpgroup's own (block_q, block_kv) tile
    extra_buffers["bias_smem"] = plgpu.SMEM(
        (CONSUMERS, c.block_q, c.block_kv), bias_ref.dtype,
        transforms=_mosaic_gpu.swizzled(c.block_kv, bias_ref.dtype))
    extra_buffers["bias_full"] = plgpu.Barrier(num_barriers=CONSUMERS)

  @functools.partial(
      pl.run_scoped, collective_axes="wg",
      q_smem=plgpu.SMEM((2, c.block_q, call.head_dim), call.dtype, transforms=transforms),
      k_smem=plgpu.SMEM((c.stages, c.block_kv, call.head_dim), call.dtype,
                        transforms=transforms),
      v_smem=plgpu.SMEM((c.stages, c.block_kv, call.head_dim), call.dtype,
                        transforms=transforms),
      lse_smem=plgpu.SMEM((2, c.block_q), jnp.float32),
      q_full=plgpu.Barrier(num_arrivals=q_copies, num_barriers=CONSUMERS),
      k_full=plgpu.Barrier(num_arrivals=k_copies, num_barriers=c.stages),
      v_full=plgpu.Barrier(num_barriers=c.stages),
      k_free=plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=c.stages),
      v_free=plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=c.stages),
      turn=plgpu.Barrier(num_arrivals=CONSUMERS),
      **extra_buffers)
  def _scope(**s):
    _body(q_ref, k_ref, v_ref, bias_ref, q_seg_ref, kv_seg_ref, meet_ref, o_ref, lse_ref,
          call=call, config=c, interpret=interpret, **s)


def _body(q_ref, k_ref, v_ref, bias_ref, q_seg_ref, kv_seg_ref, meet_ref, o_ref, lse_ref, *,
          call: Call, config: Config, interpret, q_smem, k_smem, v_smem, lse_smem, q_full,
          k_full, v_full, k_free, v_free, turn, q_seg_smem=None, kv_seg_smem=None,
          bias_smem=None, bias_full=None):
  c = config
  b = lax.axis_index("batch")
  n = lax.axis_index("heads")
  # Query tiles in reverse: under a causal mask the last ones have the most keys, and the
  # longest CTAs should start first.
  tile = lax.axis_size("q") - 1 - lax.axis_index("q")
  kh = lax.div(n, jnp.int32(call.group))
  wg = lax.axis_index("wg")
  meet = None if meet_ref is None else (meet_ref[b, tile, 0], meet_ref[b, tile, 1])
  lo, hi, walks = ring(tile, call.q_len, call.kv_len, c.block_kv, call.window, meet)
  slot_of = lambda j: lax.rem(j - lo, jnp.int32(c.stages))

  def rendezvous():
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)

  @pl.when(is_producer(wg))
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
      if bias_ref is not None and bias_full is None:  # the bias rides k's ring
        rows = pl.ds(tile * 2 * c.block_q, 2 * c.block_q)
        plgpu.copy_gmem_to_smem(bias_ref.at[bias_at(call, b, n) + (rows, keys)],
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

  @pl.when(is_consumer(wg))
  def _consumer():
    plgpu.set_max_registers(_mosaic_gpu.consumer_registers(PRODUCER_REGISTERS),
                            action="increase")
    row0 = tile * 2 * c.block_q + wg * c.block_q
    walk = Walk(*(jnp.where(wg == 0, a, b_) for a, b_ in zip(*walks)))
    queries = pl.ds(row0, c.block_q)
    q_tile = q_smem.at[wg]

    plgpu.copy_gmem_to_smem(q_ref.at[b, queries, n], q_tile, q_full.at[wg])
    if call.segments:
      plgpu.copy_gmem_to_smem(q_seg_ref.at[b, queries], q_seg_smem.at[wg], q_full.at[wg])
    plgpu.barrier_wait(q_full.at[wg])

    q_seg = None
    if call.segments:
      q_seg = load_block(q_seg_smem.at[wg], plgpu.Layout.WGMMA.reduce(1), interpret)

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

    def load_bias(j):
      """The bias tile of step j into this warpgroup's buffer (on its own barrier)."""
      plgpu.copy_gmem_to_smem(
          bias_ref.at[bias_at(call, b, n) + (queries, pl.ds(j * c.block_kv, c.block_kv))],
          bias_smem.at[wg], bias_full.at[wg])

    def read_bias(j):
      """Step j's bias tile in registers (base 2). From k's ring slot, or from this
      warpgroup's own buffer, whose next tile (step j + 1's) is then loaded at once: it has
      the rest of the step to arrive."""
      if bias_full is None:
        tile_ = bias_smem.at[slot_of(j), pl.ds(wg * c.block_q, c.block_q)]
      else:
        tile_ = bias_smem.at[wg]
        plgpu.barrier_wait(bias_full.at[wg])
      bias = bias_tile(tile_, interpret)
      if bias_full is not None:
        # Every thread of the warpgroup has read the buffer (a warpgroup barrier, with the
        # fence that orders its reads before the bulk copy's writes) before it is refilled.
        plgpu.commit_smem()
        pl.when(j + 1 < walk.end)(lambda: load_bias(j + 1))
      return bias

    def step(positions: bool):
      def run(j, carry):
        bias = None if bias_smem is None else functools.partial(read_bias, j)
        return _step(j, carry, slot_of(j), row0, q_tile, q_seg, bias, positions, call=call,
                     config=c, interpret=interpret, next_keys=functools.partial(next_keys, j),
                     k_smem=k_smem, v_smem=v_smem, kv_seg_smem=kv_seg_smem, v_full=v_full,
                     k_free=k_free, v_free=v_free, turn=turn)
      return run

    rows = plgpu.Layout.WGMMA.reduce(1)
    acc = layout_cast(jnp.zeros((c.block_q, call.head_dim), jnp.float32), plgpu.Layout.WGMMA,
                interpret)
    peak = layout_cast(jnp.full((c.block_q,), -jnp.inf, jnp.float32), rows, interpret)
    total = layout_cast(jnp.zeros((c.block_q,), jnp.float32), rows, interpret)
    carry = (acc, peak, total)
    pl.when(wg == 1)(rendezvous)  # warpgroup 1 runs half a step behind warpgroup 0

    @pl.when(lo < hi)
    def _():
      plgpu.barrier_wait(k_full.at[slot_of(lo)])

    if bias_full is not None:  # the first step's bias tile
      pl.when(walk.first < walk.end)(lambda: load_bias(walk.first))
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


def scores(q_smem, k_smem, then, interpret):
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


def accumulate(acc, a, b_smem, then, interpret):
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
  ``positions`` the window's mask (and the keys' end), with segments theirs; ``bias``: None,
  or what reads the block's bias tile into registers (before the slot is released)."""
  c = config
  acc, peak, total = carry
  shape = (c.block_q, c.block_kv)

  def turn_over():  # the other warpgroup may take the tensor cores
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)

  qk = scores(q_tile, k_smem.at[slot], turn_over, interpret)
  mask = None
  if positions or call.segments:
    kv_seg = None
    if call.segments:
      kv_seg = lax.broadcast_in_dim(
          load_block(kv_seg_smem.at[slot], plgpu.Layout.WGMMA.reduce(0), interpret), shape, [1])
    rows = row0 + iota(shape, 0, interpret)
    cols = j * c.block_kv + iota(shape, 1, interpret)
    mask = visible(rows, cols, call.window if positions else Window(None, None),
                   None if q_seg is None else lax.broadcast_in_dim(q_seg, shape, [0]), kv_seg)
    if positions and call.kv_len % c.block_kv:
      end = cols < call.kv_len
      mask = end if mask is None else mask & end
  if bias is not None:  # read before the slot is released
    bias = bias()
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
  acc = accumulate(acc, p16, v_smem.at[slot], next_keys, interpret)
  plgpu.barrier_arrive(v_free.at[slot])
  return acc, new_peak, total


def _reduction_scratch(call: Call) -> dict:
  """The kernel's reductions are along the rows of WGMMA tiles (a warp's shuffles), so the
  cross-warp scratch Mosaic GPU sets aside (2 KiB) goes unused; where a bias tile sits beside
  head dim 256's q, k and v (float32: 104 bytes over a CTA with the scratch), none is taken.
  Elsewhere the default, as measured."""
  if call.bias_shape is not None and not bias_in_ring(call.head_dim):
    return {"reduction_scratch_bytes": 0}
  return {}


def forward(q, k, v, bias, q_seg, kv_seg, *, window: Window, scale: float,
            soft_cap: float | None, config: Config, interpret=False):
  """(out (B, T, N, H) in q's dtype, lse (B, T, N) float32, natural log; -inf for a query
  that sees no key)."""
  head = q.shape[-1]
  q, k, v = (pad_head(x) for x in (q, k, v))
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
    operands += [q_seg, kv_seg, meeting_blocks(q_seg, kv_seg, 2 * c.block_q, c.block_kv)]
  out, lse = plgpu.kernel(
      named("jk_attention_fwd_mgpu", _kernel, call=call, config=c, interpret=bool(interpret)),
      out_type=[jax.ShapeDtypeStruct((b, t_pad, n, h), q.dtype),
                jax.ShapeDtypeStruct((b, n, t_pad), jnp.float32)],
      grid=(n, tiles, b),
      grid_names=("heads", "q", "batch"),
      num_threads=WARPGROUPS,
      thread_name="wg",
      # ex2.approx and tanh.approx on the SFU, as the Triton kernel's; 1/l and log once a row.
      compiler_params=plgpu.CompilerParams(approx_math=True, **_reduction_scratch(call)),
      **({"interpret": interpret} if interpret else {}),
  )(*operands)
  return out[:, :t, :, :head], jnp.swapaxes(lse[:, :, :t], 1, 2)
