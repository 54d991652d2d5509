"""Helpers shared by the kernels of every op: arithmetic on tiles, masked Triton tiles, compiler params.

Version differences between the jax releases we run on (0.10.2 on CPU/CI,
0.11.x on the GPU machine) are absorbed here and nowhere else.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jaxkernels import _activations


def mosaic_gpu_interpret_params() -> Any:
  """The Mosaic GPU interpreter's params (threads, barriers, TMA and wgmma run on the CPU).

  jax 0.10-0.11 keep the class private; this is the one place that names it.
  """
  from jax._src.pallas.mosaic_gpu.interpret import params
  return params.InterpretGPUParams()


# The custom-call target Triton kernels lower to (for jax.export's safety checks).
TRITON_CUSTOM_CALL = getattr(pltriton, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def round_up(a: int, b: int) -> int:
  return cdiv(a, b) * b


def next_pow2(n: int) -> int:
  return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def rows_view(x):
  """(..., N) -> (M, N), free for contiguous arrays."""
  return x.reshape(-1, x.shape[-1])


# --------------------------------------------------------------------------- #
# Triton: masked (rows, cols) tiles over full-array refs
# --------------------------------------------------------------------------- #


def triton_params(num_warps: int, num_stages: int = 1) -> Any:
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _triton_asm(instruction: str, *args):
  """One PTX instruction per element over float32 tiles (broadcast to a common shape)."""
  args = jnp.broadcast_arrays(*(jnp.asarray(a, jnp.float32) for a in args))
  [out] = pltriton.elementwise_inline_asm(
      f"{instruction} $0, " + ", ".join(f"${i + 1}" for i in range(len(args))) + ";",
      args=args, constraints=",".join(["=f"] + ["f"] * len(args)), pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])
  return out


def fast_reciprocal(x):
  """1/x by the SFU's rcp.approx.ftz.f32 (1 ulp; subnormals flushed): a division costs ~10 ops."""
  return _triton_asm("rcp.approx.ftz.f32", x)


def fast_exp2(x):
  """2**x by ex2.approx.ftz.f32 (2 ulp): one MUFU.EX2, where Pallas' exp2 lowers to the non-ftz
  form and pays 3 more instructions an element to keep subnormal results. Results below
  2**-126 flush to zero (GELU's tail past |x| ~ 13, where GELU itself is below float32's
  normal range)."""
  return _triton_asm("ex2.approx.ftz.f32", x)


def triton_fma(a, b, c):
  """a * b + c rounded once. XLA compiles Pallas Triton kernels without FMA contraction: their
  SASS has FMUL and FADD only, so every Horner step cost two instructions (bench/NOTES.md
  run 22)."""
  return _triton_asm("fma.rn.f32", a, b, c)


# A compiled Triton kernel's arithmetic for the activations (inline PTX: compiled kernels only;
# interpreted, kernels use _activations.EXACT).
TRITON_MATH = _activations.Math(reciprocal=fast_reciprocal, exp2=fast_exp2, fma=triton_fma)


def triton_math(interpret) -> _activations.Math:
  return _activations.EXACT if interpret else TRITON_MATH


def mosaic_gpu_fast_reciprocal(x):
  """1/x by rcp.approx.ftz.f32 in a Mosaic GPU kernel of warpgroup semantics, for a float32
  array in the WGMMA layout (a matmul epilogue's pieces). Compiled kernels only.

  Pallas lowers 1/x under approx_math to rcp.approx.f32, whose subnormal and overflow range
  fix-ups take six SASS instructions besides the one MUFU.RCP (the matmul epilogue's SASS,
  bench/NOTES.md matmul-24). Mosaic GPU exposes no reciprocal, so this reaches FragmentedArray's
  PTX helpers (jax 0.10-0.11); where a release lacks them, exact division.
  """
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.pallas import mosaic_gpu as plgpu
  if not all(hasattr(mgpu.FragmentedArray, f) for f in ("_pointwise", "_lift_fast_instr")):
    return 1.0 / x
  layout = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(layout,),
                     return_type=plgpu.ShapeDtypeStruct(x.shape, jnp.float32, layout=layout))
  def rcp(_, v):
    return v._pointwise(v._lift_fast_instr("rcp.approx.ftz.f32"))
  return rcp(x)


def mosaic_gpu_math(interpret) -> _activations.Math:
  """A Mosaic GPU matmul epilogue's arithmetic: its LLVM contracts FMAs and approx_math gives
  ex2.approx.ftz; the reciprocal is inline PTX (compiled kernels only)."""
  if interpret:
    return _activations.EXACT
  return _activations.Math(reciprocal=mosaic_gpu_fast_reciprocal)


def check_fields(config, names, ok, requirement: str) -> None:
  """Raises ValueError naming the first of ``names`` whose value fails ``ok``."""
  for name in names:
    value = getattr(config, name)
    if not ok(value):
      raise ValueError(f"{name}={value} must be {requirement}")


def row_sums(a, b):
  """(a.sum(axis=1), b.sum(axis=1)) of two (rows, cols) tiles in one reduction.

  Triton reduces each sum across warps through shared memory, a store, a barrier, a load
  and a barrier a sum; stacked on a last axis of two, both travel in one exchange.
  """
  return jnp.unstack(jnp.sum(jnp.stack([a, b], axis=-1), axis=1), axis=-1)


