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
per flop), and the exact-GELU epilogue's cycles were not hidden (bench/NOTES.md, matmul-18/19).

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

fp8 wgmma reads both operands K-major: B must be stored (N, K). A (K, N) fp8 B is
transposed by XLA first (one pass over B).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkernels import hardware
from jaxkernels._activations import apply as activation_apply
from jaxkernels._pallas import cdiv, check_fields, mosaic_gpu_math, round_up
from jaxkernels.ops.matmul import crop
from jaxkernels.ops.matmul.common import FLOAT8, Problem, pad_to, split_refs

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), *FLOAT8)
SPLITS = ("m", "n")
SCHEDULES = ("cooperative", "pingpong")
PRODUCER_REGISTERS = 40  # the TMA warpgroup's; the two compute warpgroups share the rest
# Set to dict(profile_space=..., profile_dir=...) to have every kernel write a per-warpgroup
# timeline of its "mainloop" and "epilogue" regions (bench/experiments/matmul_timeline.py).
PROFILE: dict = {}
SMEM_BYTES = 227 * 1024  # per CTA on Hopper
# How a padded C is cut to (m, n): "triton" (crop.crop, a copy kernel) or "xla" (a slice: 0.86
# TB/s at 8193^3 bf16, bench/NOTES.md matmul-30). bench/experiments/matmul_ragged.py sets it.
CROP = "triton"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  tile_m: int = 128  # per compute warpgroup
  tile_n: int = 128
  tile_k: int = 64
  stages: int = 4
  split: str = "n"  # the compute warpgroups sit side by side along this dimension
  grid_minor: str = "n"
  grid_tile_width: int = 8
  epi_tile_m: int = 64
  epi_tile_n: int = 64
  epi_slots: int = 2  # output buffers per warpgroup: 2 overlap a piece's store with the next
  # "cooperative": both compute warpgroups work on one CTA tile, each on its half (``split``),
  # and the tensor cores idle while they run the epilogue together. "pingpong": each
  # warpgroup owns whole tiles (``tile_m x tile_n``), the two taking turns, so one's epilogue
  # runs while the other's product keeps the tensor cores busy.
  schedule: str = "cooperative"
  # Cooperative only (ping-pong always runs on the ring): False feeds the warpgroups through
  # JAX's warp-specialized pipeline, which awaits each K step's wgmma before releasing its
  # slot and drains the ring at each tile's end; True through the kernel's own ring, which
  # runs on across tiles while each warpgroup keeps one step's wgmma in flight as it issues
  # the next (a slot is released one step later, so ``stages - 1`` loads run ahead). On the
  # H200, with 64 x 64 pieces over 4 stages, 0.3-0.9% faster than JAX's pipeline with whole-
  # tile pieces over 3 in 40 rounds (matmul-34), and 0-4% faster at most of nine sizes in each
  # of three runs (matmul-39); with whole-tile pieces over 3 stages, 4% slower at 4096^3.
  # bias+gelu in 64 x 64 pieces, 2 buffers over 3 stages: 0.7-1.0% faster in two runs.
  ring: bool = False
  # Cooperative only, on the kernel's own ring: the last wave's tiles are not walked whole by
  # some CTAs while the others idle, but cut along K into equal runs of K steps, one run per
  # SM (stream-K). Each CTA first walks whole tiles, then its run, which may end a tile's K
  # steps that another CTA began: the CTA that holds a tile's first K step ("owner") adds
  # the others' float32 partial tiles, handed over through global memory and a semaphore, and
  # runs the epilogue. With fewer tiles than SMs, every tile is cut so. The hand-over takes a
  # float32 workspace of one CTA tile per SM (17 MiB for 128 x 256 tiles on 132 SMs).
  stream_k: bool = False
  # Stream-K: cut one whole wave more than the tiles left over (runs of one to two tiles), or
  # only those (runs of under a tile; a tile may be cut into many runs).
  stream_k_wave: bool = True

  def __post_init__(self):
    check_fields(self, ("tile_m", "epi_tile_m"), lambda v: v % 64 == 0,
                 "a multiple of 64 (wgmma's M per warpgroup)")
    check_fields(self, ("tile_n", "tile_k", "epi_tile_n"), lambda v: v % 32 == 0 and v <= 256,
                 "a multiple of 32, at most 256")
    check_fields(self, ("stages", "grid_tile_width", "epi_slots"), lambda v: v >= 1, ">= 1")
    check_fields(self, ("split", "grid_minor"), lambda v: v in SPLITS, "'m' or 'n'")
    check_fields(self, ("schedule",), lambda v: v in SCHEDULES, f"one of {SCHEDULES}")
    if self.stream_k and not self.cooperative:
      raise ValueError("stream_k=True needs the cooperative schedule, got schedule='pingpong'")
    if self.on_ring and self.stages < 2:
      raise ValueError(f"the ring (ring=True or the ping-pong schedule) keeps a slot one step "
                       f"longer: stages must be >= 2, got {self.stages}")
    if self.tile_m % self.epi_tile_m or self.tile_n % self.epi_tile_n:
      raise ValueError(f"epilogue tile {self.epi_tile_m}x{self.epi_tile_n} must divide the "
                       f"warpgroup tile {self.tile_m}x{self.tile_n}")

  @property
  def cooperative(self) -> bool:
    return self.schedule == "cooperative"

  @property
  def on_ring(self) -> bool:
    return self.ring or self.stream_k or not self.cooperative

  @property
  def cta_m(self) -> int:
    return self.tile_m * (2 if self.cooperative and self.split == "m" else 1)

  @property
  def cta_n(self) -> int:
    return self.tile_n * (2 if self.cooperative and self.split == "n" else 1)


