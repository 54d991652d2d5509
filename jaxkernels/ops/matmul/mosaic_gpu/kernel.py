"""Pallas Mosaic GPU matmul for Hopper: TMA, wgmma, warp specialization, a persistent grid.

Each CTA has three warpgroups: one issues TMA loads of A and B blocks into a
``stages``-deep ring of swizzled shared-memory buffers; two compute
warpgroups each own a ``tile_m x tile_n`` float32 accumulator in registers and
issue wgmma straight from shared memory. Together they cover a CTA tile of
(2 tile_m, tile_n) or (tile_m, 2 tile_n) (``split``). The grid is persistent:
one CTA per SM walks output tiles in a snake order (``grid_minor``,
``grid_tile_width``) that keeps neighbouring CTAs on shared A and B blocks in L2.

``schedule="pingpong"`` instead gives each compute warpgroup whole ``tile_m x tile_n`` tiles
in turn, fed from one ring in the order they consume it, so that one warpgroup's epilogue
could run under the other's product. On an H200 at its 700 W cap it is not faster: the same
cycles as cooperative for the plain product at a 6% lower clock (128-wide tiles move more bytes
per flop), and the exact-GELU epilogue's cycles were not hidden (notes/matmul.md, matmul-18/19).

The epilogue runs on the accumulator in registers (dequantization scales, bias,
activation; the residual comes in by TMA through the output buffer), then
writes C through shared memory by TMA in ``epi_tile_m x epi_tile_n`` pieces,
double-buffered so the store of one piece overlaps the next one's math.

Edges: TMA zero-fills loads that run past the array and clips stores, so M, N and
K need not be multiples of the CTA tile. Swizzled TMA does need each array's rows
to be a multiple of 8 and its row a multiple of 128 bytes, and a copy must not start
past the array's end (the epilogue skips C's pieces that would). Where these fail, the
wrapper zero-pads the operands and cuts the padded output with a copy kernel
(``crop``): one extra pass over each.

The gated product (``Problem.glu``, ``matmul(glu=True)``): B is [gate | up] side by side. A
CTA tile covers ``cta_n / 2`` columns of y; each K step loads A's block and two B blocks, the
gate's columns and the up's (two TMA copies into two contiguous swizzled blocks of the slot),
and each compute warpgroup multiplies into two accumulators, gate and up, of half its tile's
width. Its epilogue writes y = act(gate) * up, and for the gradient z's two halves. Only on the
kernel's own ring, with no bias, residual or scales (``config._glu_error``, ``unsupported``).

fp8 wgmma reads both operands K-major: B must be stored (N, K). A (K, N) fp8 B is
transposed by XLA first (one pass over B).

Block scales along K (``Problem.block_k``, fp8 under MXFP8 or DeepSeek-V3 scaling): the K
step is one scale block deep (``tile_k``; the wrapper repeats the scales of wider blocks). Each
step's product goes into a fresh accumulator, which the warpgroup awaits, releases the slot,
and adds into its running float32 sum times the step's scales: a_scale's (tile_m,) for the
rows and b_scale's (tile_n,) for the columns, which the producer loads with A and B into the
slot (the wrapper hands them over as (K / tile_k, M) and (K / tile_k, N) arrays). Where a CTA
tile's columns share one b scale (DeepSeek-V3's 128 x 128 weight blocks), it comes repeated
along the tile's rows instead, and the add is one multiply-add an element (``_b_scale_by_rows``:
1.23 -> 1.04 ms at 8192^3 on an H100, notes/report.md fp8-blocks-2). Hopper's
tensor cores cannot scale inside an MMA (Blackwell's can), so the two warpgroups take turns:
one adds while the other's product runs. Two accumulators per warpgroup keep its tile at
64 x 128 (``config._block_error``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkernels import _mosaic_gpu
from jaxkernels._tiling import cdiv, pad_to, round_up
from jaxkernels.ops.matmul.common import Problem, split_refs
from jaxkernels.ops.matmul.mosaic_gpu.config import (PRODUCER_REGISTERS, Config, StreamK,
                                                     num_tiles)
from jaxkernels.ops.matmul.mosaic_gpu.epilogue import Epilogue, sub, write_tile
from jaxkernels.ops.matmul.mosaic_gpu.padding import as_stored, crop, padded_shapes


def _kernel(*refs, problem: Problem, config: Config, math):
  p, c = problem, config
  extra = {}
  if c.stream_k:  # the last output: the CTAs' float32 partial tiles
    *refs, extra["partials"] = refs
  a_gmem, b_gmem, bias_gmem, res_gmem, as_gmem, bs_gmem, y_gmem, z_gmem = split_refs(p, refs)
  scratch, body = _schedule(c)
  a_block = (c.tile_k, c.cta_m) if p.trans_a else (c.cta_m, c.tile_k)
  b_block = (c.cta_n, c.tile_k) if p.trans_b else (c.tile_k, c.cta_n)

  epilogue_scratch = Epilogue.scratch(p, c)

  @functools.partial(pl.run_scoped, collective_axes="wg",
                     **scratch(p, c, a_block, b_block, a_gmem, b_gmem), **epilogue_scratch)
  def _scope(**allocs):
    epilogue = Epilogue(**{k: allocs.pop(k) for k in epilogue_scratch},
                         bias_gmem=bias_gmem, res_gmem=res_gmem, as_gmem=as_gmem,
                         bs_gmem=bs_gmem, y_gmem=y_gmem, z_gmem=z_gmem, math=math)
    body(a_gmem, b_gmem, epilogue, problem=p, config=c, a_block=a_block, b_block=b_block,
         **allocs, **extra)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _tile_index(linear, p: Problem, c: Config):
  """(m, n) index of the CTA tile at position ``linear`` of the snake order."""
  m_tiles, n_tiles = cdiv(p.m, c.cta_m), cdiv(p.n, c.cta_n)
  minor = 1 if c.grid_minor == "n" else 0
  return plgpu.planar_snake(linear, (m_tiles, n_tiles), minor, c.grid_tile_width)


def _tile_slices(linear, p: Problem, c: Config):
  """(rows, cols) of the CTA tile at position ``linear`` of the snake order; under glu, cols
  are y's (half the CTA's product columns: the gate's, and the up's past out_n). Multiplied
  out here: a traced division of a slice's start does not lower (layout inference fails)."""
  m_idx, n_idx = _tile_index(linear, p, c)
  width = c.cta_n // 2 if p.glu else c.cta_n
  return pl.ds(m_idx * c.cta_m, c.cta_m), pl.ds(n_idx * width, width)


