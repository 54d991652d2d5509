"""d(bias) on Mosaic GPU: the gradient of attention's bias, a kernel of its own launch.

A CTA takes a (128 queries, ``DBIAS_BLOCK_KV`` keys) tile of one (Bb, Nb) bias and sums it over
the (batch, head) pairs the bias broadcasts over: for each pair, S = q k^T and dP = dO v^T
over the head dim in blocks of 64 (a producer warpgroup's ring of q, dO, k and v blocks, up to
four in flight), then P (dP - delta) from the saved log-sum-exp into a float32 accumulator in
registers, written once in the bias's dtype. Two compute warpgroups take 64 queries each. The
tiles a window hides are skipped (their gradient is 0). Its own launch, so that XLA drops it
where nothing asks for the bias's gradient (a mask given as a bias); summing in the kernel,
not by atomic adds from the dq kernel, keeps the result the same run to run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkernels import _mosaic_gpu
from jaxkernels._mosaic_gpu import accumulators, iota, load_block, mma_wait
from jaxkernels.ops.attention.common import Call, key_blocks, visible
from jaxkernels.ops.attention.mosaic_gpu.config import (DBIAS_BLOCK_KV, PRODUCER_REGISTERS,
                                                        dbias_stages)
from jaxkernels.ops.attention.mosaic_gpu.schedule import (CONSUMERS, bias_tile, grad_logits,
                                                          is_consumer, is_producer, itemsize,
                                                          mma_t, named, probabilities,
                                                          produce)


def _dbias_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, bias_ref, *refs, call: Call,
                  interpret):
  """d(bias) of one (128 queries, DBIAS_BLOCK_KV keys) tile of one (Bb, Nb) bias, summed over
  the batch and heads it broadcasts over: for each summed (batch, head) pair, S = q k^T and
  dP = dO v^T over the head dim in blocks of 64 (a ring of q, dO, k and v blocks), then
  P (dP - delta) into a float32 accumulator in registers, written once."""
  if call.segments:
    q_seg_ref, kv_seg_ref, dbias_ref = refs
  else:
    (dbias_ref,), q_seg_ref, kv_seg_ref = refs, None, None
  h, bk, chunk = call.head_dim, DBIAS_BLOCK_KV, 64
  chunks = h // chunk
  bb, nb = call.bias_shape[:2]
  heads = call.heads // nb  # the heads (and below, batches) each tile sums over
  pairs = call.batch // bb * heads
  stages = dbias_stages(jnp.dtype(call.dtype).itemsize, call.segments, itemsize(bias_ref))
  transforms = _mosaic_gpu.swizzled(chunk, call.dtype)
  extra = {}
  if call.segments:
    extra = dict(q_seg_smem=plgpu.SMEM((stages, 128), jnp.int32),
                 kv_seg_smem=plgpu.SMEM((stages, bk), jnp.int32))
  if interpret:
    extra["scratch"] = plgpu.SMEM((2, 2, 64, bk), jnp.float32)
  copies = 6 + 2 * int(call.segments)

  @functools.partial(
      pl.run_scoped, collective_axes="wg",
      q_smem=plgpu.SMEM((stages, 128, chunk), call.dtype, transforms=transforms),
      do_smem=plgpu.SMEM((stages, 128, chunk), call.dtype, transforms=transforms),
      k_smem=plgpu.SMEM((stages, bk, chunk), call.dtype, transforms=transforms),
      v_smem=plgpu.SMEM((stages, bk, chunk), call.dtype, transforms=transforms),
      lse_smem=plgpu.SMEM((stages, 128), jnp.float32),
      delta_smem=plgpu.SMEM((stages, 128), jnp.float32),
      # Each compute warpgroup's 64 rows of the bias tile, and then of d(bias).
      bias_smem=plgpu.SMEM((CONSUMERS, 64, bk), bias_ref.dtype,
                           transforms=_mosaic_gpu.swizzled(bk, bias_ref.dtype)),
      bias_full=plgpu.Barrier(num_barriers=CONSUMERS),
      full=plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
      free=plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
      **extra)
  def _scope(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, bias_smem, bias_full, full,
             free, q_seg_smem=None, kv_seg_smem=None, scratch=None):
    kt = lax.axis_index("kv")
    k0, r0 = kt * bk, lax.axis_index("q") * 128
    bias_index = lax.axis_index("bias")
    b0, n0 = lax.div(bias_index, jnp.int32(nb)), lax.rem(bias_index, jnp.int32(nb))
    wg = lax.axis_index("wg")
    # The pairs' (batch, head): b0 and n0 where the bias has the dimension (then it sums over
    # one), else each in turn (b0, n0 are 0 there).
    pair = lambda m: (b0 + lax.div(m, jnp.int32(heads)), n0 + lax.rem(m, jnp.int32(heads)))
    # The tile is seen by position (the window, both ends) where its key block is one of those
    # its rows visit.
    rows = jnp.clip(call.q_len - r0, 0, 128)
    first, _, _, end = key_blocks(r0, rows, bk, call.kv_len, call.window)
    n_pairs = jnp.where((rows > 0) & (first <= kt) & (kt < end), pairs, 0)
    slot_of = lambda step: lax.rem(step, jnp.int32(stages))
    keys = pl.ds(k0, bk)

    @pl.when(is_producer(wg))
    def _producer():
      plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

      def load(step, slot):
        b, n = pair(lax.div(step, jnp.int32(chunks)))
        kh = lax.div(n, jnp.int32(call.group))
        cols = pl.ds(lax.rem(step, jnp.int32(chunks)) * chunk, chunk)
        rows, arrive = pl.ds(r0, 128), full.at[slot]
        plgpu.copy_gmem_to_smem(q_ref.at[b, rows, n, cols], q_smem.at[slot], arrive)
        plgpu.copy_gmem_to_smem(do_ref.at[b, rows, n, cols], do_smem.at[slot], arrive)
        plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kh, cols], k_smem.at[slot], arrive)
        plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kh, cols], v_smem.at[slot], arrive)
        plgpu.copy_gmem_to_smem(lse_ref.at[b, n, rows], lse_smem.at[slot], arrive)
        plgpu.copy_gmem_to_smem(delta_ref.at[b, n, rows], delta_smem.at[slot], arrive)
        if call.segments:
          plgpu.copy_gmem_to_smem(q_seg_ref.at[b, rows], q_seg_smem.at[slot], arrive)
          plgpu.copy_gmem_to_smem(kv_seg_ref.at[b, keys], kv_seg_smem.at[slot], arrive)

      produce(jnp.int32(0), n_pairs * chunks, stages, [(free, load)])

    @pl.when(is_consumer(wg))
    def _consumer():
      plgpu.set_max_registers(_mosaic_gpu.consumer_registers(PRODUCER_REGISTERS),
                              action="increase")
      row0 = r0 + wg * 64
      rows, own = pl.ds(row0, 64), pl.ds(wg * 64, 64)
      tile = bias_smem.at[wg]
      plgpu.copy_gmem_to_smem(bias_ref.at[b0, n0, rows, keys], tile, bias_full.at[wg])
      plgpu.barrier_wait(bias_full.at[wg])
      bias2 = bias_tile(tile, interpret)
      shape = (64, bk)
      q_pos = row0 + iota(shape, 0, interpret)
      k_pos = k0 + iota(shape, 1, interpret)
      positions = visible(q_pos, k_pos, call.window)
      if call.kv_len % bk:  # padded keys: their P would not be 0
        end = k_pos < call.kv_len
        positions = end if positions is None else positions & end
      row_vector, col_vector = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

      def products(base):
        """(S, dP) of the pair whose first step is ``base``, over the head dim's blocks (each
        block's slot released once the next block's products are issued; the last one's is
        left to the caller, which reads the pair's statistics from it)."""
        def body(s_acc, dp_acc):
          def issue(step):
            slot = slot_of(step)
            plgpu.barrier_wait(full.at[slot])
            mma_t(s_acc, q_smem.at[slot, own], k_smem.at[slot], interpret)
            mma_t(dp_acc, do_smem.at[slot, own], v_smem.at[slot], interpret)

          issue(base)

          @pl.loop(1, chunks)
          def _(c):
            issue(base + c)
            mma_wait(2, interpret)  # the previous block's products are done
            plgpu.barrier_arrive(free.at[slot_of(base + c - 1)])

          mma_wait(0, interpret)
          return s_acc[...], dp_acc[...]
        return accumulators([shape, shape],
                            [] if scratch is None else [scratch.at[0, wg], scratch.at[1, wg]],
                            body, interpret)

      def accumulate(m, acc):
        base = m * chunks
        qk, dp = products(base)
        slot = slot_of(base + chunks - 1)
        lse2 = load_block(lse_smem.at[slot, own], row_vector, interpret)
        delta = load_block(delta_smem.at[slot, own], row_vector, interpret)
        mask = positions
        if call.segments:
          q_seg = load_block(q_seg_smem.at[slot, own], row_vector, interpret)
          kv_seg = load_block(kv_seg_smem.at[slot], col_vector, interpret)
          same = (lax.broadcast_in_dim(q_seg, shape, [0]) ==
                  lax.broadcast_in_dim(kv_seg, shape, [1]))
          mask = same if mask is None else mask & same
        plgpu.barrier_arrive(free.at[slot])
        p, _ = probabilities(qk, lse2, mask, 0, call, bias2)
        return acc + grad_logits(p, dp, delta, 0)  # the bias meets the logits after the cap

      zero = _mosaic_gpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA,
                                     interpret)
      dbias = lax.fori_loop(0, n_pairs, accumulate, zero)
      tile[...] = dbias.astype(tile.dtype)  # the bias tile was read before the loop
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(tile, dbias_ref.at[b0, n0, rows, keys])
      plgpu.wait_smem_to_gmem(0)


def dbias(operands, bias, extra, *, call: Call, params: dict):
  """d(bias) (Bb, Nb, T, S) padded as ``bias`` is, from the backward kernels' ``operands``
  (q, k, v, dO, the log-sum-exp in base 2, delta) and ``extra`` (the segment ids, padded)."""
  return plgpu.kernel(
      named("jk_attention_dbias_mgpu", _dbias_kernel, call=call,
            interpret=bool(params.get("interpret"))),
      out_type=jax.ShapeDtypeStruct(bias.shape, bias.dtype),
      grid=(bias.shape[3] // DBIAS_BLOCK_KV, bias.shape[2] // 128,
            bias.shape[0] * bias.shape[1]),
      grid_names=("kv", "q", "bias"), **params,
  )(*operands, bias, *extra)