def shared_bytes(problem: Problem, config: Config) -> int:
  c = config
  item = jnp.dtype(problem.dtype).itemsize
  ring = c.stages * (c.cta_m + c.cta_n) * c.tile_k * item
  out_item = jnp.dtype(problem.out_dtype).itemsize
  epilogue = 2 * c.epi_slots * c.epi_tile_m * c.epi_tile_n * out_item * problem.outputs
  vectors = 2 * 2 * 4 * (c.tile_m + 2 * c.tile_n)
  return ring + epilogue + vectors + 2048  # barriers and alignment


def config_error(problem: Problem, config: Config, chip) -> str | None:
  del chip
  p, c = _as_stored(problem), config
  if (need := shared_bytes(p, c)) > SMEM_BYTES:
    return f"needs {need} bytes of shared memory per CTA; Hopper has {SMEM_BYTES}"
  # A cooperative warpgroup's half of a block cut along the block's minor dimension must
  # start on a swizzle tile (``_my_part``): B's columns (split "n"), or A's stored transposed.
  cut = {"n": (not p.trans_b, c.tile_n, c.cta_n), "m": (p.trans_a, c.tile_m, c.cta_m)}
  along_minor, half, block = cut[c.split]
  if c.cooperative and along_minor:
    lanes = _swizzle_lanes(block, p.dtype)
    if half % lanes:
      return (f"split={c.split!r} cuts the CTA's {block}-wide block into warpgroup halves of "
              f"{half}, which must be a multiple of its {lanes}-element swizzle tile")
  return None


# The CTA tiles the heuristic chooses among, as (tile_m, tile_n, split): 128 x 256 (two
# 128 x 128 warpgroup tiles side by side along N; the autotuner's pick at 8192^3 bf16 on an
# H200), 256 x 128, 128 x 192 (two 64 x 192 warpgroup tiles, one above the other), 64 x 256,
# 128 x 128, 64 x 128, and two of 128 x 192 warpgroup tiles (192 accumulator registers a
# thread): 256 x 192 and 128 x 384. Columns come in multiples of 64: a 160- or 224-column
# block takes a 64-byte swizzle, which Mosaic GPU's layout inference refuses (jax 0.10.2).
CTA_SHAPES = ((128, 128, "n"), (128, 128, "m"), (64, 192, "m"), (64, 128, "n"), (64, 128, "m"),
              (64, 64, "n"), (128, 192, "m"), (128, 192, "n"))
# The wave model's constants, fitted to the H200 sweep of 128x256 and 64x256 CTA tiles over
# square sizes 1024-4352 (bench/NOTES.md, matmul-35): an SM multiplies-and-adds 3.3e12 16-bit
# products a second within a tile, a wave of tiles costs 2.65 us more to start and finish, and a
# tile's rate falls with the bytes it loads per product, 1/cta_m + 1/cta_n, weighted so that
# 128 x 128 tiles run ~5% behind 128 x 256 ones (the ping-pong schedule's 128 x 128 tiles ran
# at a 6% lower clock at the power cap, matmul-19).
SM_PRODUCTS_PER_S = 3.3e12
WAVE_SECONDS = 2.65e-6
TILE_BYTES_WEIGHT = 16.0
# A CTA tile must be predicted this much faster than the first of CTA_SHAPES to displace it:
# the model's error on the sweep was ~7% RMS, and under the power cap larger tiles gain more.
WAVE_MARGIN = 0.05
# Stream-K's cut tiles ran slower a tile than whole ones on the H200, the more so the larger
# A and B: 12-20% at 3712^3-4096^3 (55-67 MB of bf16 operands), 30-50% at 4864^3-6272^3,
# 60-90% at 6912^3 and 8192^3 (bench/NOTES.md matmul-39). Runs at different K steps share few
# A and B blocks in the 50 MB L2, where whole tiles of one wave walk K together. Modelled as
# this fraction per GB of A and B.
STREAM_K_OVERHEAD_PER_GB = 3.0


def predicted_seconds(problem: Problem, config: Config, cores: int) -> float:
  """The wave model: a persistent grid of ``cores`` CTAs runs ``ceil(tiles / cores)`` waves of
  tiles, each wave as long as one tile's product plus a fixed start, however few SMs the last
  wave keeps busy. With stream-K the whole tiles take ``whole / cores`` waves and the cut ones
  ``cut / cores`` waves, slower by ``STREAM_K_OVERHEAD_PER_GB`` per GB of A and B. It ranks
  configs for one problem; it is not a timing."""
  c = config
  rate = SM_PRODUCTS_PER_S * (2 if jnp.dtype(problem.dtype).itemsize == 1 else 1)
  products = c.cta_m * c.cta_n * round_up(problem.k, c.tile_k)
  tile = products / rate * (1 + TILE_BYTES_WEIGHT * (1 / c.cta_m + 1 / c.cta_n))
  plan = _StreamK.plan(problem, c, cores)
  if not plan.cut:
    return cdiv(plan.whole, cores) * (tile + WAVE_SECONDS)
  operands = (problem.m + problem.n) * problem.k * jnp.dtype(problem.dtype).itemsize
  slower = 1 + STREAM_K_OVERHEAD_PER_GB * operands / 1e9
  return (plan.whole + plan.cut * slower) / cores * (tile + WAVE_SECONDS)


