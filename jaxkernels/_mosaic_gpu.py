"""Pallas Mosaic GPU (Hopper) commons: the interpreter, the epilogue's arithmetic, shared-memory
swizzles, register budgets of warp-specialized kernels, the SM count, and the row kernels' walk
over whole rows."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax import lax
from jax.experimental import pallas as pl

from jaxkernels import _activations, hardware
from jaxkernels._tiling import cdiv, check_fields


def interpret_params() -> Any:
  """The Mosaic GPU interpreter's params (threads, barriers, TMA and wgmma run on the CPU).

  jax 0.10-0.11 keep the class private; this is the one place that names it. Its warpgroups
  are threads whose barrier waits block inside host callbacks, which XLA:CPU runs on a pool of
  ``NPROC`` threads (default: the cores): with fewer than about eight, waiting warpgroups can
  starve the one they wait for and the kernel hangs. Set ``NPROC=8`` (or more) in the
  environment before jax starts; the tests do.
  """
  from jax._src.pallas.mosaic_gpu.interpret import params
  return params.InterpretGPUParams()


def reading_zeros_past_the_end(interpret):
  """``interpret`` (False, True or params) for a kernel whose bulk copies run past an
  array's end: interpreted, such reads give zeros, as the hardware's do (the interpreter's
  default raises)."""
  if not interpret:
    return interpret
  params = interpret if not isinstance(interpret, bool) else interpret_params()
  return dataclasses.replace(params, out_of_bounds_reads="uninitialized",
                             uninitialized_memory="zero")


# What the kernels call of Mosaic GPU's API (tests/test_structure.py keeps it complete): a JAX
# release without one of these cannot run them, and dispatch says so instead of failing.
API = ("ACC", "Barrier", "BlockSpec", "CompilerParams", "Layout", "LoweringSemantics", "NDLoopInfo",
       "SMEM", "SemaphoreType", "ShapeDtypeStruct", "SwizzleTransform", "TilingTransform",
       "barrier_arrive", "barrier_wait", "broadcasted_iota", "commit_smem", "copy_gmem_to_smem",
       "copy_smem_to_gmem", "emit_pipeline", "emit_pipeline_warp_specialized", "find_swizzle",
       "inline_mgpu", "kernel", "layout_cast", "load", "nd_loop", "planar_snake",
       "semaphore_signal", "semaphore_wait", "set_max_registers", "wait_smem_to_gmem", "wgmma",
       "wgmma_accumulator_load", "wgmma_wait")


# Where Mosaic GPU's API moved between the JAX releases we run on (0.10 to 0.12), the kernels
# call these, and only these ask which release is here: at trace time, never at import.


@functools.cache
def _load_index() -> str:
  """How ``plgpu.load`` takes an index: "required" (jax 0.10), "deprecated" (0.11: optional),
  or "gone" (0.12: index the ref instead)."""
  parameter = inspect.signature(plgpu.load).parameters.get("idx")
  if parameter is None:
    return "gone"
  return "required" if parameter.default is inspect.Parameter.empty else "deprecated"


def load(ref, idx: tuple = (), *, layout, optimized: bool = True):
  """``ref[idx]`` from shared memory into registers in ``layout``, on every release."""
  if _load_index() == "required":
    return plgpu.load(ref, idx, layout=layout, optimized=optimized)
  # jax 0.11 warns where the index is passed apart (jax-pallas-mgpu-load-idx): index the ref.
  return plgpu.load(ref.at[idx] if idx != () else ref, layout=layout, optimized=optimized)


def transposed(ref):
  """A transposed view of a 2-D shared-memory block: ``ref.T`` where refs have it (jax 0.11
  on; ``transpose_ref`` is deprecated there), else ``transpose_ref`` (jax 0.10). Named only
  here, outside ``API``: reading a deprecated name off the module warns (dispatch's
  ``missing_api`` once did, on jax 0.12), and a JAX without it has ``ref.T``."""
  try:
    return ref.T
  except (AttributeError, NotImplementedError, TypeError):
    return getattr(plgpu, "transpose_ref")(ref, (1, 0))  # noqa: B009 - see above


def fast_reciprocal(x, layout=None):
  """1/x by rcp.approx.ftz.f32 in a compiled Mosaic GPU kernel, for a float32 array in
  registers in ``layout`` (default: the WGMMA layout of a matmul epilogue's pieces; a row
  kernel's chunks pass their WG_STRIDED one).

  Pallas lowers 1/x under approx_math to rcp.approx.f32, whose subnormal and overflow range
  fix-ups take six SASS instructions besides the one MUFU.RCP (the matmul epilogue's SASS,
  notes/matmul.md matmul-24): in an issue-bound elementwise kernel, a fifth of its
  instructions (mgpu-rows-1). Mosaic GPU exposes no reciprocal, so this reaches
  FragmentedArray's PTX helpers (jax 0.10-0.12); where a release lacks them, exact division.
  """
  from jax.experimental.mosaic import gpu as mgpu
  if not all(hasattr(mgpu.FragmentedArray, f) for f in ("_pointwise", "_lift_fast_instr")):
    return 1.0 / x
  layout = plgpu.Layout.WGMMA if layout is None else layout

  @plgpu.inline_mgpu(arg_types=(layout,),
                     return_type=plgpu.ShapeDtypeStruct(x.shape, jnp.float32, layout=layout))
  def rcp(_, v):
    return v._pointwise(v._lift_fast_instr("rcp.approx.ftz.f32"))
  return rcp(x)


def math(interpret, layout=None) -> _activations.Math:
  """A Mosaic GPU kernel's arithmetic for float32 arrays in ``layout`` (default WGMMA): its
  LLVM contracts FMAs and approx_math gives ex2.approx.ftz; the reciprocal is inline PTX
  (compiled kernels only)."""
  if interpret:
    return _activations.EXACT
  return _activations.Math(reciprocal=functools.partial(fast_reciprocal, layout=layout))


def swizzle_lanes(minor: int, dtype) -> int:
  """Elements in a swizzle tile's row, for a shared-memory block whose minor dimension is
  ``minor``: the widest swizzle its rows allow (at most 128 bytes)."""
  return plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8) // jnp.dtype(dtype).itemsize


def swizzled(minor: int, dtype):
  """Tiling and swizzle transforms for a shared-memory block whose minor dimension is ``minor``."""
  lanes = swizzle_lanes(minor, dtype)
  return (plgpu.TilingTransform((8, lanes)),
          plgpu.SwizzleTransform(lanes * jnp.dtype(dtype).itemsize))


def hopper_reason(chip: hardware.Chip) -> str | None:
  """Why a Mosaic GPU kernel (wgmma, TMA, warpgroup register moves: sm90a's) cannot run on
  ``chip``, or None on Hopper. Blackwell (sm100) has no wgmma: these kernels would need its
  tcgen05 variant there."""
  if chip.compute_capability != (9, 0):
    capability = ("unknown" if chip.compute_capability is None
                  else "sm{}{}".format(*chip.compute_capability))
    return f"mosaic_gpu needs a Hopper GPU (sm90); the device is {chip.name!r} ({capability})"
  return None


def consumer_registers(producer_registers: int, consumers: int = 2,
                       chip: hardware.Chip = hardware.DEFAULT_GPU) -> int:
  """Registers a thread of each of ``consumers`` compute warpgroups may take beside a producer
  warpgroup of ``producer_registers``: the SM's register file spread over one warpgroup's 128
  threads (512 on Hopper), less the producer's, split evenly, in multiples of 8 and at most
  255 (as JAX's pipeline does)."""
  per_thread = chip.registers_per_sm // 128
  return int(min(256, (per_thread - producer_registers) / consumers) // 8 * 8)


def num_sms() -> int:
  """SMs of the GPU the kernel is built for: the abstract mesh's device while tracing for one,
  else the default device's, else the stand-in GPU's."""
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  if device is not None and getattr(device, "num_cores", None):
    return device.num_cores
  device = jax.devices()[0]
  return getattr(device, "core_count", None) or hardware.DEFAULT_GPU.cores

# The Mosaic GPU interpreter (jax 0.10-0.11) runs a kernel's jaxpr on the CPU, where registers
# have no layouts: it has no layout_cast, layout-taking iota, plgpu.load, run_state,
# accumulator stores, transposed shared-memory views or wgmma operands in registers. The
# kernels call these instead where they differ for it: the only places that ask.


def cta_smem_bytes(chip: hardware.Chip | None = None) -> int:
  """Shared memory one CTA may take on ``chip`` (None: the stand-in Hopper)."""
  return (chip or hardware.DEFAULT_GPU).block_onchip_bytes


def layout_cast(x, layout, interpret):
  return x if interpret else plgpu.layout_cast(x, layout)


def iota(shape, dim, interpret):
  if interpret:
    return lax.broadcasted_iota(jnp.int32, shape, dim)
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def load_block(ref, layout, interpret):
  """A block of shared memory in registers in ``layout`` (a WGMMA tile, or its rows' or
  columns' vector)."""
  if interpret:
    return ref[...]
  return load(ref, layout=layout, optimized=False)


def accumulators(shapes, scratch, body, interpret):
  """body(*accumulators): zeroed float32 wgmma accumulators of ``shapes``; interpreted (the
  interpreter's wgmma reads no registers), the warpgroup's float32 shared-memory ``scratch``."""
  if interpret:
    for ref in scratch:
      ref[...] = jnp.zeros(ref.shape, jnp.float32)
    return body(*scratch)
  return pl.run_scoped(body, *[plgpu.ACC(shape, jnp.float32) for shape in shapes])


def mma(acc, a, b_smem, interpret):
  """acc += a @ b (a in registers, b a shared-memory block), issued; :func:`mma_wait` for it."""
  if interpret:
    acc[...] += lax.dot_general(a, b_smem[...], (((1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)
  else:
    plgpu.wgmma(acc, a, b_smem)


def mma_wait(in_flight: int, interpret):
  """Waits until at most ``in_flight`` of this warpgroup's wgmma groups still run."""
  if not interpret:
    plgpu.wgmma_wait(in_flight)


# --------------------------------------------------------------------------- #
# Row kernels: the memory-bound ops' walk over whole rows (norms, softmax)
# --------------------------------------------------------------------------- #
# CTAs of one warpgroup, each taking a run of consecutive row blocks (as many CTAs as runs, the
# hardware starting each as an earlier one ends), or a persistent grid, CTA c taking row
# blocks c, c + ctas, ... (``row_blocks``). Each block of whole rows comes into shared memory
# by one tiled bulk copy, several blocks ahead of the one computed (``plgpu.emit_pipeline``);
# a row is read from there in chunks, each a warpgroup-strided vector, and outputs go from
# registers straight to global memory.

WARPGROUP = 128  # threads: one warpgroup a CTA
# Bytes a thread moves per shared-memory load: a 16-byte vector (ld.shared.v4).
VECTOR_BYTES = 16
# Widest chunk of a row in registers at once: 16 elements a thread per array at 2048.
MAX_CHUNK = 2048
# Float32 values of whole rows a thread may hold in registers through a pipeline step (a
# warpgroup's 128 threads, one CTA or two an SM: far under the 255 a thread can have).
RESIDENT_FLOATS = 64
# Shared memory a row kernel takes beside its buffers: the cross-warp reductions' scratch
# (CompilerParams.reduction_scratch_bytes, 2048 on jax 0.10-0.12) and the pipeline's barriers.
ROW_KERNEL_RESERVE = 2048 + 1024
# Each shared-memory buffer is counted in whole units of this: with it, ring_stages' count was
# at or above what Mosaic GPU's allocator asked ("exceeds available shared memory" gives its
# total) for every norms config tried, 2-4.6 KB above the buffers' bare sizes.
SMEM_ALIGNMENT = 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowConfig:
  """A row kernel's walk, forward and backward: the fields of the norms' and softmax's Mosaic
  GPU configs (each op's Config derives from it)."""

  stages: int  # row blocks in shared memory a CTA: the one computed and those in flight
  ctas_per_sm: int  # CTAs an SM, each with its own rings of ``stages`` blocks
  bwd_stages: int
  bwd_ctas_per_sm: int
  rows: int = 1  # rows a block (a pipeline step), where they divide the rows; else 1
  bwd_rows: int = 1
  # Blocks a CTA, one CTA a run of them (the hardware hands them out as CTAs finish); 0: a
  # persistent grid, ``ctas_per_sm`` an SM, each taking every so-many-th block (row_blocks).
  per_cta: int = 0
  bwd_per_cta: int = 0

  def __post_init__(self):
    check_fields(self, ("stages", "ctas_per_sm", "bwd_stages", "bwd_ctas_per_sm", "rows",
                        "bwd_rows"), lambda v: v >= 1, ">= 1")
    check_fields(self, ("per_cta", "bwd_per_cta"), lambda v: v >= 0, ">= 0")

  def error(self, most_stages, problem, chip: hardware.Chip) -> str | None:
    """Why this config's rings do not fit a CTA's shared memory for ``problem``, or None;
    ``most_stages(problem, chip, backward=, rows=, ctas_per_sm=)`` is the op's count."""
    for backward, (stages, rows, per_sm) in (
        (False, (self.stages, self.rows, self.ctas_per_sm)),
        (True, (self.bwd_stages, self.bwd_rows, self.bwd_ctas_per_sm))):
      most = most_stages(problem, chip, backward=backward, rows=rows, ctas_per_sm=per_sm)
      if stages > most:
        prefix = "bwd_" if backward else ""
        return (f"{prefix}stages={stages} blocks of {prefix}rows={rows} do not fit a CTA's "
                f"shared memory at {prefix}ctas_per_sm={per_sm} (at most {max(most, 0)})")
    return None


def ring_stages(chip: hardware.Chip | None, ctas_per_sm: int, ring_bytes, buffer_bytes,
                most: int = 64) -> int:
  """The most blocks a row kernel's rings hold (0 if not one): a ring of ``stages`` blocks for
  each of ``ring_bytes`` (a block's bytes of one input), beside buffers of ``buffer_bytes``
  and ROW_KERNEL_RESERVE, ``ctas_per_sm`` CTAs sharing an SM's shared memory."""
  align = lambda n: -(-n // SMEM_ALIGNMENT) * SMEM_ALIGNMENT
  budget = (cta_smem_bytes(chip) // ctas_per_sm - ROW_KERNEL_RESERVE
            - sum(align(b) for b in buffer_bytes))
  for stages in range(most, 0, -1):
    if sum(align(stages * r) for r in ring_bytes) <= budget:
      return stages
  return 0


def row_geometry(n_cols: int, *dtypes, max_chunk: int = MAX_CHUNK) -> tuple[int, int, int] | None:
  """(piece, chunk, vec) for rows of ``n_cols`` of ``dtypes`` (None entries skipped), or None
  where no such walk exists (rows not a whole number of 128-element vectors).

  piece: the row is copied as (n_cols // piece, piece): a tiled bulk copy moves at most 256
  elements along a dimension, and each piece must be whole 16-byte units of every dtype.
  vec: elements a thread loads at once, 16 bytes of the narrowest dtype where the row allows.
  chunk: columns a thread's registers hold at once, whole pieces and whole warpgroup vectors,
  the widest up to ``max_chunk``.
  """
  sizes = [jnp.dtype(d).itemsize for d in dtypes if d is not None]
  unit = VECTOR_BYTES // min(sizes)
  pieces = [w for w in range(unit, min(n_cols, 256) + 1, unit) if n_cols % w == 0]
  if not pieces:
    return None
  width = max(pieces)
  vec = unit
  while vec >= 1:
    chunks = [k * width for k in range(1, n_cols // width + 1)
              if (n_cols // width) % k == 0 and (k * width) % (WARPGROUP * vec) == 0
              and k * width <= max(max_chunk, WARPGROUP * vec)]
    if chunks:
      return width, max(chunks), vec
    vec //= 2
  return None


def width_reason(n_cols: int, *dtypes, whose: str = "x's") -> str | None:
  """Why a row kernel cannot walk rows of ``n_cols`` (``whose`` last dimension), or None."""
  if row_geometry(n_cols, *dtypes) is None:
    return (f"mosaic_gpu takes rows a whole number of {WARPGROUP}-element warpgroup vectors "
            f"wide; {whose} last dimension is {n_cols}")
  return None


@dataclasses.dataclass(frozen=True)
class Row:
  """How a kernel walks one row, seen as (pieces, piece): ``chunk // piece`` pieces at a time,
  each chunk a warpgroup-strided vector of ``vec`` elements a thread."""

  n_cols: int
  piece: int
  chunk: int
  vec: int
  interpret: Any

  @classmethod
  def of(cls, n_cols: int, interpret, *arrays, max_chunk: int = MAX_CHUNK) -> Row:
    """The walk of rows of ``n_cols`` for ``arrays`` (None entries skipped) and float32 rows
    beside them, its chunks at most ``max_chunk`` wide where the row allows."""
    dtypes = [jnp.float32, *(a.dtype for a in arrays if a is not None)]
    return cls(n_cols, *row_geometry(n_cols, *dtypes, max_chunk=max_chunk), interpret)

  @property
  def chunks(self) -> range:
    return range(self.n_cols // self.chunk)

  def cols(self, c: int):
    """Chunk c's pieces: the index of a (..., pieces, piece) ref's pieces axis."""
    per_chunk = self.chunk // self.piece
    return pl.ds(c * per_chunk, per_chunk)

  def layout(self):
    return plgpu.Layout.WG_STRIDED((self.chunk // self.piece, self.piece), self.vec)

  def load(self, ref, c: int):
    """Chunk c of a row (a (pieces, piece) ref), as float32."""
    return load_block(ref.at[self.cols(c)], self.layout(), self.interpret).astype(jnp.float32)

  def math(self) -> _activations.Math:
    """The activations' arithmetic on this walk's chunks (:func:`math`)."""
    return math(self.interpret, self.layout())

  def zeros(self):
    return layout_cast(jnp.zeros((self.chunk // self.piece, self.piece), jnp.float32),
                       self.layout(), self.interpret)

  def sums(self, terms):
    """Sums over the row of each of terms(c) (a tuple of elementwise float32 chunks) in one
    pass: the chunks add elementwise, then one reduction across the warpgroup each."""
    totals = None
    for c in self.chunks:
      ts = terms(c)
      totals = ts if totals is None else tuple(a + b for a, b in zip(totals, ts))
    return tuple(jnp.sum(t) for t in totals)

  def peak(self, term):
    """max over the row of term(c), an elementwise float32 chunk: the chunks' elementwise
    maximum, then one reduction across the warpgroup."""
    peak = None
    for c in self.chunks:
      t = term(c)
      peak = t if peak is None else jnp.maximum(peak, t)
    return jnp.max(peak)

  def held(self, term, resident: bool):
    """term(c), an elementwise chunk, as a function of c: computed for every chunk here and
    kept in registers where ``resident`` (each shared-memory read and exp done once), else
    computed again at each use (rows too wide for registers)."""
    if not resident:
      return term
    chunks = [term(c) for c in self.chunks]
    return lambda c: chunks[c]

  def fits_registers(self, arrays: int) -> bool:
    """Whether ``arrays`` whole float32 rows fit a thread's registers beside the walk's own
    (RESIDENT_FLOATS a thread)."""
    return arrays * self.n_cols <= RESIDENT_FLOATS * WARPGROUP

  def pieces(self, a):
    """a (..., N) as (..., N // piece, piece): the shape the kernels copy and index."""
    return None if a is None else a.reshape(*a.shape[:-1], self.n_cols // self.piece, self.piece)


def copy_vectors(pairs, barrier) -> None:
  """Copies each (global, shared) pair of row vectors into shared memory and waits."""
  for gmem, smem in pairs:
    plgpu.copy_gmem_to_smem(gmem, smem, barrier)
  plgpu.barrier_wait(barrier)


def run_length(n_blocks: int, run: int, chip: hardware.Chip | None = None) -> int:
  """Blocks a CTA for a heuristic that hands out runs of ``run``: fewer where runs that long
  would leave SMs of ``chip`` (None: the stand-in Hopper) without a CTA, at least one."""
  return max(1, min(run, n_blocks // (chip or hardware.DEFAULT_GPU).cores))


def row_ctas(n_blocks: int, per_sm: int, per_cta: int = 0, walks: int = 1) -> int:
  """CTAs of a row kernel's walk over ``n_blocks`` blocks: ``per_sm`` an SM, shared by
  ``walks`` such walks side by side (an elementwise kernel's column chunks), no more than
  there are blocks (a persistent grid); with ``per_cta``, one CTA a run of that many blocks
  (the hardware's scheduler starts each as an earlier one ends: :func:`row_blocks`)."""
  if per_cta:
    return cdiv(n_blocks, per_cta)
  return max(1, min(n_blocks, per_sm * num_sms() // walks))


def row_launch(n_blocks: int, per_sm: int, per_cta: int, stages: int,
               walks: int = 1) -> tuple[int, int, int]:
  """A row kernel's launch over ``n_blocks`` blocks: ``(per_cta, ctas, stages)``, the run no
  longer than the blocks (0: a persistent grid), the CTAs of the walk (:func:`row_ctas`), and
  no more blocks in flight than a CTA takes."""
  per_cta = min(per_cta, n_blocks)
  ctas = row_ctas(n_blocks, per_sm, per_cta, walks)
  return per_cta, ctas, min(stages, per_cta or cdiv(n_blocks, ctas))


def _blocks(program, programs: int, n_blocks: int, per_cta: int):
  """A program's blocks: ``(count, block(i))``. ``per_cta`` 0: every ``programs``-th from
  ``program`` (a persistent grid); else that many consecutive ones, the last run shorter."""
  if per_cta:
    first = program * per_cta
    return jnp.minimum(per_cta, n_blocks - first), lambda i: first + i
  return (n_blocks - program + programs - 1) // programs, lambda i: program + i * programs


def row_blocks(cta, ctas: int, n_blocks: int, rows: int, row: Row, per_cta: int = 0):
  """Row blocks CTA ``cta`` takes (:func:`_blocks`): how many, ``block(i)`` (the i-th one's
  index), and their BlockSpec over the rows' (M, pieces, piece) view.

  A persistent grid (``per_cta`` 0) fixes each CTA's share at launch: where SMs stream at
  unequal rates, the kernel ends with its slowest. Runs of ``per_cta`` blocks, more CTAs than
  fit at once, are handed out by the hardware as CTAs finish (notes/mgpurows.md mgpu-rows-2)."""
  count, block = _blocks(cta, ctas, n_blocks, per_cta)
  return count, block, pl.BlockSpec((rows, row.n_cols // row.piece, row.piece),
                                    lambda i: (block(i), 0, 0))


def tile_blocks(cta, row_programs: int, n_row_blocks: int, rows: int, row: Row,
                per_cta: int = 0):
  """An elementwise kernel's CTA of a (row_programs, chunks) grid: its column chunk (cta %
  chunks, fixed: a bias's gradient accumulates over its rows) and its row blocks (program cta
  // chunks of ``row_programs``, :func:`_blocks`). Returns how many blocks, the chunk, the
  program, ``block(i)`` (the i-th row block's index) and ``spec(shift)``: the BlockSpec of a
  (rows, chunk) tile over the (M, pieces, piece) view, ``shift`` chunks to the right (a packed
  [gate | up] row's up half)."""
  chunks = len(row.chunks)
  chunk, program = cta % chunks, cta // chunks
  count, block = _blocks(program, row_programs, n_row_blocks, per_cta)

  def spec(shift: int = 0):
    return pl.BlockSpec((rows, row.chunk // row.piece, row.piece),
                        lambda i: (block(i), chunk + shift, 0))
  return count, chunk, program, block, spec


def row_kernel(kernel, out_type, scratch, ctas: int, *, name: str, interpret,
               auto_barriers: bool = False, approx_math: bool = False):
  """``kernel`` (refs: inputs, outputs, scratch) as a Mosaic GPU kernel of ``ctas`` CTAs on
  the grid axis "cta", named ``name`` (profiles show it). Without ``auto_barriers``
  the kernel places its own: a row kernel needs one a pipeline step, before its shared-memory
  slots are refilled."""
  def body(*refs):
    return kernel(*refs)
  body.__name__ = name
  return plgpu.kernel(
      body, out_type=out_type, grid=(ctas,), grid_names=("cta",), scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=not auto_barriers,
                                           approx_math=approx_math),
      **({"interpret": interpret} if interpret else {}))
