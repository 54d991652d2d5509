"""The Mosaic GPU matmul's Config, the wave model that chooses a CTA tile, and how stream-K
deals out the tiles: arithmetic on shapes, no kernel code (that is ``kernel``)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkernels import _mosaic_gpu, hardware
from jaxkernels._tiling import cdiv, check_fields, round_up
from jaxkernels.ops.matmul.common import FLOAT8, Problem
from jaxkernels.ops.matmul.mosaic_gpu.padding import as_stored

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), *FLOAT8)
SPLITS = ("m", "n")
SCHEDULES = ("cooperative", "pingpong")
PRODUCER_REGISTERS = 40  # the TMA warpgroup's; the two compute warpgroups share the rest
CROPS = ("triton", "xla")




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
  # How a padded C is cut to (m, n) (see ``padding``): "triton", a copy kernel, or "xla", a
  # slice (0.86 TB/s at 8193^3 bf16 on an H200 against the copy kernel's 2.3, matmul-30).
  crop: str = "triton"
  # With profile_space > 0, every CTA records when each warpgroup enters and leaves its
  # "mainloop" and "epilogue" regions (Mosaic GPU's in-kernel profiler, that many entries a
  # warpgroup) and writes the timeline under profile_dir: how matmul-18/19 and -31 were read.
  profile_space: int = 0
  profile_dir: str = ""

  def __post_init__(self):
    check_fields(self, ("tile_m", "epi_tile_m"), lambda v: v % 64 == 0,
                 "a multiple of 64 (wgmma's M per warpgroup)")
    check_fields(self, ("tile_n", "tile_k", "epi_tile_n"), lambda v: v % 32 == 0 and v <= 256,
                 "a multiple of 32, at most 256")
    check_fields(self, ("stages", "grid_tile_width", "epi_slots"), lambda v: v >= 1, ">= 1")
    check_fields(self, ("split", "grid_minor"), lambda v: v in SPLITS, "'m' or 'n'")
    check_fields(self, ("schedule",), lambda v: v in SCHEDULES, f"one of {SCHEDULES}")
    check_fields(self, ("crop",), lambda v: v in CROPS, f"one of {CROPS}")
    if self.profile_space and not self.profile_dir:
      raise ValueError(f"profile_space={self.profile_space} needs a profile_dir to write to")
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
  # y's buffer, and z's (both halves of it under glu).
  buffers = 1 + (problem.outputs - 1) * (2 if problem.glu else 1)
  epilogue = 2 * c.epi_slots * c.epi_tile_m * c.epi_tile_n * out_item * buffers
  vectors = 2 * 2 * 4 * (c.tile_m + 2 * c.tile_n)
  block_scales = c.stages * (c.cta_m + c.cta_n) * 4 if problem.block_k else 0
  return ring + epilogue + vectors + block_scales + 2048  # barriers and alignment


def config_error(problem: Problem, config: Config, chip) -> str | None:
  """Why ``config`` cannot run ``problem`` on ``chip`` (None: a stand-in Hopper), or None."""
  p, c = as_stored(problem), config
  limit = _mosaic_gpu.cta_smem_bytes(chip)
  if (need := shared_bytes(p, c)) > limit:
    return f"needs {need} bytes of shared memory per CTA; Hopper has {limit}"
  if p.glu:
    return _glu_error(p, c)
  if p.block_k and (error := _block_error(p, c)):
    return error
  # A cooperative warpgroup's half of a block cut along the block's minor dimension must
  # start on a swizzle tile (``_my_part``): B's columns (split "n"), or A's stored transposed.
  cut = {"n": (not p.trans_b, c.tile_n, c.cta_n), "m": (p.trans_a, c.tile_m, c.cta_m)}
  along_minor, half, block = cut[c.split]
  if c.cooperative and along_minor:
    lanes = _mosaic_gpu.swizzle_lanes(block, p.dtype)
    if half % lanes:
      return (f"split={c.split!r} cuts the CTA's {block}-wide block into warpgroup halves of "
              f"{half}, which must be a multiple of its {lanes}-element swizzle tile")
  return None


# A warpgroup's accumulator registers a thread under block scales: the running sum and the K
# step's product, 64 x 128 each (64 + 64 of the ~232 a compute thread has).
BLOCK_ACCUMULATORS = 64 * 128


def block_tile_k(p: Problem) -> int:
  """The K step of a block-scaled product: one scale block, or 128 bytes of it (the widest
  swizzle) where the block is deeper (its scales are then repeated over its steps)."""
  return min(p.block_k, 128 // jnp.dtype(p.dtype).itemsize)


def _block_error(p: Problem, c: Config) -> str | None:
  """Why ``c`` cannot run the block-scaled product ``p`` (``kernel._multiply_blocks``)."""
  if not (c.on_ring and c.cooperative) or c.stream_k:
    return ("block scales run on the kernel's own ring (ring=True), cooperative, without "
            "stream_k")
  if c.tile_k != block_tile_k(p):
    return (f"block scales {p.block_k} deep take K steps of {block_tile_k(p)} (one block, or "
            f"128 bytes of it), got tile_k={c.tile_k}")
  if c.tile_m * c.tile_n > BLOCK_ACCUMULATORS:
    return (f"block scales keep two accumulators a warpgroup: its tile must be at most "
            f"{BLOCK_ACCUMULATORS} elements (64 x 128), got {c.tile_m} x {c.tile_n}")
  return None


def _glu_error(p: Problem, c: Config) -> str | None:
  """Why ``c`` cannot run the gated product ``p`` (``kernel``: each warpgroup multiplies A by a
  gate block and an up block into two accumulators of half its tile's width, and writes y
  from them), or None."""
  if not c.on_ring or c.stream_k:
    return ("glu runs on the kernel's own ring (ring=True or schedule='pingpong'), without "
            "stream_k")
  half = c.tile_n // 2
  lanes = _mosaic_gpu.swizzle_lanes(c.cta_n // 2, p.dtype)
  if half % lanes:
    return (f"glu cuts each warpgroup's {c.tile_n} columns into gate and up halves of {half}, "
            f"which must be a multiple of the {lanes}-element swizzle tile")
  if half % c.epi_tile_n:
    return f"epi_tile_n={c.epi_tile_n} must divide the warpgroup's {half}-column gate half"
  if p.out_n % (c.cta_n // 2):
    return (f"glu needs y's {p.out_n} columns in whole CTA tiles of {c.cta_n // 2} (so that "
            f"no gate block runs into the up half)")
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
# square sizes 1024-4352 (notes/tiles.md, matmul-35): an SM multiplies-and-adds 3.3e12 16-bit
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
# 60-90% at 6912^3 and 8192^3 (notes/tiles.md matmul-39). Runs at different K steps share few
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
  plan = StreamK.plan(problem, c, cores)
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

  The epilogue, by what it computes (H200, notes/matmul.md):
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
  if problem.glu:
    return _glu_heuristic(problem, chip, shapes)
  if problem.block_k:
    return _block_heuristic(problem, chip)
  shapes = [tile_config(problem, shape) for shape in shapes]
  seconds = [predicted_seconds(problem, c, chip.cores) for c in shapes]
  best = min(range(len(shapes)), key=seconds.__getitem__)
  base = shapes[best] if seconds[best] < (1 - WAVE_MARGIN) * seconds[0] else shapes[0]
  # Stream-K where the tile's last wave stays part-empty after at least one whole wave and
  # the model predicts it WAVE_MARGIN faster (with fewer tiles than that, the hand-over's fixed
  # costs outweighed the idle SMs: 1536^3 and 2176^3 ran 50% slower, matmul-39).
  streamed = dataclasses.replace(base, stream_k=True)
  if (StreamK.plan(problem, streamed, chip.cores).whole
      and predicted_seconds(problem, streamed, chip.cores)
      < (1 - WAVE_MARGIN) * predicted_seconds(problem, base, chip.cores)):
    base = streamed
  elif (jnp.dtype(problem.dtype).itemsize == 2
        and (base.tile_m, base.tile_n, base.split) == (128, 128, "n")):
    base = dataclasses.replace(base, ring=True)
  return fitted(problem, base, chip)


def _glu_heuristic(problem: Problem, chip: hardware.Chip, shapes) -> Config:
  """The gated product's config: on the ring (``_glu_error``), the first of ``shapes`` that
  can run it unless the wave model predicts another ``WAVE_MARGIN`` faster; the activation
  epilogue's pieces and stages (``fitted``)."""
  ring = lambda shape: fitted(problem, dataclasses.replace(tile_config(problem, shape),
                                                           ring=True), chip)
  configs = [c for c in map(ring, shapes) if config_error(problem, c, chip) is None]
  if not configs:
    raise ValueError(f"no CTA tile runs the gated product {problem}: {unsupported(problem, chip)}")
  seconds = [predicted_seconds(problem, c, chip.cores) for c in configs]
  best = min(range(len(configs)), key=seconds.__getitem__)
  return configs[best] if seconds[best] < (1 - WAVE_MARGIN) * seconds[0] else configs[0]