def heuristic(problem: Problem, chip: hardware.Chip, shapes=CTA_SHAPES) -> Config:
  """The CTA tile from ``shapes`` that the wave model (``predicted_seconds``) gives the
  fewest, fullest waves on ``chip``'s SMs, 64-deep K steps (128 for fp8: 128 bytes per row
  either way, the widest swizzle), tiles visited in snakes 16 wide along M. 128 x 256 tiles
  unless another is predicted ``WAVE_MARGIN`` faster: at 3072^3, say, they make 288 tiles,
  2.2 waves of 132 SMs with the third 18% full, where 128 x 192 tiles make 384 (2.9 waves);
  at 6528^3 they make 10.05 waves, where 256 x 192 tiles make 6.7 (the model: 10% faster).

  The epilogue, by what it computes (H200, bench/NOTES.md):
  * 16-bit products in 128 x 256 tiles (or cut by stream-K) run on the kernel's own ring
    (``ring``). Without an activation, with 64 x 64 pieces over 4 stages: against JAX's
    pipeline with whole-tile pieces over 3, the same at 8192^3 and 4096^3 or 1-3% faster,
    and 2-6% faster where the last wave is part-empty, in three runs (matmul-39). With one,
    in the activation pieces below: 8192^3 bias+gelu 0.7-1.0% faster than on the pipeline in
    two runs, 2.6% over the plain product where the pipeline took 3.4-3.6% (matmul-40).
  * Other 16-bit products without an activation, in 128-row warpgroup tiles, write each
    warpgroup's tile as one piece, stored once and awaited only at the next tile's epilogue,
    over 3 stages: 1.0-4.9% faster than 64 x 64 pieces over 4 stages at 8192^3 in three runs
    (matmul-27, -30, -31), 0.5-1.6% at 6144^3, -1.6 to +1.4% at 4096^3. 64-row tiles ran 15%
    slower so (2048^3) and keep 64 x 64 pieces.
  * Activation epilogues take 64 x 64 pieces in 2 buffers over 3 stages, so that a piece's
    arithmetic overlaps the previous piece's store: 2-3% faster at 8192^3 bias+gelu in three
    runs (matmul-22, -24), bias+silu 2%.
  * fp8 keeps 64 x 64 pieces in one buffer over 4 stages (its 1.8x over bf16, matmul-25);
    whole-tile pieces are not measured there.
  """
  shapes = [tile_config(problem, shape) for shape in shapes]
  seconds = [predicted_seconds(problem, c, chip.cores) for c in shapes]
  best = min(range(len(shapes)), key=seconds.__getitem__)
  base = shapes[best] if seconds[best] < (1 - WAVE_MARGIN) * seconds[0] else shapes[0]
  # Stream-K where the tile's last wave stays part-empty after at least one whole wave and
  # the model predicts it WAVE_MARGIN faster (with fewer tiles than that, the hand-over's fixed
  # costs outweighed the idle SMs: 1536^3 and 2176^3 ran 50% slower, matmul-39).
  streamed = dataclasses.replace(base, stream_k=True)
  if (_StreamK.plan(problem, streamed, chip.cores).whole
      and predicted_seconds(problem, streamed, chip.cores)
      < (1 - WAVE_MARGIN) * predicted_seconds(problem, base, chip.cores)):
    base = streamed
  elif (jnp.dtype(problem.dtype).itemsize == 2
        and (base.tile_m, base.tile_n, base.split) == (128, 128, "n")):
    base = dataclasses.replace(base, ring=True)
  return fitted(problem, base, chip)


def tile_config(problem: Problem, shape) -> Config:
  """The heuristic's starting Config for a CTA tile ``(tile_m, tile_n, split)``: 128-byte K
  steps, 4 stages, 64 x 64 epilogue pieces (``fitted`` then sizes the pieces and stages)."""
  tile_m, tile_n, split = shape
  return Config(tile_m=tile_m, tile_n=tile_n, tile_k=128 // jnp.dtype(problem.dtype).itemsize,
                stages=4, split=split, grid_minor="m", grid_tile_width=16, epi_tile_m=64,
                epi_tile_n=64, epi_slots=1)


def fitted(problem: Problem, base: Config, chip: hardware.Chip) -> Config:
  """``base``'s CTA tile with the heuristic's epilogue pieces and stages for ``problem``
  (see ``heuristic``), as many stages as shared memory holds."""
  item = jnp.dtype(problem.dtype).itemsize
  # Fewer stages or buffers where shared memory runs out (float32 outputs saved twice, say).
  candidates = []
  if problem.activation:
    candidates.append(dataclasses.replace(base, stages=3, epi_slots=2))
  elif item == 2 and base.tile_m == 128 and not base.on_ring:  # on the ring: 4% slower
    candidates.append(dataclasses.replace(base, stages=3, epi_tile_m=base.tile_m,
                                          epi_tile_n=base.tile_n))
  candidates += [dataclasses.replace(base, stages=stages) for stages in (4, 3, 2)]
  return next((c for c in candidates if config_error(problem, c, chip) is None), candidates[-1])


