"""What TMA asks of the arrays a Mosaic GPU matmul reads and writes, and the copy that cuts a
padded C back to (m, n).

Swizzled TMA wants each array's rows in multiples of 8 and each row in multiples of 128 bytes,
and no copy may start past an array's end. Where A, B or C fail that, the wrapper zero-pads
them (``padded_shapes``) and cuts the padded C with ``crop``: one extra pass over each.

``crop`` is a Pallas Triton kernel (``matmul.triton_crop``), or XLA's slice where the Triton
kernels are gone. C's rows are written by TMA, which needs 16-byte row strides, so where
N * itemsize is not a multiple of 16 (8193 bf16 columns: 16386-byte rows) the kernel writes a
padded C that must then be cut. XLA's slice of (8320, 8448) to (8193, 8193) bf16 ran at
0.86 TB/s on an H200 (0.31 ms, notes/matmul.md matmul-30): every destination row starts only
2-byte aligned.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkernels import _triton_files
from jaxkernels._tiling import cdiv, round_up
from jaxkernels.ops.matmul.common import FLOAT8, Problem

def _padded_extent(size: int, align: int, cta: int, step: int) -> int:
  """How far to pad a dimension of ``size`` that the kernel reads in ``cta`` blocks, cut into
  ``step`` pieces (warpgroup halves, epilogue pieces): to a multiple of ``align``, or of
  ``cta`` where some piece of the last block would start at or past the padded end.

  A TMA copy whose start lies past the array's end came out wrong on an H200 ((6, 1027) @
  (1027, 2), notes/matmul.md); pieces that start inside and run past the end are fine (TMA
  zero-fills and clips them).
  """
  padded = round_up(size, align)
  last_piece = (cdiv(size, cta) - 1) * cta + cta - step
  return padded if last_piece < padded else round_up(size, cta)


def as_stored(p: Problem) -> Problem:
  """``p`` as the kernel runs it: fp8 wgmma reads both operands K-major, so an fp8 B is stored
  (N, K) (``matmul`` transposes one that is not)."""
  if jnp.dtype(p.dtype) in FLOAT8 and not p.trans_b:
    return dataclasses.replace(p, trans_b=True)
  return p


def padded_shapes(p: Problem, c) -> tuple[tuple[int, int], ...]:
  """The shapes A and B are zero-padded to, and the shape of the C the kernel writes.

  The kernel reads only [0, m) x [0, k) of A and [0, k) x [0, n) of B whatever the padding;
  past those, TMA zero-fills (or reads the pad's zeros), so the K tail adds nothing. Swizzled
  TMA wants each array's rows in multiples of 8 and each row in multiples of 128 bytes, and no
  copy may start past an array's end. A and B are read in whole CTA blocks, which start inside
  them. C's pieces past its end are not stored (``epilogue.write_tile``); the residual, read piece by
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


def crop(y, m: int, n: int, *, interpret=False):
  """y[:m, :n] for a 2-D ``y`` at least (m, n); ``y`` itself where it is exactly that."""
  if y.ndim != 2 or y.shape[0] < m or y.shape[1] < n:
    raise ValueError(f"crop: y must be 2-D and at least ({m}, {n}), got shape {y.shape}")
  if tuple(y.shape) == (m, n):
    return y
  kernel = _triton_files.optional("jaxkernels.ops.matmul.triton_crop")
  if kernel is None or _triton_files.pallas_triton() is None:
    return y[:m, :n]  # XLA's slice (0.86 TB/s, above)
  return kernel.crop(y, m, n, interpret=interpret)
