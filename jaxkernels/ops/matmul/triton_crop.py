"""Pallas Triton kernel that cuts a Mosaic GPU matmul's padded C back to (m, n)
(``matmul.mosaic_gpu.padding.crop`` says when). Each program copies a
``BLOCK_ROWS x BLOCK_COLS`` tile: aligned, vectorized loads from the padded source, read once
past L1, and masked stores that Triton issues element by element where the destination's
alignment forbids wider ones (XLA's slice, every destination row only 2-byte aligned, ran at
0.86 TB/s on an H200; notes/matmul.md matmul-30).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxkernels import _triton
from jaxkernels._tiling import cdiv
from jaxkernels._triton import pltriton

BLOCK_ROWS = 16
BLOCK_COLS = 512
NUM_WARPS = 8  # 0.143 ms at 8193^3 bf16, against 0.152 on 4 (matmul-30)


def _kernel(x_ref, o_ref, *, m: int, n: int):
  i, j = pl.program_id(0), pl.program_id(1)
  rows = i * BLOCK_ROWS + jnp.arange(BLOCK_ROWS)
  cols = j * BLOCK_COLS + jnp.arange(BLOCK_COLS)
  mask = (rows < m)[:, None] & (cols < n)[None, :]
  tile = (pl.ds(i * BLOCK_ROWS, BLOCK_ROWS), pl.ds(j * BLOCK_COLS, BLOCK_COLS))
  x = pltriton.load(x_ref.at[tile], mask=mask, other=0,
                    cache_modifier=_triton.stream_cache_modifier())
  pltriton.store(o_ref.at[tile], x, mask=mask)


def crop(y, m: int, n: int, *, interpret=False):
  """y[:m, :n] for a 2-D ``y`` larger than (m, n)."""
  return pl.pallas_call(
      functools.partial(_kernel, m=m, n=n),
      out_shape=jax.ShapeDtypeStruct((m, n), y.dtype),
      grid=(cdiv(m, BLOCK_ROWS), cdiv(n, BLOCK_COLS)),
      compiler_params=_triton.params(NUM_WARPS),
      interpret=interpret,
      name="jk_crop",
  )(y)