def unsupported(problem: Problem, chip: hardware.Chip) -> str | None:
  dtype = jnp.dtype(problem.dtype)
  if dtype not in DTYPES:
    return f"mosaic_gpu takes bfloat16, float16 or fp8 operands, got {dtype}"
  if dtype in FLOAT8 and problem.trans_a:
    return "fp8 wgmma reads A K-major; A stored transposed is not served"
  if problem.precision not in (None, lax.Precision.DEFAULT):
    return f"precision={problem.precision} has no meaning for {dtype} operands here"
  return None


def _swizzle_lanes(minor: int, dtype) -> int:
  """Elements in a swizzle tile's row, for a shared-memory block whose minor dimension is
  ``minor``: the widest swizzle its rows allow (at most 128 bytes)."""
  return plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8) // jnp.dtype(dtype).itemsize


def _swizzled(minor: int, dtype):
  """Tiling and swizzle transforms for a shared-memory block whose minor dimension is ``minor``."""
  lanes = _swizzle_lanes(minor, dtype)
  return (plgpu.TilingTransform((8, lanes)),
          plgpu.SwizzleTransform(lanes * jnp.dtype(dtype).itemsize))


class _Epilogue(NamedTuple):
  """Refs the epilogue reads and writes (outputs in gmem, their shared-memory buffers,
  vectors) and the 1/x its activation takes (None: division)."""

  y_smem: Any
  z_smem: Any
  bias_smem: Any
  as_smem: Any
  bs_smem: Any
  vec_barrier: Any
  res_barrier: Any
  bias_gmem: Any
  res_gmem: Any
  as_gmem: Any
  bs_gmem: Any
  y_gmem: Any
  z_gmem: Any
  math: Any  # _activations.Math

  @staticmethod
  def scratch(p: Problem, c: Config) -> dict:
    """The shared-memory allocations behind the first seven fields."""
    out_transforms = _swizzled(c.epi_tile_n, p.out_dtype)
    out_buffers = lambda: plgpu.SMEM((2, c.epi_slots, c.epi_tile_m, c.epi_tile_n), p.out_dtype,
                                     transforms=out_transforms)
    return dict(
        y_smem=out_buffers(),
        z_smem=out_buffers() if p.save_preactivation else None,
        # Epilogue vectors, per warpgroup and per tile parity (so that the next tile's load
        # never lands while a lagging warp still reads this tile's).
        bias_smem=plgpu.SMEM((2, 2, c.tile_n), jnp.float32) if p.has_bias else None,
        as_smem=plgpu.SMEM((2, 2, c.tile_m), jnp.float32) if p.has_scales else None,
        bs_smem=plgpu.SMEM((2, 2, c.tile_n), jnp.float32) if p.has_scales else None,
        vec_barrier=(plgpu.Barrier(num_barriers=2 * 2 * 3)
                     if p.has_bias or p.has_scales else None),
        res_barrier=plgpu.Barrier(num_barriers=2 * c.epi_slots) if p.has_residual else None,
    )

  def load_vectors(self, p: Problem, wg, parity, rows, cols, when=None) -> list:
    """Starts the TMA loads of this warpgroup's bias and scale pieces (only where ``when``
    holds, if given); returns their barriers."""
    loads = []
    if p.has_bias:
      loads.append((self.bias_gmem, self.bias_smem, cols))
    if p.has_scales:
      loads += [(self.as_gmem, self.as_smem, rows), (self.bs_gmem, self.bs_smem, cols)]
    barriers = [self.vec_barrier.at[(wg * 2 + parity) * 3 + which] for which in range(len(loads))]

    def start():
      for (gmem, smem, index), barrier in zip(loads, barriers):
        plgpu.copy_gmem_to_smem(gmem.at[index], smem.at[wg, parity], barrier)

    if loads:
      start() if when is None else pl.when(when)(start)
    return barriers


def _kernel(*refs, problem: Problem, config: Config, math):
  p, c = problem, config
  extra = {}
  if c.stream_k:  # the last output: the CTAs' float32 partial tiles
    *refs, extra["partials"] = refs
  a_gmem, b_gmem, bias_gmem, res_gmem, as_gmem, bs_gmem, y_gmem, z_gmem = split_refs(p, refs)
  scratch, body = _schedule(c)
  a_block = (c.tile_k, c.cta_m) if p.trans_a else (c.cta_m, c.tile_k)
  b_block = (c.cta_n, c.tile_k) if p.trans_b else (c.tile_k, c.cta_n)

  epilogue_scratch = _Epilogue.scratch(p, c)

  @functools.partial(pl.run_scoped, collective_axes="wg",
                     **scratch(p, c, a_block, b_block, a_gmem, b_gmem), **epilogue_scratch)
  def _scope(**allocs):
    epilogue = _Epilogue(**{k: allocs.pop(k) for k in epilogue_scratch},
                         bias_gmem=bias_gmem, res_gmem=res_gmem, as_gmem=as_gmem,
                         bs_gmem=bs_gmem, y_gmem=y_gmem, z_gmem=z_gmem, math=math)
    body(a_gmem, b_gmem, epilogue, problem=p, config=c, a_block=a_block, b_block=b_block,
         **allocs, **extra)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _tile_slices(linear, p: Problem, c: Config):
  """(rows, cols) of the CTA tile at position ``linear`` of the snake order."""
  m_tiles, n_tiles = cdiv(p.m, c.cta_m), cdiv(p.n, c.cta_n)
  minor = 1 if c.grid_minor == "n" else 0
  m_idx, n_idx = plgpu.planar_snake(linear, (m_tiles, n_tiles), minor, c.grid_tile_width)
  return pl.ds(m_idx * c.cta_m, c.cta_m), pl.ds(n_idx * c.cta_n, c.cta_n)