def _b_scale_by_rows(p: Problem, c: Config) -> bool:
  """Whether each CTA tile's columns lie in one b_scale block (DeepSeek-V3's 128 x 128 weight
  blocks under 128-column tiles): its b scale for a K step is then one number, which the
  wrapper hands over repeated along the tile's rows, so that a K step's scale is one vector
  along rows (a_scale times it) and the sum one fused multiply-add an element."""
  return p.block_n > 0 and p.block_n % c.cta_n == 0


def _cooperative_pipeline(p, c, a_block, b_block, body, compute_context):
  """JAX's warp-specialized pipeline: both compute warpgroups read every slot."""
  in_specs = [
      plgpu.BlockSpec(a_block, (lambda k: (k, 0)) if p.trans_a else (lambda k: (0, k)),
                      transforms=_mosaic_gpu.swizzled(a_block[1], p.dtype), memory_space=plgpu.SMEM),
      plgpu.BlockSpec(b_block, (lambda k: (0, k)) if p.trans_b else (lambda k: (k, 0)),
                      transforms=_mosaic_gpu.swizzled(b_block[1], p.dtype), memory_space=plgpu.SMEM),
  ]
  return plgpu.emit_pipeline_warp_specialized(
      body, grid=(cdiv(p.k, c.tile_k),), memory_registers=PRODUCER_REGISTERS,
      in_specs=in_specs, wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=c.stages,
      compute_context=compute_context)


