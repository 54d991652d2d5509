"""Pallas Triton commons: compiler params, the hardware's arithmetic, masked tiles over
full-array refs, and the walk along rows that the online softmax takes.

Version differences between the jax releases we run on (0.10.2 on CPU/CI, 0.11.x on the GPU
machine) that touch Triton kernels are absorbed here and nowhere else; so is Pallas Triton's
absence from a JAX that has removed it (``pltriton`` is None there): every Triton kernel module
takes ``pltriton`` from here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # The package's one import of Pallas Triton, which JAX 0.11 deprecated and will remove.
  from jax.experimental.pallas import triton as pltriton
except ImportError:  # A JAX without it: the package imports, dispatch refuses the Triton
  pltriton = None  # kernels with the reason (dispatch.missing_api), XLA serves their calls.

from jaxkernels import _activations
from jaxkernels._tiling import cdiv, check_fields, is_pow2, next_pow2

# The custom-call target Triton kernels lower to (for jax.export's safety checks).
CUSTOM_CALL = getattr(pltriton, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")


# What the kernels call of Pallas Triton's API (tests/test_structure.py keeps it complete).
API = ("CompilerParams", "elementwise_inline_asm", "load", "store")


def params(num_warps: int, num_stages: int = 1) -> Any:
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


def fast_tanh(x):
  """tanh(x) by tanh.approx.f32: one MUFU.TANH, max relative error about 2**-11 (PTX ISA)."""
  return _triton_asm("tanh.approx.f32", x)


def fma(a, b, c):
  """a * b + c rounded once. XLA compiles Pallas Triton kernels without FMA contraction: their
  SASS has FMUL and FADD only, so every Horner step cost two instructions (notes/rows.md
  run 22)."""
  return _triton_asm("fma.rn.f32", a, b, c)


# A compiled Triton kernel's arithmetic for the activations (inline PTX: compiled kernels only;
# interpreted, kernels use _activations.EXACT).
MATH = _activations.Math(reciprocal=fast_reciprocal, exp2=fast_exp2, fma=fma)


def math(interpret) -> _activations.Math:
  return _activations.EXACT if interpret else MATH


def row_sums(a, b):
  """(a.sum(axis=1), b.sum(axis=1)) of two (rows, cols) tiles in one reduction.

  Triton reduces each sum across warps through shared memory, a store, a barrier, a load
  and a barrier a sum; stacked on a last axis of two, both travel in one exchange.
  """
  return jnp.unstack(jnp.sum(jnp.stack([a, b], axis=-1), axis=1), axis=-1)


@functools.cache
def stream_cache_modifier() -> str | None:
  """The cache modifier for streamed Triton loads: ".cg", or None where it cannot be asked for.

  Called when a kernel is traced, so the patch below touches jax only once a Triton kernel
  is built, never at import.

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

  def shifted(self, cols: int) -> "Tile":
    """The same tile ``cols`` columns to the right, with the same masks: the second of two
    arrays side by side in one (glu's [gate | up])."""
    return Tile(self.rows, self.cols + cols, self.row_mask, self.col_mask)

  def load(self, ref, other=0.0, *, streamed=False):
    """ref[tile] as float32, masked lanes read ``other``.

    ``streamed``: the kernel reads these bytes once, so they are read past L1 (``.cg``),
    leaving L1 to what every program rereads, a float32 scale row say: rms_norm's forward
    ran 4 us faster and both norms' backwards 2.5 us faster of ~140 (notes/rows.md,
    run 45). No eviction hint: evict_first on streamed loads cost 1-5% on an H200 (run 5).
    """
    return load_vector(ref, self.index, self.mask, other, stream_cache_modifier() if streamed else None)

  def store(self, ref, value):
    store_vector(ref, self.index, value, self.mask)

  def load_cols(self, ref, other=0.0, *, streamed=False):
    """A row vector ref[cols] (e.g. a scale) as float32; ``streamed`` as for :meth:`load`."""
    return load_vector(ref, self.cols, self.col_mask, other, stream_cache_modifier() if streamed else None)

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


# The flat view's offsets are int32 (Pallas kernels trace without 64-bit integers): arrays of
# more elements take the 2-D indexing, whose offsets Pallas widens itself.
FLAT_MAX_ELEMENTS = 2**31

# The shape of a walk along whole rows (softmax's, cross-entropy's). Rows up to ONE_PASS_COLS
# wide sit in registers, ROW_TILE elements a program (as for the norms, notes/rows.md). Wider
# rows take the online path, from the H200 sweeps (notes/rows.md, runs 29-30): one program of
# 32 warps an SM (64 registers a thread), so few rows are in flight (132 x 128 KiB at 65536
# columns, under the 50 MB L2: their second read can come from it, not measured); 4 chunks a
# step, a step at most half the row: 16384 columns, 32768 from 65536 on. Against the former 2
# rows x 4096 columns on 8 warps with a reduction per chunk: 1024x65536 softmax forward
# +16-23%, backward +25%; 2048x32768 forward +39%, backward +25%.
ONE_PASS_COLS = 16384
ROW_TILE = 8192
ONLINE_WARPS = 32
ONLINE_UNROLL = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowWalkConfig:
  """The blocks of a :class:`RowSteps` walk, forward and backward: the fields of softmax's and
  cross-entropy's Triton configs (each op's Config derives from it)."""

  block_rows: int
  block_cols: int  # next_pow2(N) for one pass, else the chunk width
  num_warps: int
  bwd_block_rows: int
  bwd_num_warps: int
  unroll: int = 1  # online path: chunks a loop step, forward
  bwd_unroll: int = 1  # and backward

  def __post_init__(self):
    check_fields(self, ("block_rows", "block_cols", "num_warps", "bwd_block_rows",
                        "bwd_num_warps"), is_pow2, "a power of two (Triton tiles are)")
    check_fields(self, ("unroll", "bwd_unroll"), lambda v: v >= 1, ">= 1")