def _num_tiles(p: Problem, c: Config) -> int:
  return cdiv(p.m, c.cta_m) * cdiv(p.n, c.cta_n)


def _cooperative_pipeline(p, c, a_block, b_block, body, compute_context):
  """JAX's warp-specialized pipeline: both compute warpgroups read every slot."""
  in_specs = [
      plgpu.BlockSpec(a_block, (lambda k: (k, 0)) if p.trans_a else (lambda k: (0, k)),
                      transforms=_swizzled(a_block[1], p.dtype), memory_space=plgpu.SMEM),
      plgpu.BlockSpec(b_block, (lambda k: (0, k)) if p.trans_b else (lambda k: (k, 0)),
                      transforms=_swizzled(b_block[1], p.dtype), memory_space=plgpu.SMEM),
  ]
  return plgpu.emit_pipeline_warp_specialized(
      body, grid=(cdiv(p.k, c.tile_k),), memory_registers=PRODUCER_REGISTERS,
      in_specs=in_specs, wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=c.stages,
      compute_context=compute_context)


def _cooperative_scratch(p, c, a_block, b_block, a_gmem, b_gmem) -> dict:
  ignore = lambda *_, **__: None
  pipeline = _cooperative_pipeline(p, c, a_block, b_block, ignore, ignore)
  return dict(pipeline_allocs=pipeline.get_allocations(a_gmem, b_gmem))