def _cache_modifier_shim() -> str | None:
  """The cache modifier for streamed Triton loads: ".cg", or None where it cannot be asked for.

  Pallas Triton (jax 0.10-0.11) accepts ``cache_modifier=".cg"`` and then looks it up in a
  table keyed by the enum's own names ("cg"), so every use raises KeyError. This registers
  the dotted spellings its check lets through. Where the table is gone, or the check no
  longer names ".cg" (a jax that spells it otherwise), streamed loads keep the default
  caching rather than risk a load the lowering refuses.
  """
  try:
    from jax._src.pallas.triton import lowering
    table = lowering._STR_TO_CACHE_MODIFIER
    checked = lowering._load.__code__.co_consts
  except (ImportError, AttributeError):
    return None
  if ".cg" not in checked:
    return None
  for name in ("ca", "cg"):
    if name in table:
      table.setdefault("." + name, table[name])
  return ".cg" if ".cg" in table else None


STREAMED = _cache_modifier_shim()


def both(a, b):
  """Elementwise and of two optional masks (None means all true)."""
  if a is None:
    return b
  if b is None:
    return a
  return a & b


class Tile:
  """Rows [rows] x columns [cols] of a 2-D array, with the masks a partial tile needs.

  A mask is None where it is statically all-true, so full tiles compile to
  unmasked 16-byte loads.
  """

  def __init__(self, rows, cols, row_mask, col_mask):
    self.rows, self.cols = rows, cols
    self.row_mask, self.col_mask = row_mask, col_mask
    self.mask = both(
        None if row_mask is None else row_mask[:, None],
        None if col_mask is None else col_mask[None, :],
    )

  @classmethod
  def at(cls, row0, block_rows: int, col0, block_cols: int, *, n_rows: int, n_cols: int,
         mask_rows: bool, mask_cols: bool) -> "Tile":
    rows = row0 + jnp.arange(block_rows)
    cols = col0 + jnp.arange(block_cols)
    return cls(rows, cols, rows < n_rows if mask_rows else None,
               cols < n_cols if mask_cols else None)

  @classmethod
  def columns(cls, col0, block_cols: int, *, n_cols: int, mask_cols: bool) -> "Tile":
    """A row vector's columns only (for load_cols)."""
    cols = col0 + jnp.arange(block_cols)
    return cls(None, cols, None, cols < n_cols if mask_cols else None)

  @property
  def index(self):
    return (self.rows[:, None], self.cols[None, :])

  def load(self, ref, other=0.0, *, streamed=False):
    """ref[tile] as float32, masked lanes read ``other``.

    ``streamed``: the kernel reads these bytes once, so they are read past L1 (``.cg``),
    leaving L1 to what every program rereads, a float32 scale row say: rms_norm's forward
    ran 4 us faster and both norms' backwards 2.5 us faster of ~140 (bench/NOTES.md,
    run 45). No eviction hint: evict_first on streamed loads cost 1-5% on an H200 (run 5).
    """
    return load_vector(ref, self.index, self.mask, other, STREAMED if streamed else None)

  def store(self, ref, value):
    store_vector(ref, self.index, value, self.mask)

  def load_cols(self, ref, other=0.0, *, streamed=False):
    """A row vector ref[cols] (e.g. a scale) as float32; ``streamed`` as for :meth:`load`."""
    return load_vector(ref, self.cols, self.col_mask, other, STREAMED if streamed else None)

  def load_rows(self, ref, other=0.0):
    """A column vector ref[rows] (e.g. per-row statistics) as float32."""
    return load_vector(ref, self.rows, self.row_mask, other)

  def store_rows(self, ref, value):
    store_vector(ref, self.rows, value, self.row_mask)


def load_vector(ref, index, mask, other=0.0, cache_modifier=None):
  """ref[index] as float32 (index: an integer array or a tuple of them), masked lanes read
  ``other``; a None mask loads unmasked."""
  if mask is None:
    return pltriton.load(ref.at[index], cache_modifier=cache_modifier).astype(jnp.float32)
  return pltriton.load(ref.at[index], mask=mask, other=other,
                       cache_modifier=cache_modifier).astype(jnp.float32)


def store_vector(ref, index, value, mask):
  pltriton.store(ref.at[index], value.astype(ref.dtype), mask=mask)


# --------------------------------------------------------------------------- #
# Mosaic TPU
# --------------------------------------------------------------------------- #


def tpu_params(dimension_semantics: tuple[str, ...], vmem_limit_bytes: int, interpret) -> Any:
  """Mosaic compiler params. Interpreted, the grid semantics are left out: jax 0.10's TPU
  interpreter does not extend them over the grid axis vmap adds (real Mosaic does)."""
  return pltpu.CompilerParams(
      dimension_semantics=None if interpret else dimension_semantics,
      vmem_limit_bytes=int(vmem_limit_bytes))


def sublanes(*dtypes) -> int:
  """Row multiple a TPU block needs: 8 sublanes of 32 bits, packed for narrower dtypes."""
  return max(8 * (4 // jnp.dtype(d).itemsize) for d in dtypes)


def tpu_row_mask(block_index, block_rows: int, n_rows: int):
  """(block_rows, 1) mask of the rows of row block ``block_index`` that lie inside the array.

  A partial last block holds whatever VMEM held: harmless for row-local math
  (its rows are never written back), poison for sums across rows.
  """
  rows = block_index * block_rows + jax.lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
  return rows < n_rows
