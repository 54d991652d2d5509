"""Pallas Mosaic TPU commons: compiler params, sublane packing, VMEM budgets, row masks."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from jaxkernels import hardware
from jaxkernels._tiling import check_fields

# Largest row block of the row-wise kernels (norms, elementwise, softmax): past ~1024 rows per
# step the per-step overhead (~0.35 us) is already under 5% of the step's HBM time on every
# generation, and bigger blocks only cost VMEM.
MAX_BLOCK_ROWS = 1024


# What the kernels call of Pallas Mosaic TPU's API (tests/test_structure.py keeps it complete).
API = ("CompilerParams", "InterpretParams", "PrefetchScalarGridSpec", "VMEM", "bitcast")


def interpret_params() -> Any:
  """The TPU interpreter's params: kernels run on the CPU with TPU semantics."""
  return pltpu.InterpretParams()


def params(dimension_semantics: tuple[str, ...], vmem_limit_bytes: int, interpret) -> Any:
  """Mosaic compiler params. Interpreted, the grid semantics are left out: jax 0.10's TPU
  interpreter does not extend them over the grid axis vmap adds (real Mosaic does)."""
  return pltpu.CompilerParams(
      dimension_semantics=None if interpret else dimension_semantics,
      vmem_limit_bytes=int(vmem_limit_bytes))


def vmem_limit(chip: hardware.Chip) -> int:
  """Scoped VMEM we ask Mosaic for: 3/4 of the core's VMEM, at most 96 MiB."""
  return min(chip.onchip_bytes * 3 // 4, 96 * hardware.MiB)


def sublanes(*dtypes) -> int:
  """Row multiple a TPU block needs: 8 sublanes of 32 bits, packed for narrower dtypes."""
  return max(8 * (4 // jnp.dtype(d).itemsize) for d in dtypes)


def row_mask(block_index, block_rows: int, n_rows: int):
  """(block_rows, 1) mask of the rows of row block ``block_index`` that lie inside the array.

  A partial last block holds whatever VMEM held: harmless for row-local math
  (its rows are never written back), poison for sums across rows.
  """
  rows = block_index * block_rows + jax.lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
  return rows < n_rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockConfig:
  """Blocks of ``block_rows`` x ``block_cols`` over an (M, N) array, and the scoped VMEM asked
  for: the fields of the elementwise ops' and cross-entropy's Mosaic TPU configs (each op's
  Config derives from it)."""

  block_rows: int
  block_cols: int
  vmem_limit_bytes: int

  def __post_init__(self):
    check_fields(self, ("block_rows", "block_cols", "vmem_limit_bytes"), lambda v: v >= 1,
                 ">= 1")

  def blocks(self, x) -> tuple[int, int]:
    """(rows, cols) of a block of the (M, N) array x, checked against TPU tiling."""
    n_rows, n_cols = x.shape
    rows, cols = min(self.block_rows, n_rows), min(self.block_cols, n_cols)
    packing = sublanes(x.dtype)
    if rows != n_rows and rows % packing:
      raise ValueError(f"block_rows={rows} must be a multiple of {packing} or cover all {n_rows=}")
    if cols != n_cols and cols % 128:
      raise ValueError(f"block_cols={cols} must be a multiple of 128 or cover all {n_cols=}")
    return rows, cols
