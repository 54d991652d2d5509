"""The backward: a dq kernel and a dk/dv kernel of the forward's make.

Both recompute P from q, k and the saved log-sum-exp (base 2, +inf where a query sees nothing
or is padding, so that its P is 0) and take delta = rowsum(dO * O) - d(lse) from XLA. The dq
kernel is the forward's CTA: two warpgroups of 64 queries and a producer streaming k and v
blocks along their walk (of 32 keys past head dim 128, so that two are in flight); a step is dP
= dO v^T and S = q k^T (issued together, v's slot released as soon as dP is in), dS, and dq +=
dS k. The dk/dv kernel turns it around: two warpgroups of 64 keys each (k and v held in shared
memory), the producer streaming q, dO, the log-sum-exp and delta along the queries that see
them, for every query head of the key head's group (GQA's sum stays in the accumulators); a
step is S^T = k q^T, P^T, then dP^T = v dO^T with dv += P^T dO behind it, dS^T once dP^T is in,
and dk += dS^T q. Past head dim 128 (64 keys' dk and dv would take 256 registers a thread) both
warpgroups take the same 64 keys and each accumulates its half of dk's and dv's columns,
computing the whole S^T and dP^T from both halves of k, q, v and dO (``head_parts``: 1.5x the
dk/dv kernel's tensor work, no exchange between warpgroups). Masks walk as the forward's do,
from the other side for dk/dv (``common.query_blocks``). A bias comes with k's blocks to the
dq kernel and with q's to the dk/dv kernel, from a transposed copy XLA makes (a tile in
registers has the keys as rows there); its gradient is the ``dbias`` kernel's. The products
run as JAX's and tokamax's Mosaic GPU backward kernels run theirs (read before writing these).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkernels import _mosaic_gpu
from jaxkernels._mosaic_gpu import accumulators, iota, load_block, mma, mma_wait
from jaxkernels._tiling import pad_to, round_up
from jaxkernels.ops.attention.common import Call, Window, visible
from jaxkernels.ops.attention.mosaic_gpu import dbias as dbias_kernel
from jaxkernels.ops.attention.mosaic_gpu.config import (Config, backward_producer_registers,
                                                        dkv_stages, dq_stages, head_parts,
                                                        pad_head)
from jaxkernels.ops.attention.mosaic_gpu.schedule import (CONSUMERS, LOG2E, WARPGROUPS, Walk,
                                                          bias_at, bias_tile, capped, dot_t,
                                                          grad_logits,
                                                          is_consumer, is_producer, itemsize,
                                                          meeting_blocks, named, probabilities,
                                                          produce, ring)


def _products(groups, interpret, after_first=None):
  """[sum of a @ b^T over (a, b) in group, for each group] (shared-memory blocks: a group's
  pairs are one contraction's parts along the head dim), issued together; ``after_first()``
  runs as soon as the first group's are done."""
  if interpret:
    out = [dot_t(group) for group in groups]
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
    mma(dv_acc, p16, do_own, interpret)
    return dot_t(pairs)

  def products(acc):
    for a, b in pairs:
      plgpu.wgmma(acc, a, _mosaic_gpu.transposed(b))
    plgpu.wgmma(dv_acc, p16, do_own)
    return plgpu.wgmma_accumulator_load(acc, wait_n=1)

  return pl.run_scoped(products, plgpu.ACC((pairs[0][0].shape[0], pairs[0][1].shape[0]),
                                           jnp.float32))


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, call: Call,
               config: Config, interpret):
  c = config
  refs = list(refs)
  bias_ref = refs.pop(0) if call.bias_shape is not None else None
  if call.segments:
    q_seg_ref, kv_seg_ref, meet_ref, dq_ref = refs
  else:
    (dq_ref,), q_seg_ref, kv_seg_ref, meet_ref = refs, None, None, None
  h, bkv = call.head_dim, c.bwd_block_kv
  stages = dq_stages(h, jnp.dtype(call.dtype).itemsize, call.segments, c,
                     itemsize(bias_ref))
  producer_registers = backward_producer_registers(h)
  # dq's product contracts over the keys: wgmma's K (bkv) is a multiple of the swizzle's lanes
  # (a 64-byte swizzle for 32 keys a step).
  transforms = _mosaic_gpu.swizzled(min(h, bkv), call.dtype)
  extra = {}
  if call.segments:
    extra = dict(q_seg_smem=plgpu.SMEM((2, 64), jnp.int32),
                 kv_seg_smem=plgpu.SMEM((stages, bkv), jnp.int32))
  if bias_ref is not None:  # the CTA's (128 queries, bkv keys) bias tile a stage
    extra["bias_smem"] = plgpu.SMEM((stages, 128, bkv), bias_ref.dtype,
                                    transforms=_mosaic_gpu.swizzled(bkv, bias_ref.dtype))
  if interpret:
    extra["scratch"] = plgpu.SMEM((2, 64, h), jnp.float32)
  segs = int(call.segments)
  k_copies = 1 + segs + (bias_ref is not None)

  @functools.partial(
      pl.run_scoped, collective_axes="wg",
      q_smem=plgpu.SMEM((2, 64, h), call.dtype, transforms=transforms),
      do_smem=plgpu.SMEM((2, 64, h), call.dtype, transforms=transforms),
      lse_smem=plgpu.SMEM((2, 64), jnp.float32),
      delta_smem=plgpu.SMEM((2, 64), jnp.float32),
      k_smem=plgpu.SMEM((stages, bkv, h), call.dtype, transforms=transforms),
      v_smem=plgpu.SMEM((stages, bkv, h), call.dtype, transforms=transforms),
      q_full=plgpu.Barrier(num_arrivals=4 + segs, num_barriers=CONSUMERS),
      k_full=plgpu.Barrier(num_arrivals=k_copies, num_barriers=stages),
      v_full=plgpu.Barrier(num_barriers=stages),
      k_free=plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
      v_free=plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
      **extra)
  def _scope(q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, q_full, k_full, v_full,
             k_free, v_free, q_seg_smem=None, kv_seg_smem=None, bias_smem=None, scratch=None):
    b = lax.axis_index("batch")
    n = lax.axis_index("heads")
    tile = lax.axis_size("q") - 1 - lax.axis_index("q")  # the longest causal tiles first
    kh = lax.div(n, jnp.int32(call.group))
    wg = lax.axis_index("wg")
    meet = None if meet_ref is None else (meet_ref[b, tile, 0], meet_ref[b, tile, 1])
    lo, hi, walks = ring(tile, call.q_len, call.kv_len, bkv, call.window, meet)
    slot_of = lambda j: lax.rem(j - lo, jnp.int32(stages))

    @pl.when(is_producer(wg))
    def _producer():
      plgpu.set_max_registers(producer_registers, action="decrease")

      def load_k(j, slot):
        keys = pl.ds(j * bkv, bkv)
        plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kh], k_smem.at[slot], k_full.at[slot])
        if call.segments:
          plgpu.copy_gmem_to_smem(kv_seg_ref.at[b, keys], kv_seg_smem.at[slot],
                                  k_full.at[slot])
        if bias_ref is not None:
          plgpu.copy_gmem_to_smem(bias_ref.at[bias_at(call, b, n) + (pl.ds(tile * 128, 128), keys)],
                                  bias_smem.at[slot], k_full.at[slot])

      def load_v(j, slot):
        plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(j * bkv, bkv), kh], v_smem.at[slot],
                                v_full.at[slot])

      produce(lo, hi, stages, [(k_free, load_k), (v_free, load_v)])

    @pl.when(is_consumer(wg))
    def _consumer():
      plgpu.set_max_registers(_mosaic_gpu.consumer_registers(producer_registers),
                              action="increase")
      row0 = tile * 128 + wg * 64
      walk = Walk(*(jnp.where(wg == 0, x, y) for x, y in zip(*walks)))
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
      lse2 = load_block(lse_smem.at[wg], rows, interpret)
      delta = load_block(delta_smem.at[wg], rows, interpret)
      q_seg = load_block(q_seg_smem.at[wg], rows, interpret) if call.segments else None

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
          bias2 = None
          if bias_smem is not None:  # read before k's slot (and the bias's) is released
            bias2 = bias_tile(bias_smem.at[slot, pl.ds(wg * 64, 64)], interpret)
          mask = None
          if positions or call.segments:
            kv_seg = None
            if call.segments:
              kv_seg = lax.broadcast_in_dim(
                  load_block(kv_seg_smem.at[slot], plgpu.Layout.WGMMA.reduce(0), interpret),
                  shape, [1])
            q_pos = row0 + iota(shape, 0, interpret)
            k_pos = j * bkv + iota(shape, 1, interpret)
            mask = visible(q_pos, k_pos, call.window if positions else Window(None, None),
                           None if q_seg is None else lax.broadcast_in_dim(q_seg, shape, [0]),
                           kv_seg)
            if positions and call.kv_len % bkv:  # padded keys: their P would not be 0
              end = k_pos < call.kv_len
              mask = end if mask is None else mask & end
          p, th = probabilities(qk, lse2, mask, 0, call, bias2)
          ds = grad_logits(capped(p, th), dp, delta, 0)
          mma(dq_acc, ds.astype(call.dtype), k_block, interpret)
          mma_wait(0, interpret)
          plgpu.barrier_arrive(k_free.at[slot])
          return carry
        return run

      def accumulate(dq_acc):
        lax.fori_loop(lo, walk.first, idle, None)
        lax.fori_loop(walk.first, walk.full_first, step(dq_acc, True), None)
        lax.fori_loop(walk.full_first, walk.full_end, step(dq_acc, False), None)
        lax.fori_loop(walk.full_end, walk.end, step(dq_acc, True), None)
        lax.fori_loop(walk.end, hi, idle, None)
        mma_wait(0, interpret)
        return dq_acc[...]

      dq = accumulators([(64, h)], [] if scratch is None else [scratch.at[wg]],
                              accumulate, interpret)
      q_tile[...] = (dq * call.scale).astype(call.dtype)  # q's block is free: every product ran
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[b, queries, n])
      plgpu.wait_smem_to_gmem(0)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, call: Call,
                config: Config, interpret):
  c = config
  refs = list(refs)
  bias_ref = refs.pop(0) if call.bias_shape is not None else None  # transposed: (.., S, T)
  if call.segments:
    q_seg_ref, kv_seg_ref, meet_ref, dk_ref, dv_ref = refs
  else:
    (dk_ref, dv_ref), q_seg_ref, kv_seg_ref, meet_ref = refs, None, None, None
  h, bq = call.head_dim, c.bwd_block_q
  stages = dkv_stages(h, jnp.dtype(call.dtype).itemsize, call.segments, c, itemsize(bias_ref))
  parts = head_parts(h)
  part = h // parts
  held_keys = 128 // parts  # the CTA's keys
  producer_registers = backward_producer_registers(h)

  def in_part(ref, i):
    """Columns [i part, (i + 1) part) of a gmem block of whole head-dim rows."""
    return ref if parts == 1 else ref.at[..., pl.ds(i * part, part)]

  transforms = _mosaic_gpu.swizzled(part, call.dtype)
  extra = {}
  if call.segments:
    extra = dict(kv_seg_smem=plgpu.SMEM((2, 64), jnp.int32),
                 q_seg_smem=plgpu.SMEM((stages, bq), jnp.int32))
  if bias_ref is not None:  # the CTA's (keys, bq queries) tile of the transposed bias a stage
    extra["bias_smem"] = plgpu.SMEM((stages, held_keys, bq), bias_ref.dtype,
                                    transforms=_mosaic_gpu.swizzled(bq, bias_ref.dtype))
  if interpret:
    extra["scratch"] = plgpu.SMEM((2, 2, 64, part), jnp.float32)
  if parts > 1:
    extra["done"] = plgpu.Barrier(num_arrivals=CONSUMERS)
  segs = int(call.segments)
  q_copies = parts + 1 + segs + (bias_ref is not None)

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
      kv_full=plgpu.Barrier(num_arrivals=2 + segs, num_barriers=CONSUMERS),
      q_full=plgpu.Barrier(num_arrivals=q_copies, num_barriers=stages),
      do_full=plgpu.Barrier(num_arrivals=parts + 1, num_barriers=stages),
      q_free=plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
      do_free=plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
      **extra)
  def _scope(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_full, q_full, do_full,
             q_free, do_free, kv_seg_smem=None, q_seg_smem=None, bias_smem=None, scratch=None,
             done=None):
    b = lax.axis_index("batch")
    kh = lax.axis_index("heads")
    tile = lax.axis_index("kv")  # under a causal mask the first key tiles see the most queries
    wg = lax.axis_index("wg")
    meet = None if meet_ref is None else (meet_ref[b, tile, 0], meet_ref[b, tile, 1])
    # The keys' side of the window: query i sees key j iff j - right <= i <= j + left.
    lo, hi, walks = ring(tile, call.kv_len, call.q_len, bq,
                          Window(call.window.right, call.window.left), meet,
                          shared=parts > 1)
    span = hi - lo
    # Steps run over the group's query heads, each over the query blocks [lo, hi).
    slot_of = lambda step: lax.rem(step, jnp.int32(stages))

    @pl.when(is_producer(wg))
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
        if bias_ref is not None:
          keys = pl.ds(tile * held_keys, held_keys)
          plgpu.copy_gmem_to_smem(bias_ref.at[bias_at(call, b, n) + (keys, queries)],
                                  bias_smem.at[slot], arrive)

      def load_do(step, slot):
        n, queries = block(step)
        arrive = do_full.at[slot]
        for i in range(parts):
          plgpu.copy_gmem_to_smem(in_part(do_ref.at[b, queries, n], i), do_smem.at[slot, i],
                                  arrive)
        plgpu.copy_gmem_to_smem(delta_ref.at[b, n, queries], delta_smem.at[slot], arrive)

      produce(jnp.int32(0), call.group * span, stages, [(q_free, load_q), (do_free, load_do)])

    @pl.when(is_consumer(wg))
    def _consumer():
      plgpu.set_max_registers(_mosaic_gpu.consumer_registers(producer_registers),
                              action="increase")
      row0 = tile * 128 + wg * 64 if parts == 1 else tile * 64
      walk = Walk(*(jnp.where(wg == 0, x, y) for x, y in zip(*walks)))
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
        kv_seg = load_block(kv_seg_smem.at[wg], plgpu.Layout.WGMMA.reduce(1), interpret)
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
          lse2 = load_block(lse_smem.at[slot], cols, interpret)
          bias2 = None
          if bias_smem is not None:  # read before q's slot (and the bias's) is released
            bias2 = bias_tile(bias_smem.at[slot] if parts > 1 else
                              bias_smem.at[slot, pl.ds(wg * 64, 64)], interpret)
          mask = None
          if positions or call.segments:
            q_seg = None
            if call.segments:
              q_seg = lax.broadcast_in_dim(load_block(q_seg_smem.at[slot], cols, interpret),
                                           shape, [1])
            k_pos = row0 + iota(shape, 0, interpret)
            q_pos = i * bq + iota(shape, 1, interpret)
            mask = visible(q_pos, k_pos, call.window if positions else Window(None, None),
                           q_seg, None if kv_seg is None else
                           lax.broadcast_in_dim(kv_seg, shape, [0]))
          plgpu.barrier_wait(do_full.at[slot])
          delta = load_block(delta_smem.at[slot], cols, interpret)
          p, th = probabilities(kq, lse2, mask, 1, call, bias2)
          p16, p = p.astype(call.dtype), capped(p, th)
          # dv's product is issued behind dP^T's, and runs on while dS^T is computed.
          dp = _dp_and_dv(list(zip(v_parts, do_parts)), do_smem.at[slot, own], p16, dv_acc,
                          interpret)
          ds = grad_logits(p, dp, delta, 1)
          mma(dk_acc, ds.astype(call.dtype), q_smem.at[slot, own], interpret)
          mma_wait(1, interpret)  # dv's product is done: dO's slot is free
          plgpu.barrier_arrive(do_free.at[slot])
          mma_wait(0, interpret)
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
        mma_wait(0, interpret)
        return dk_acc[...], dv_acc[...]

      scratch_ = [] if scratch is None else [scratch.at[0, wg], scratch.at[1, wg]]
      dk, dv = accumulators([(64, part), (64, part)], scratch_, accumulate, interpret)
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
  """(dq, dk, dv, dbias or None) from the saved output and log-sum-exp: the dq and dk/dv
  kernels, and with a bias the d(bias) kernel (its own launch, so that XLA drops it where
  nothing asks for the bias's gradient: a mask given as a bias)."""
  head = q.shape[-1]  # padded to whole tiles as the forward's (zero columns, cropped)
  q, k, v, out, dout = (pad_head(x) for x in (q, k, v, out, dout))
  call = Call.of(q, k, bias, q_seg, window=window, scale=scale, soft_cap=soft_cap)
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
  dq_extra, dkv_extra, dbias_extra = [], [], []
  if bias is not None:  # (Bb, Nb, T, S) padded, and its transpose for the dk/dv kernel
    bias = pad_to(bias, (*bias.shape[:2], t_pad, s_pad))
    dq_extra, dkv_extra = [bias], [jnp.swapaxes(bias, 2, 3)]
  if call.segments:
    edge = lambda x, to: jnp.pad(x.astype(jnp.int32), ((0, 0), (0, to - x.shape[1])),
                                 mode="edge")
    q_seg, kv_seg = edge(q_seg, t_pad), edge(kv_seg, s_pad)
    dq_extra += [q_seg, kv_seg, meeting_blocks(q_seg, kv_seg, 128, c.bwd_block_kv)]
    dkv_extra += [q_seg, kv_seg,
                  meeting_blocks(kv_seg, q_seg, 128 // head_parts(h), c.bwd_block_q)]
    dbias_extra = [q_seg, kv_seg]
  params = dict(
      num_threads=WARPGROUPS, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      **({"interpret": interpret} if interpret else {}))
  dq = plgpu.kernel(
      named("jk_attention_dq_mgpu", _dq_kernel, call=call, config=c, interpret=bool(interpret)),
      out_type=jax.ShapeDtypeStruct((b, t_pad, n, h), q.dtype),
      grid=(n, t_pad // 128, b), grid_names=("heads", "q", "batch"), **params,
  )(*operands, *dq_extra)
  dk, dv = plgpu.kernel(
      named("jk_attention_dkdv_mgpu", _dkv_kernel, call=call, config=c,
             interpret=bool(interpret)),
      out_type=[jax.ShapeDtypeStruct((b, s_pad, kv_heads, h), k.dtype)] * 2,
      grid=(kv_heads, s_pad // (128 // head_parts(h)), b), grid_names=("heads", "kv", "batch"),
      **params,
  )(*operands, *dkv_extra)
  dbias = None
  if bias is not None:
    dbias = dbias_kernel.dbias(operands, bias, dbias_extra, call=call, params=params)
    dbias = dbias[:, :, :t, :s]
  return dq[:, :t, :, :head], dk[:, :s, :, :head], dv[:, :s, :, :head], dbias