def _cooperative_scratch(p, c, a_block, b_block, a_gmem, b_gmem) -> dict:
  ignore = lambda *_, **__: None
  pipeline = _cooperative_pipeline(p, c, a_block, b_block, ignore, ignore)
  return dict(pipeline_allocs=pipeline.get_allocations(a_gmem, b_gmem))


def _cooperative(a_gmem, b_gmem, epilogue: Epilogue, *, problem, config, a_block, b_block,
                 pipeline_allocs):
  """Both compute warpgroups on one CTA tile, each on its half (``split``)."""
  p, c = problem, config
  wg = lax.axis_index("wg")

  @plgpu.nd_loop((num_tiles(p, c),), collective_axes="sm")
  def _tiles(info: plgpu.NDLoopInfo):
    (linear,) = info.index
    parity = info.local_index % 2
    cta_rows, cta_cols = _tile_slices(linear, p, c)
    wg_rows, wg_cols = _halves(c, wg)

    def compute_context(eval_pipeline):
      # The epilogue's vectors load while the main loop runs.
      waits = epilogue.load_vectors(p, wg, parity, sub(cta_rows, wg_rows, c.tile_m),
                                    sub(cta_cols, wg_cols, c.tile_n))

      @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((c.tile_m, c.tile_n), jnp.float32))
      def _acc(acc_ref):
        with jax.named_scope("mainloop"):  # regions of a Mosaic GPU profile (profile_space)
          eval_pipeline(acc_ref)
        with jax.named_scope("epilogue"):
          acc = acc_ref[...]
          for barrier in waits:
            plgpu.barrier_wait(barrier)
          write_tile(acc, epilogue, wg, parity, cta_rows, cta_cols, wg_rows, wg_cols,
                      problem=p, config=c)

    def mma(_, a_smem, b_smem, acc_ref):
      a, b = _my_part(a_smem, b_smem, p, c, wg_rows, wg_cols)
      plgpu.wgmma(acc_ref, *_operands(a, b, p))
      plgpu.wgmma_wait(0)
      return acc_ref

    _cooperative_pipeline(p, c, a_block, b_block, mma, compute_context)(
        a_gmem.at[:, cta_rows] if p.trans_a else a_gmem.at[cta_rows, :],
        b_gmem.at[cta_cols, :] if p.trans_b else b_gmem.at[:, cta_cols],
        allocations=pipeline_allocs)


