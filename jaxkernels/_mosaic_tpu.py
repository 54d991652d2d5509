"""Pallas Mosaic TPU commons: compiler params, sublane packing, VMEM budgets, row masks."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from jaxkernels import hardware

# Largest row block of the row-wise kernels (norms, elementwise, softmax): past ~1024 rows per
# step the per-step overhead (~0.35 us) is already under 5% of the step's HBM time on every
# generation, and bigger blocks only cost VMEM.
MAX_BLOCK_ROWS = 1024


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