def _cooperative(a_gmem, b_gmem, epilogue: _Epilogue, *, problem, config, a_block, b_block,
                 pipeline_allocs):
  """Both compute warpgroups on one CTA tile, each on its half (``split``)."""
  p, c = problem, config
  wg = lax.axis_index("wg")

  @plgpu.nd_loop((_num_tiles(p, c),), collective_axes="sm")
  def _tiles(info: plgpu.NDLoopInfo):
    (linear,) = info.index
    parity = info.local_index % 2
    cta_rows, cta_cols = _tile_slices(linear, p, c)
    wg_rows, wg_cols = _halves(c, wg)

    def compute_context(eval_pipeline):
      # The epilogue's vectors load while the main loop runs.
      waits = epilogue.load_vectors(p, wg, parity, _sub(cta_rows, wg_rows, c.tile_m),
                                    _sub(cta_cols, wg_cols, c.tile_n))

      @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((c.tile_m, c.tile_n), jnp.float32))
      def _acc(acc_ref):
        with jax.named_scope("mainloop"):  # regions of a Mosaic GPU profile (profile_space)
          eval_pipeline(acc_ref)
        with jax.named_scope("epilogue"):
          acc = acc_ref[...]
          for barrier in waits:
            plgpu.barrier_wait(barrier)
          _write_tile(acc, epilogue, wg, parity, cta_rows, cta_cols, wg_rows, wg_cols,
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
  return dict(
      a_ring=plgpu.SMEM((c.stages, *a_block), p.dtype, transforms=_swizzled(a_block[1], p.dtype)),
      b_ring=plgpu.SMEM((c.stages, *b_block), p.dtype, transforms=_swizzled(b_block[1], p.dtype)),
      # Two TMA copies (A and B) arrive on a slot's "full" barrier; its readers on "free".
      full=plgpu.Barrier(num_arrivals=2, num_barriers=owners * c.stages),
      free=plgpu.Barrier(num_arrivals=2 if c.cooperative else 1, num_barriers=c.stages),
  )


class _StreamK(NamedTuple):
  """How stream-K deals out the tiles. The first ``whole`` tiles of the snake order are
  walked whole, ``whole / ctas`` a CTA. The K steps of the other ``cut`` tiles, tile after
  tile (``steps`` in all), are cut into ``runs`` runs of consecutive steps as equal as
  integers allow, run r for CTA r; a run may end one tile and begin the next. Where tiles
  are left over after whole waves, they are cut, with one whole wave more where
  ``stream_k_wave`` (so that a run is one to two tiles long rather than a sliver of one);
  with no tiles left over nothing is cut.
  """

  whole: int
  cut: int
  k_steps: int
  ctas: int
  runs: int

  @staticmethod
  def plan(p: Problem, c: Config, ctas: int) -> _StreamK:
    tiles, k_steps = _num_tiles(p, c), cdiv(p.k, c.tile_k)
    if not c.stream_k:
      return _StreamK(tiles, 0, k_steps, ctas, 0)
    waves, left = divmod(tiles, ctas)
    whole = tiles if not left else max(waves - c.stream_k_wave, 0) * ctas
    cut = tiles - whole
    return _StreamK(whole, cut, k_steps, ctas, min(ctas, cut * k_steps))

  @property
  def steps(self) -> int:
    return self.cut * self.k_steps

  @property
  def whole_per_cta(self) -> int:
    return self.whole // self.ctas

  def start(self, run):
    """The first of the cut tiles' K steps in ``run`` (a traced index; ``steps`` past the
    last run)."""
    return lax.div(lax.min(run, self.runs) * self.steps, self.runs)

  def last_run(self, tile):
    """The last run holding some of cut tile ``tile``'s K steps."""
    return lax.min(self.runs - 1, lax.div((tile + 1) * self.k_steps * self.runs - 1, self.steps))

  def walk(self, cta, body):
    """Calls ``body(tile, k_begin, k_end, first, seq)`` for each piece of ``cta``'s run in
    order: cut tile ``tile``'s K steps [k_begin, k_end), which take ring positions from
    ``first`` on, the CTA's piece ``seq`` counting its whole tiles."""
    start, end = self.start(cta), self.start(cta + 1)
    k = self.k_steps

    @pl.when(start < end)
    def _():
      first_tile = lax.div(start, k)

      @pl.loop(first_tile, lax.div(end - 1, k) + 1)
      def _(tile):
        k_begin = lax.max(start - tile * k, 0)
        k_end = lax.min(end - tile * k, k)
        body(tile, k_begin, k_end, self.whole_per_cta * k + tile * k + k_begin - start,
             self.whole_per_cta + tile - first_tile)

  def positions(self, cta):
    """Ring positions ``cta`` fills in all: its whole tiles' K steps and its run's."""
    return self.whole_per_cta * self.k_steps + self.start(cta + 1) - self.start(cta)


def _fill(a_gmem, b_gmem, a_ring, b_ring, full, full_base, free, p: Problem, c: Config, rows,
          cols, first, k_begin, k_end):
  """TMA loads of K steps [k_begin, k_end) of the blocks at (rows, cols) into ring positions
  ``first`` on (the owner's "full" barriers start at ``full_base``), each once its slot is
  free."""

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
    plgpu.copy_gmem_to_smem(b_gmem.at[cols, ks] if p.trans_b else b_gmem.at[ks, cols],
                            b_ring.at[slot], full.at[full_base + slot])


def _multiply(acc_ref, a_ring, b_ring, full, full_base, free, p: Problem, c: Config, wg_rows,
              wg_cols, first, k_begin, k_end):
  """wgmma over the ring positions ``first`` on (K steps [k_begin, k_end)), one product in
  flight while the next is issued, each slot released once the product after it is issued;
  the last product is awaited and its slot released."""

  def step_body(step):
    slot = lax.rem(first + step - k_begin, c.stages)
    plgpu.barrier_wait(full.at[full_base + slot])
    a, b = _my_part(a_ring.at[slot], b_ring.at[slot], p, c, wg_rows, wg_cols)
    plgpu.wgmma(acc_ref, *_operands(a, b, p))
    # Two products in flight: the previous one has finished reading its slot.
    plgpu.wgmma_wait(1)

    @pl.when(step > k_begin)
    def _():
      plgpu.barrier_arrive(free.at[lax.rem(first + step - k_begin - 1, c.stages)])

  with jax.named_scope("mainloop"):  # regions of a Mosaic GPU profile (profile_space)
    pl.loop(k_begin, k_end)(step_body)
  plgpu.wgmma_wait(0)
  plgpu.barrier_arrive(free.at[lax.rem(first + k_end - k_begin - 1, c.stages)])


def _ring(a_gmem, b_gmem, epilogue: _Epilogue, *, problem, config, a_block, b_block,
          a_ring, b_ring, full, free, partials=None):
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

  Stream-K (``_StreamK``): after its whole tiles each CTA walks its run of the cut tiles'
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
  plan = _StreamK.plan(p, c, ctas)
  tiles = lambda body: plgpu.nd_loop((plan.whole,), collective_axes="sm")(body)
  owner_of = lambda local_index: 0 if c.cooperative else local_index % 2
  sems = pl.get_global(plgpu.SemaphoreType.REGULAR((ctas * 2,))) if plan.cut else None

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    @tiles
    def _(info: plgpu.NDLoopInfo):
      rows, cols = _tile_slices(info.index[0], p, c)
      _fill(a_gmem, b_gmem, a_ring, b_ring, full, owner_of(info.local_index) * c.stages, free,
            p, c, rows, cols, info.local_index * k_steps, 0, k_steps)

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
    plgpu.set_max_registers(_compute_registers(), action="increase")
    wg_rows, wg_cols = _halves(c, wg) if c.cooperative else (slice(None), slice(None))

    def product(tile, parity, first, k_begin, k_end, full_base, finish, load_when=None):
      """The product of K steps [k_begin, k_end) of ``tile`` into a fresh accumulator,
      which ``finish(acc, cta_rows, cta_cols, waits, parity)`` takes."""
      cta_rows, cta_cols = _tile_slices(tile, p, c)
      waits = epilogue.load_vectors(p, wg, parity, _sub(cta_rows, wg_rows, c.tile_m),
                                    _sub(cta_cols, wg_cols, c.tile_n), when=load_when)

      @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((c.tile_m, c.tile_n), jnp.float32))
      def _acc(acc_ref):
        _multiply(acc_ref, a_ring, b_ring, full, full_base, free, p, c, wg_rows, wg_cols, first,
                  k_begin, k_end)
        with jax.named_scope("epilogue"):
          finish(acc_ref[...], cta_rows, cta_cols, waits, parity)

    def write(acc, cta_rows, cta_cols, waits, parity):
      for barrier in waits:
        plgpu.barrier_wait(barrier)
      _write_tile(acc, epilogue, wg, parity, cta_rows, cta_cols, wg_rows, wg_cols,
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
              return acc + plgpu.load(partials, (run, wg), layout=plgpu.Layout.WGMMA,
                                       optimized=False)

            total = lax.fori_loop(cta + 1, plan.last_run(tile) + 1, add, acc)
            write(total, cta_rows, cta_cols, waits, parity)

        product(plan.whole + tile, seq % 2, first, k_begin, k_end, 0, finish,
                load_when=k_begin == 0)

      plan.walk(cta, piece)


def _schedule(c: Config):
  """(scratch, body) of the kernel's main loop: JAX's pipeline or the kernel's own ring."""
  return (_ring_scratch, _ring) if c.on_ring else (_cooperative_scratch, _cooperative)


def _compute_registers() -> int:
  """Registers a thread of each compute warpgroup may take: the SM's 64K registers less the
  producer's, split two ways, in multiples of 8 and at most 255 (as JAX's pipeline does)."""
  return int(min(256, (512 - PRODUCER_REGISTERS) / 2) // 8 * 8)


def _halves(c: Config, wg):
  """(rows, cols) of a cooperative warpgroup's half of the CTA tile, relative to it."""
  if c.split == "m":
    return pl.ds(wg * c.tile_m, c.tile_m), slice(None)
  return slice(None), pl.ds(wg * c.tile_n, c.tile_n)


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
  a = plgpu.transpose_ref(a, (1, 0)) if p.trans_a else a
  b = plgpu.transpose_ref(b, (1, 0)) if p.trans_b else b
  return a, b


def _sub(cta_slice, wg_slice, size):
  """The warpgroup's part of a CTA range, as one pl.ds."""
  if isinstance(wg_slice, slice):
    return cta_slice
  return pl.ds(cta_slice.start + wg_slice.start, size)


def _write_tile(acc, e: _Epilogue, wg, parity, cta_rows, cta_cols, wg_rows, wg_cols, *,
                problem, config):
  """The epilogue on a warpgroup's float32 tile, written through shared memory by TMA.

  Where C is not a whole number of CTA tiles, pieces that would start past its end are not
  stored (a TMA copy starting past an array's end came out wrong, ``_padded_extent``), so C
  needs no padding to whole tiles; pieces that start inside and run past the end are clipped.
  """
  p, c = problem, config
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  pieces_n = c.tile_n // c.epi_tile_n
  c_rows, c_cols = e.y_gmem.shape
  ragged = c_rows % c.cta_m != 0 or c_cols % c.cta_n != 0
  row0 = _sub(cta_rows, wg_rows, c.tile_m).start
  col0 = _sub(cta_cols, wg_cols, c.tile_n).start
  for pm in range(c.tile_m // c.epi_tile_m):
    for pn in range(pieces_n):
      rows = slice(pm * c.epi_tile_m, (pm + 1) * c.epi_tile_m)
      cols = slice(pn * c.epi_tile_n, (pn + 1) * c.epi_tile_n)
      slot = (pm * pieces_n + pn) % c.epi_slots
      dest = lambda gmem: gmem.at[cta_rows, cta_cols].at[wg_rows, wg_cols].at[rows, cols]
      shape = (c.epi_tile_m, c.epi_tile_n)
      z = acc[rows, cols]
      if p.has_scales:
        a_scale = e.as_smem[wg, parity, rows]
        b_scale = e.bs_smem[wg, parity, cols]
        z = z * lax.broadcast_in_dim(a_scale, shape, [0]) * lax.broadcast_in_dim(b_scale, shape, [1])
      if p.has_bias:
        z = z + lax.broadcast_in_dim(e.bias_smem[wg, parity, cols], shape, [1])
      y = z if p.activation is None else activation_apply(p.activation, z, e.math)
      # Buffer `slot` was last stored epi_slots pieces ago: wait until that store has read it.
      # Only now, so that this piece's arithmetic runs while the earlier store drains (the
      # wait is a barrier the compiler cannot hoist the arithmetic across).
      plgpu.wait_smem_to_gmem(c.epi_slots - 1, wait_read_only=True)
      if p.has_residual:
        barrier = e.res_barrier.at[wg * c.epi_slots + slot]
        plgpu.copy_gmem_to_smem(dest(e.res_gmem), e.y_smem.at[wg, slot], barrier)
        plgpu.barrier_wait(barrier)
        y = y + e.y_smem[wg, slot].astype(jnp.float32)
      e.y_smem[wg, slot] = y.astype(p.out_dtype)
      if e.z_smem is not None:
        e.z_smem[wg, slot] = z.astype(p.out_dtype)
      plgpu.commit_smem()

      def store(slot=slot, dest=dest):
        plgpu.copy_smem_to_gmem(e.y_smem.at[wg, slot], dest(e.y_gmem))
        if e.z_smem is not None:
          plgpu.copy_smem_to_gmem(e.z_smem.at[wg, slot], dest(e.z_gmem))

      if ragged:
        pl.when((row0 + rows.start < c_rows) & (col0 + cols.start < c_cols))(store)
      else:
        store()


def _padded_extent(size: int, align: int, cta: int, step: int) -> int:
  """How far to pad a dimension of ``size`` that the kernel reads in ``cta`` blocks, cut into
  ``step`` pieces (warpgroup halves, epilogue pieces): to a multiple of ``align``, or of
  ``cta`` where some piece of the last block would start at or past the padded end.

  A TMA copy whose start lies past the array's end came out wrong on an H200 ((6, 1027) @
  (1027, 2), bench/NOTES.md); pieces that start inside and run past the end are fine (TMA
  zero-fills and clips them).
  """
  padded = round_up(size, align)
  last_piece = (cdiv(size, cta) - 1) * cta + cta - step
  return padded if last_piece < padded else round_up(size, cta)


def _as_stored(p: Problem) -> Problem:
  """``p`` as the kernel runs it: fp8 wgmma reads both operands K-major, so an fp8 B is stored
  (N, K) (``matmul`` transposes one that is not)."""
  if jnp.dtype(p.dtype) in FLOAT8 and not p.trans_b:
    return dataclasses.replace(p, trans_b=True)
  return p


def padded_shapes(p: Problem, c: Config) -> tuple[tuple[int, int], ...]:
  """The shapes A and B are zero-padded to, and the shape of the C the kernel writes.

  The kernel reads only [0, m) x [0, k) of A and [0, k) x [0, n) of B whatever the padding;
  past those, TMA zero-fills (or reads the pad's zeros), so the K tail adds nothing. Swizzled
  TMA wants each array's rows in multiples of 8 and each row in multiples of 128 bytes, and no
  copy may start past an array's end. A and B are read in whole CTA blocks, which start inside
  them. C's pieces past its end are not stored (``_write_tile``); the residual, read piece by
  piece through C's buffers, has C's shape, so C is padded so that none of them starts past
  its end when there is one.
  """
  lanes = 128 // jnp.dtype(p.dtype).itemsize
  out_lanes = 128 // jnp.dtype(p.out_dtype).itemsize
  m_step = min(c.tile_m, c.epi_tile_m) if p.has_residual else c.cta_m
  n_step = min(c.tile_n, c.epi_tile_n) if p.has_residual else c.cta_n
  m_rows = _padded_extent(p.m, 8, c.cta_m, m_step)
  n_out = _padded_extent(p.n, out_lanes, c.cta_n, n_step)
  k_in = _padded_extent(p.k, lanes, c.tile_k, c.tile_k)
  n_in = _padded_extent(p.n, lanes if not p.trans_b else 8, c.cta_n, c.cta_n)
  m_in = _padded_extent(p.m, lanes if p.trans_a else 8, c.cta_m, c.cta_m)
  k_rows = _padded_extent(p.k, 8, c.tile_k, c.tile_k)
  return ((k_rows, m_in) if p.trans_a else (m_in, k_in),
          (n_in, k_in) if p.trans_b else (k_rows, n_in),
          (m_rows, n_out))


def matmul(a, b, *, bias=None, residual=None, a_scale=None, b_scale=None, problem: Problem,
           config: Config, interpret=False):
  p = _as_stored(problem)
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
  out = jax.ShapeDtypeStruct(out_shape, p.out_dtype)
  ctas = _num_sms() if c.stream_k else min(_num_sms(), _num_tiles(p, config))
  # Stream-K's partial tiles: one per CTA, each warpgroup's half in its own slot.
  partials = ([jax.ShapeDtypeStruct((ctas, 2, c.tile_m, c.tile_n), jnp.float32)]
              if c.stream_k else [])
  kernel = plgpu.kernel(
      functools.partial(_kernel, problem=p, config=config,
                        math=mosaic_gpu_math(interpret)),
      out_type=[out] * p.outputs + partials,
      grid=(ctas,),
      grid_names=("sm",),
      num_threads=3,
      thread_name="wg",
      # approx_math: the activation's exp2 on the SFU (ex2.approx.ftz, 2 ulp), as the Triton
      # kernels do; its reciprocal is rcp.approx.ftz by inline PTX (mosaic_gpu_fast_reciprocal)
      # wherever the kernel is compiled. Nothing else in the kernel takes either.
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
          approx_math=p.activation is not None, **PROFILE),
      **({"interpret": interpret} if interpret else {}),
  )
  outs = kernel(*operands)[:p.outputs]
  outs = [_crop(o, p.m, p.n, interpret) for o in outs]
  return tuple(outs) if p.save_preactivation else outs[0]


def _crop(y, m: int, n: int, interpret):
  if CROP == "xla":
    return y[:m, :n]
  return crop.crop(y, m, n, interpret=bool(interpret))


def _num_sms() -> int:
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  if device is not None and getattr(device, "num_cores", None):
    return device.num_cores
  device = jax.devices()[0]
  return getattr(device, "core_count", None) or hardware.DEFAULT_GPU.cores