def _ring_scratch(p, c, a_block, b_block, a_gmem, b_gmem) -> dict:
  del a_gmem, b_gmem
  owners = 1 if c.cooperative else 2
  # Under glu a slot holds B's gate block and its up block, each half the CTA's columns: two
  # contiguous (TMA writes only contiguous shared memory) swizzled blocks.
  b_slot = (2, b_block[0], b_block[1] // 2) if p.glu else b_block
  blocks = (dict(sa_ring=plgpu.SMEM((c.stages, c.cta_m), jnp.float32),
                 sb_ring=plgpu.SMEM((c.stages, c.cta_m if _b_scale_by_rows(p, c) else c.cta_n),
                                    jnp.float32))
            if p.block_k else {})
  return dict(
      a_ring=plgpu.SMEM((c.stages, *a_block), p.dtype, transforms=_mosaic_gpu.swizzled(a_block[1], p.dtype)),
      b_ring=plgpu.SMEM((c.stages, *b_slot), p.dtype, transforms=_mosaic_gpu.swizzled(b_slot[-1], p.dtype)),
      # Each TMA copy (A, and B or its two halves, and the block scales) arrives on a slot's
      # "full" barrier; its readers on "free".
      full=plgpu.Barrier(num_arrivals=(3 if p.glu else 2) + 2 * bool(p.block_k),
                         num_barriers=owners * c.stages),
      free=plgpu.Barrier(num_arrivals=2 if c.cooperative else 1, num_barriers=c.stages),
      **blocks,
  )


def _fill(a_gmem, b_gmem, a_ring, b_ring, full, full_base, free, p: Problem, c: Config, rows,
          cols, first, k_begin, k_end, scales=None):
  """TMA loads of K steps [k_begin, k_end) of the blocks at (rows, cols) into ring positions
  ``first`` on (the owner's "full" barriers start at ``full_base``), each once its slot is
  free; with block scales (``scales``: their gmem arrays and rings) each step's too."""

  @pl.loop(k_begin, k_end)
  def _(step):
    position = first + step - k_begin
    slot = lax.rem(position, c.stages)

    @pl.when(position >= c.stages)
    def _():
      plgpu.barrier_wait(free.at[slot])

    ks = pl.ds(step * c.tile_k, c.tile_k)
    plgpu.copy_gmem_to_smem(a_gmem.at[ks, rows] if p.trans_a else a_gmem.at[rows, ks],
                            a_ring.at[slot], full.at[full_base + slot])
    if p.glu:  # the gate's columns for the CTA's y columns, and the same of up
      for half, offset in enumerate((0, p.out_n)):
        plgpu.copy_gmem_to_smem(b_gmem.at[ks, pl.ds(offset + cols.start, cols.size)],
                                b_ring.at[slot, half], full.at[full_base + slot])
    else:
      plgpu.copy_gmem_to_smem(b_gmem.at[cols, ks] if p.trans_b else b_gmem.at[ks, cols],
                              b_ring.at[slot], full.at[full_base + slot])
    if p.block_k:  # scales: their gmem arrays, rings, and b_scale's piece for this tile
      as_gmem, bs_gmem, sa_ring, sb_ring, b_piece = scales
      plgpu.copy_gmem_to_smem(as_gmem.at[step, rows], sa_ring.at[slot], full.at[full_base + slot])
      plgpu.copy_gmem_to_smem(bs_gmem.at[step, b_piece], sb_ring.at[slot],
                              full.at[full_base + slot])


def _multiply_blocks(a_ring, b_ring, full, free, sa_ring, sb_ring, p: Problem, c: Config,
                     wg_rows, wg_cols, first, k_begin, k_end):
  """The block-scaled main loop: each K step's product into a fresh accumulator, awaited, the
  slot released, and added into the float32 running sum (returned) times the step's row and
  column scales."""
  shape = (c.tile_m, c.tile_n)

  def step_body(step, total):
    slot = lax.rem(first + step - k_begin, c.stages)
    plgpu.barrier_wait(full.at[slot])
    a, b = _my_part(a_ring.at[slot], b_ring.at[slot], p, c, wg_rows, wg_cols)

    def product(part_ref):
      plgpu.wgmma(part_ref, *_operands(a, b, p))
      return part_ref[...]  # awaits it

    part = pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))
    a_scale = sa_ring.at[slot][wg_rows]
    if _b_scale_by_rows(p, c):  # one b scale for the tile, repeated along its rows
      rows_scale = a_scale * sb_ring.at[slot][wg_rows]
      plgpu.barrier_arrive(free.at[slot])
      return total + part * lax.broadcast_in_dim(rows_scale, shape, [0])
    b_scale = sb_ring.at[slot][wg_cols]
    plgpu.barrier_arrive(free.at[slot])
    scale = (lax.broadcast_in_dim(a_scale, shape, [0])
             * lax.broadcast_in_dim(b_scale, shape, [1]))
    return total + part * scale

  with jax.named_scope("mainloop"):
    return lax.fori_loop(k_begin, k_end, step_body, jnp.zeros(shape, jnp.float32))


