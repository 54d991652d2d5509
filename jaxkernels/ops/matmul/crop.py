"""y[:m, :n] of a padded kernel output, copied by a Pallas Triton kernel on CUDA GPUs.

The Mosaic GPU matmul writes C by TMA, which needs 16-byte row strides, so where N * itemsize
is not a multiple of 16 (8193 bf16 columns: 16386-byte rows) it writes a padded C that must
then be cut. XLA's slice of (8320, 8448) to (8193, 8193) bf16 ran at 0.86 TB/s on an H200
(0.31 ms, bench/NOTES.md matmul-30): every destination row starts only 2-byte aligned. Here
each program copies a ``BLOCK_ROWS x BLOCK_COLS`` tile: aligned, vectorized loads from the
padded source, read once past L1, and masked stores that Triton issues element by element where
the destination's alignment forbids wider ones.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxkernels._pallas import STREAMED, cdiv, triton_params

BLOCK_ROWS = 16
BLOCK_COLS = 512
NUM_WARPS = 8  # 0.143 ms at 8193^3 bf16, against 0.152 on 4 (matmul-30)


def _kernel(x_ref, o_ref, *, m: int, n: int):
  i, j = pl.program_id(0), pl.program_id(1)
  rows = i * BLOCK_ROWS + jnp.arange(BLOCK_ROWS)
  cols = j * BLOCK_COLS + jnp.arange(BLOCK_COLS)
  mask = (rows < m)[:, None] & (cols < n)[None, :]
  tile = (pl.ds(i * BLOCK_ROWS, BLOCK_ROWS), pl.ds(j * BLOCK_COLS, BLOCK_COLS))
  x = pltriton.load(x_ref.at[tile], mask=mask, other=0, cache_modifier=STREAMED)
  pltriton.store(o_ref.at[tile], x, mask=mask)


def crop(y, m: int, n: int, *, interpret=False):
  """y[:m, :n] for a 2-D ``y`` at least (m, n); ``y`` itself where it is exactly that."""
  if y.ndim != 2 or y.shape[0] < m or y.shape[1] < n:
    raise ValueError(f"crop: y must be 2-D and at least ({m}, {n}), got shape {y.shape}")
  if tuple(y.shape) == (m, n):
    return y
  return pl.pallas_call(
      functools.partial(_kernel, m=m, n=n),
      out_shape=jax.ShapeDtypeStruct((m, n), y.dtype),
      grid=(cdiv(m, BLOCK_ROWS), cdiv(n, BLOCK_COLS)),
      compiler_params=triton_params(NUM_WARPS),
      interpret=interpret,
      name="jk_crop",
  )(y)