def row_walk(n_rows: int, n_cols: int) -> dict[str, int]:
  """A :class:`RowWalkConfig`'s fields for (n_rows, n_cols), forward and backward alike:
  whole rows a program up to ONE_PASS_COLS, else one row a program in unrolled chunks (the
  online path)."""
  padded = next_pow2(n_cols)
  if padded > ONE_PASS_COLS:
    rows, cols, warps, unroll = 1, 8192 if n_cols >= 65536 else 4096, ONLINE_WARPS, ONLINE_UNROLL
  else:
    rows, cols, unroll = max(1, min(ROW_TILE // padded, next_pow2(n_rows))), padded, 1
    warps = max(4, min(16, rows * padded // 1024))
  return dict(block_rows=rows, block_cols=cols, num_warps=warps, bwd_block_rows=rows,
              bwd_num_warps=warps, unroll=unroll, bwd_unroll=unroll)


class RowSteps:
  """A walk along a block of rows, ``unroll`` chunks of ``block_cols`` columns a step, as the
  online softmax takes it (softmax's wide rows; the vocabulary of a cross-entropy).

  Rows of a whole number of 16-byte vectors (``vec`` elements) are indexed as (row, column) of
  the (M, N) array. Other rows start and end off a vector boundary, and a load whose columns
  might cross one is issued element by element (16-bit loads for bfloat16: 1.4-1.9 TB/s at
  N = 50257, run 30). Those (``flat``) are read through the flat view of the array: each row's
  body, from the first vector boundary at or after its start to the last one at or before its
  end, is walked in chunks that start on a boundary and are masked at one (vector loads), and
  its head and tail, under ``vec`` elements each, are loaded apart (run 38: 2.1-2.8 TB/s).
  A row shorter than ``vec`` (only under a config's small ``block_cols``) is all head.
  """

  def __init__(self, *, n_rows, n_cols, block_rows, block_cols, unroll, vec, flat):
    self.rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
    self.flat, self.vec = flat, vec
    self.row_mask = self.rows < n_rows if n_rows % block_rows else None
    self.block_rows, self.block_cols, self.unroll = block_rows, block_cols, unroll
    self.n_cols = n_cols
    self.count = cdiv(n_cols, block_cols * unroll)
    # Chunks past the row's (the body's) end, the last step's, are masked out whole.
    self.mask_cols = flat or n_cols % (block_cols * unroll) != 0
    if flat:
      self.start = self.rows * n_cols
      self.end = self.start + n_cols
      self.short = n_cols < vec  # no vector boundary need lie inside the row
      if self.short:
        self.body0 = self.body1 = self.end
      else:  # multiples of vec that Triton's alignment analysis can see through
        self.body0 = (self.start + vec - 1) // vec * vec
        self.body1 = self.end // vec * vec

  def _masked(self, mask):
    return both(mask, None if self.row_mask is None else self.row_mask[:, None])

  def chunks(self, step):
    """(index, mask) of each of a step's chunks, (block_rows, block_cols) each."""
    out = []
    for u in range(self.unroll):
      cols = (step * self.unroll + u) * self.block_cols + jnp.arange(self.block_cols)
      if self.flat:
        offsets = self.body0[:, None] + cols[None, :]
        out.append((offsets, self._masked(offsets < self.body1[:, None])))
      else:
        mask = (cols < self.n_cols)[None, :] if self.mask_cols else None
        out.append(((self.rows[:, None], cols[None, :]), self._masked(mask)))
    return out

  def edges(self):
    """(index, mask) of the elements before the body and after it: none unless flat."""
    if not self.flat:
      return []
    lane = jnp.arange(self.vec)[None, :]
    head = self.start[:, None] + lane
    edges = [(head, self._masked(head < self.body0[:, None]))]
    if not self.short:
      tail = self.body1[:, None] + lane
      edges.append((tail, self._masked(tail < self.end[:, None])))
    return edges

  def lanes(self, value):
    return jnp.full((self.block_rows, self.block_cols), value, jnp.float32)

  def walk(self, load, body, carry, prefetch: bool):
    """carry = body(chunks, load(chunks), carry) for each step's chunks. With ``prefetch`` a
    step's loads are issued before the previous step's body runs (the last step's are issued
    twice, harmlessly, rather than past the row's end)."""
    if not prefetch:
      def step(s, c):
        chunks = self.chunks(s)
        return body(chunks, load(chunks), c)
      return lax.fori_loop(0, self.count, step, carry)

    def step(s, state):
      c, loaded = state
      ahead = load(self.chunks(jnp.minimum(s + 1, self.count - 1)))
      return body(self.chunks(s), loaded, c), ahead

    return lax.fori_loop(0, self.count, step, (carry, load(self.chunks(0))))[0]