def _multiply(acc_ref, a_ring, b_ring, full, full_base, free, p: Problem, c: Config, wg_rows,
              wg_cols, first, k_begin, k_end):
  """wgmma over the ring positions ``first`` on (K steps [k_begin, k_end)), one product in
  flight while the next is issued, each slot released once the product after it is issued;
  the last product is awaited and its slot released."""

  def step_body(step):
    slot = lax.rem(first + step - k_begin, c.stages)
    plgpu.barrier_wait(full.at[full_base + slot])
    if p.glu:  # two accumulators, gate and up, each from its half of the slot's B
      a = a_ring.at[slot]
      if c.cooperative and c.split == "m":  # (A is not transposed under glu)
        a = a.at[wg_rows]
      for acc, half in zip(acc_ref, range(2)):
        plgpu.wgmma(acc, a, _glu_half(b_ring.at[slot, half], c))
    else:
      a, b = _my_part(a_ring.at[slot], b_ring.at[slot], p, c, wg_rows, wg_cols)
      plgpu.wgmma(acc_ref, *_operands(a, b, p))
    # This step's products in flight (one group each): the previous step's have finished
    # reading its slot.
    plgpu.wgmma_wait(2 if p.glu else 1)

    @pl.when(step > k_begin)
    def _():
      plgpu.barrier_arrive(free.at[lax.rem(first + step - k_begin - 1, c.stages)])

  with jax.named_scope("mainloop"):  # regions of a Mosaic GPU profile (profile_space)
    pl.loop(k_begin, k_end)(step_body)
  plgpu.wgmma_wait(0)
  plgpu.barrier_arrive(free.at[lax.rem(first + k_end - k_begin - 1, c.stages)])