def _block_heuristic(problem: Problem, chip: hardware.Chip) -> Config:
  """The block-scaled product's config: 64 x 128 warpgroup tiles one above the other (a 128 x
  128 CTA tile, two accumulators each: ``_block_error``), a K step a scale block, on the
  ring, as many stages as fit (``fitted``)."""
  base = dataclasses.replace(tile_config(problem, (64, 128, "m")), tile_k=block_tile_k(problem),
                             ring=True)
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
  if (reason := _mosaic_gpu.hopper_reason(chip)) is not None:
    return reason
  dtype = jnp.dtype(problem.dtype)
  if dtype not in DTYPES:
    return f"mosaic_gpu takes bfloat16, float16 or fp8 operands, got {dtype}"
  if dtype in FLOAT8 and problem.trans_a:
    return "fp8 wgmma reads A K-major; A stored transposed is not served"
  if problem.precision not in (None, lax.Precision.DEFAULT):
    return f"precision={problem.precision} has no meaning for {dtype} operands here"
  if problem.block_k:
    if problem.block_n < 1:
      return f"block_k={problem.block_k} needs block_n, the columns a b_scale entry covers"
    step = 32 if dtype in FLOAT8 else 16  # wgmma's K
    if problem.block_k % step or (problem.block_k > block_tile_k(problem)
                                  and problem.block_k % block_tile_k(problem)):
      return (f"mosaic_gpu takes block scales a multiple of {step} deep up to "
              f"{block_tile_k(problem)}, a multiple of {block_tile_k(problem)} beyond, got "
              f"{problem.block_k}")
    if problem.glu or problem.trans_a:
      return "mosaic_gpu takes block scales on a plain product of A stored (M, K)"
  if problem.glu:
    if (dtype in FLOAT8 or problem.trans_a or problem.trans_b or problem.has_bias
        or problem.has_residual):
      return ("mosaic_gpu fuses glu into a plain 16-bit product (no bias, residual or scales; "
              "A and B stored (M, K) and (K, N))")
    if problem.out_n % 64:
      return (f"mosaic_gpu fuses glu where y's width is a multiple of 64 (whole 64-column "
              f"swizzle tiles a half), got {problem.out_n}")
  return None


def num_tiles(p: Problem, c: Config) -> int:
  return cdiv(p.m, c.cta_m) * cdiv(p.n, c.cta_n)



class StreamK(NamedTuple):
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
  def plan(p: Problem, c: Config, ctas: int) -> StreamK:
    tiles, k_steps = num_tiles(p, c), cdiv(p.k, c.tile_k)
    if not c.stream_k:
      return StreamK(tiles, 0, k_steps, ctas, 0)
    waves, left = divmod(tiles, ctas)
    whole = tiles if not left else max(waves - c.stream_k_wave, 0) * ctas
    cut = tiles - whole
    return StreamK(whole, cut, k_steps, ctas, min(ctas, cut * k_steps))

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