def _ring(a_gmem, b_gmem, epilogue: Epilogue, *, problem, config, a_block, b_block,
          a_ring, b_ring, full, free, partials=None, sa_ring=None, sb_ring=None):
  """The kernel's own ring of ``stages`` slots, filled by the TMA warpgroup in the order the
  compute warpgroups consume it, straight on across tiles (the next tile's first loads run
  under this one's last steps and epilogue).

  Cooperative, both compute warpgroups read every slot, each for its half of the CTA tile.
  Ping-pong, each owns whole tiles, alternately (the CTA's even tiles go to warpgroup 0, odd
  ones to 1): the producer runs at most ``stages`` K steps ahead, so warpgroup 1's next tile
  starts filling only once warpgroup 0's current one is filled, the two products overlap for
  at most that many steps, and each epilogue runs while the other warpgroup's product
  proceeds. Every slot has one "free" barrier, which only the producer waits on, and a "full"
  barrier per owner (cooperative: one; ping-pong: one per warpgroup, so that each warpgroup
  waits on every phase of its own barriers: Mosaic GPU tracks barrier phases per thread).
  A compute warpgroup keeps one step's wgmma in flight while it issues the next, and releases
  a slot once the product after it is issued.

  Stream-K (``StreamK``): after its whole tiles each CTA walks its run of the cut tiles'
  K steps through the same ring. A piece that does not hold its tile's first K step is
  stored, float32, to the CTA's slot of ``partials`` (in the accumulator's register layout,
  by each warpgroup for its half), and the warpgroup signals its semaphore. The piece that
  does is the last of its CTA's run, and the other pieces of its tile belong to the runs
  after it, which store them first thing: its warpgroups wait on those semaphores, add the
  partials in run order (the sum does not depend on timing) and run the epilogue. Every CTA
  signals before it waits and all of them are resident (one per SM), so none waits forever.
  """
  del a_block, b_block
  p, c = problem, config
  wg = lax.axis_index("wg")
  cta = lax.axis_index("sm")
  ctas = lax.axis_size("sm")
  k_steps = cdiv(p.k, c.tile_k)
  plan = StreamK.plan(p, c, ctas)
  tiles = lambda body: plgpu.nd_loop((plan.whole,), collective_axes="sm")(body)
  owner_of = lambda local_index: 0 if c.cooperative else local_index % 2
  sems = pl.get_global(plgpu.SemaphoreType.REGULAR((ctas * 2,))) if plan.cut else None

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    @tiles
    def _(info: plgpu.NDLoopInfo):
      rows, cols = _tile_slices(info.index[0], p, c)
      scales = None
      if p.block_k:  # b_scale's piece: the tile's columns, or its one scale along its rows
        b_piece = (pl.ds(_tile_index(info.index[0], p, c)[1] * c.cta_m, c.cta_m)
                   if _b_scale_by_rows(p, c) else cols)
        scales = (epilogue.as_gmem, epilogue.bs_gmem, sa_ring, sb_ring, b_piece)
      _fill(a_gmem, b_gmem, a_ring, b_ring, full, owner_of(info.local_index) * c.stages, free,
            p, c, rows, cols, info.local_index * k_steps, 0, k_steps, scales)

    if plan.cut:
      def piece(tile, k_begin, k_end, first, seq):
        del seq
        rows, cols = _tile_slices(plan.whole + tile, p, c)
        _fill(a_gmem, b_gmem, a_ring, b_ring, full, 0, free, p, c, rows, cols, first, k_begin,
              k_end)

      plan.walk(cta, piece)
      total = plan.positions(cta)
    else:  # the CTA's whole tiles, dealt round the SMs
      total = lax.div(plan.whole - cta + ctas - 1, ctas) * k_steps

    # After the last fill, wait for the releases no fill waited for, so that every barrier
    # ends with each of its phases observed.
    @pl.loop(lax.max(total - c.stages, 0), total)
    def _(position):
      plgpu.barrier_wait(free.at[lax.rem(position, c.stages)])

  @pl.when(wg < 2)
  def _consumers():
    plgpu.set_max_registers(_mosaic_gpu.consumer_registers(PRODUCER_REGISTERS),
                            action="increase")
    wg_rows, wg_cols = _halves(c, wg) if c.cooperative else (slice(None), slice(None))

    def product(tile, parity, first, k_begin, k_end, full_base, finish, load_when=None):
      """The product of K steps [k_begin, k_end) of ``tile`` into a fresh accumulator,
      which ``finish(acc, cta_rows, cta_cols, waits, parity)`` takes."""
      cta_rows, cta_cols = _tile_slices(tile, p, c)
      waits = epilogue.load_vectors(p, wg, parity, sub(cta_rows, wg_rows, c.tile_m),
                                    sub(cta_cols, wg_cols, c.tile_n), when=load_when)

      if p.block_k:  # cooperative, one owner (config._block_error)
        acc = _multiply_blocks(a_ring, b_ring, full, free, sa_ring, sb_ring, p, c, wg_rows,
                               wg_cols, first, k_begin, k_end)
        with jax.named_scope("epilogue"):
          finish(acc, cta_rows, cta_cols, waits, parity)
        return

      @functools.partial(pl.run_scoped, acc_ref=_accumulators(p, c))
      def _acc(acc_ref):
        _multiply(acc_ref, a_ring, b_ring, full, full_base, free, p, c, wg_rows, wg_cols,
                  first, k_begin, k_end)
        with jax.named_scope("epilogue"):
          acc = tuple(r[...] for r in acc_ref) if p.glu else acc_ref[...]
          finish(acc, cta_rows, cta_cols, waits, parity)

    def write(acc, cta_rows, cta_cols, waits, parity):
      for barrier in waits:
        plgpu.barrier_wait(barrier)
      write_tile(acc, epilogue, wg, parity, cta_rows, cta_cols, wg_rows, wg_cols,
                  problem=p, config=c)

    @tiles
    def _(info: plgpu.NDLoopInfo):
      parity = info.local_index % 2 if c.cooperative else (info.local_index // 2) % 2
      tile = functools.partial(product, info.index[0], parity, info.local_index * k_steps, 0,
                               k_steps, owner_of(info.local_index) * c.stages, write)
      if c.cooperative:
        tile()
      else:
        pl.when(info.local_index % 2 == wg)(tile)

    if plan.cut:
      def piece(tile, k_begin, k_end, first, seq):
        def finish(acc, cta_rows, cta_cols, waits, parity):
          mine = partials.at[cta, wg]

          @pl.when(k_begin > 0)
          def _():
            mine[...] = acc
            # GPU scope: release and acquire among this GPU's SMs (the default, system scope,
            # also orders against the host and peer GPUs, which never read these).
            plgpu.semaphore_signal(sems.at[cta * 2 + wg], memory_scope="gpu")

          @pl.when(k_begin == 0)
          def _():
            def add(run, acc):
              plgpu.semaphore_wait(sems.at[run * 2 + wg], memory_scope="gpu")
              return acc + _mosaic_gpu.load(partials, (run, wg), layout=plgpu.Layout.WGMMA,
                                             optimized=False)

            total = lax.fori_loop(cta + 1, plan.last_run(tile) + 1, add, acc)
            write(total, cta_rows, cta_cols, waits, parity)

        product(plan.whole + tile, seq % 2, first, k_begin, k_end, 0, finish,
                load_when=k_begin == 0)

      plan.walk(cta, piece)


def _schedule(c: Config):
  """(scratch, body) of the kernel's main loop: JAX's pipeline or the kernel's own ring."""
  return (_ring_scratch, _ring) if c.on_ring else (_cooperative_scratch, _cooperative)


def _halves(c: Config, wg):
  """(rows, cols) of a cooperative warpgroup's half of the CTA tile, relative to it."""
  if c.split == "m":
    return pl.ds(wg * c.tile_m, c.tile_m), slice(None)
  return slice(None), pl.ds(wg * c.tile_n, c.tile_n)


def _accumulators(p: Problem, c: Config):
  """A warpgroup's float32 accumulator: its tile, or under glu the gate's and up's halves."""
  if p.glu:
    return (plgpu.ACC((c.tile_m, c.tile_n // 2), jnp.float32),) * 2
  return plgpu.ACC((c.tile_m, c.tile_n), jnp.float32)


def _glu_half(b_half, c: Config):
  """This warpgroup's part of a slot's gate or up block (cta_n / 2 columns)."""
  if not (c.cooperative and c.split == "n"):
    return b_half
  return b_half.at[:, pl.ds(lax.axis_index("wg") * (c.tile_n // 2), c.tile_n // 2)]


def _my_part(a_smem, b_smem, p: Problem, c: Config, wg_rows, wg_cols):
  """This warpgroup's part of the CTA's A and B blocks (all of them in ping-pong), sliced
  before any transpose (a transposed view cannot be sliced)."""
  if not c.cooperative:
    return a_smem, b_smem
  if c.split == "m":
    return (a_smem.at[:, wg_rows] if p.trans_a else a_smem.at[wg_rows]), b_smem
  return a_smem, (b_smem.at[wg_cols] if p.trans_b else b_smem.at[:, wg_cols])


def _operands(a, b, p: Problem):
  """wgmma's operands from shared-memory blocks, transposed where they are stored so."""
  a = _mosaic_gpu.transposed(a) if p.trans_a else a
  b = _mosaic_gpu.transposed(b) if p.trans_b else b
  return a, b


def matmul(a, b, *, bias=None, residual=None, a_scale=None, b_scale=None, problem: Problem,
           config: Config, interpret=False):
  p = as_stored(problem)
  if p.trans_b != problem.trans_b:
    b = b.T
  c = config
  if interpret and c.stream_k:
    # The Mosaic GPU interpreter has no semaphores (jax 0.10.2): the same tiles walked whole
    # on the same ring compute the same product, summed over K in one run instead of several.
    c = config = dataclasses.replace(c, stream_k=False, ring=True)
  a_shape, b_shape, out_shape = padded_shapes(p, c)
  a, b = pad_to(a, a_shape), pad_to(b, b_shape)
  operands = [a, b]
  # The epilogue vectors, read per warpgroup, are padded to whole CTA tiles (a few KiB).
  vector = lambda v, cta: pad_to(v.astype(jnp.float32), (round_up(v.shape[0], cta),))
  if p.has_bias:
    operands.append(vector(bias, c.cta_n))
  if p.has_residual:  # it comes in through the output's shared-memory buffer: same dtype
    operands.append(pad_to(residual.astype(p.out_dtype), out_shape))
  if p.has_scales:
    operands += [vector(a_scale, c.cta_m), vector(b_scale, c.cta_n)]
  if p.block_k:
    operands += _block_scales(a_scale, b_scale, p, c, a_shape[0], b_shape[0] if p.trans_b
                              else b_shape[1], cdiv(a_shape[1], c.tile_k))
  outs = [jax.ShapeDtypeStruct(out_shape, p.out_dtype)] * p.outputs
  if p.glu:  # y has half the product's columns (whole CTA tiles of them: no padding)
    outs[0] = jax.ShapeDtypeStruct((out_shape[0], p.out_n), p.out_dtype)
  ctas = _mosaic_gpu.num_sms() if c.stream_k else min(_mosaic_gpu.num_sms(), num_tiles(p, config))
  # Stream-K's partial tiles: one per CTA, each warpgroup's half in its own slot.
  partials = ([jax.ShapeDtypeStruct((ctas, 2, c.tile_m, c.tile_n), jnp.float32)]
              if c.stream_k else [])
  kernel = plgpu.kernel(
      functools.partial(_kernel, problem=p, config=config,
                        math=_mosaic_gpu.math(interpret)),
      out_type=outs + partials,
      grid=(ctas,),
      grid_names=("sm",),
      num_threads=3,
      thread_name="wg",
      # approx_math: the activation's exp2 on the SFU (ex2.approx.ftz, 2 ulp), as the Triton
      # kernels do; its reciprocal is rcp.approx.ftz by inline PTX (mosaic_gpu_fast_reciprocal)
      # wherever the kernel is compiled. Nothing else in the kernel takes either.
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
          approx_math=p.activation is not None, **_profile(c)),
      **({"interpret": interpret} if interpret else {}),
  )
  outs = kernel(*operands)[:p.outputs]
  outs = [_crop(o, p.m, n, c, interpret) for o, n in zip(outs, (p.out_n, p.n))]  # y, z
  return tuple(outs) if p.save_preactivation else outs[0]


def _block_scales(a_scale, b_scale, p: Problem, c: Config, m_rows: int, n_cols: int,
                  k_steps: int):
  """The block scales as the producer loads them, a K step's row of each: a_scale (M, K / bk)
  as (k_steps, M) and b_scale (K / bk, N / bn) as (k_steps, N), a block deeper than a K step
  repeated over its steps (and a block wider than a column over its columns), zero-padded
  to the padded operands' K steps and to whole CTA tiles (as the epilogue's vectors)."""
  steps_per_block = p.block_k // c.tile_k
  a_t = jnp.repeat(a_scale.astype(jnp.float32).T, steps_per_block, axis=0)
  b_steps = jnp.repeat(b_scale.astype(jnp.float32), steps_per_block, axis=0)
  a_t = pad_to(a_t, (k_steps, round_up(m_rows, c.cta_m)))
  if _b_scale_by_rows(p, c):  # each CTA column tile's one scale, cta_m times
    tiles = cdiv(n_cols, c.cta_n)
    per_tile = jnp.repeat(b_steps, p.block_n // c.cta_n, axis=1)[:, :tiles]
    b_t = jnp.repeat(pad_to(per_tile, (k_steps, tiles)), c.cta_m, axis=1)
    return [a_t, b_t]
  b_cols = jnp.repeat(b_steps, p.block_n, axis=1)
  return [a_t, pad_to(b_cols, (k_steps, round_up(n_cols, c.cta_n)))]


def _crop(y, m: int, n: int, config: Config, interpret):
  if config.crop == "xla":
    return y[:m, :n]
  return crop(y, m, n, interpret=bool(interpret))


def _profile(c: Config) -> dict:
  """Compiler params that make the kernel record its timeline (``Config.profile_space``)."""
  if not c.profile_space:
    return {}
  return dict(profile_space=c.profile_space, profile_dir=c.profile_dir)
