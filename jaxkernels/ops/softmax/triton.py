"""Pallas Triton kernels for softmax over the last axis, forward and backward (CUDA GPUs, sm80+).

Rows up to ``MAX_ONE_PASS_COLS`` wide stay in registers: one read, one write.
Wider rows (vocabularies) use the online softmax: one pass keeps a running
maximum and a sum rescaled as the maximum grows, a second writes the output.
The backward, dx = y * (dy - sum(dy * y)), is the same shape of work.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkernels import hardware, roofline
from jaxkernels._activations import exp
from jaxkernels._pallas import Tile, cdiv, check_fields, is_pow2, next_pow2, triton_params

MAX_ONE_PASS_COLS = 16384
CHUNK_COLS = 4096
TARGET_TILE = 8192  # as for the norms (bench/NOTES.md)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  block_rows: int
  block_cols: int  # next_pow2(N) for one pass, else the chunk width
  num_warps: int
  bwd_block_rows: int
  bwd_num_warps: int

  def __post_init__(self):
    check_fields(self, ("block_rows", "block_cols", "num_warps", "bwd_block_rows",
                        "bwd_num_warps"), is_pow2, "a power of two (Triton tiles are)")


def heuristic(x, chip: hardware.Chip) -> Config:
  del chip
  n_rows, n_cols = x.shape
  padded = next_pow2(n_cols)
  block_cols = padded if padded <= MAX_ONE_PASS_COLS else CHUNK_COLS
  block_rows = max(1, min(TARGET_TILE // block_cols, next_pow2(n_rows)))
  num_warps = max(4, min(16, block_rows * block_cols // 1024))
  return Config(block_rows=block_rows, block_cols=block_cols, num_warps=num_warps,
                bwd_block_rows=block_rows, bwd_num_warps=num_warps)


def unsupported(x, chip) -> str | None:
  del x, chip
  return None


def _finite(m):
  """A fully masked row's maximum (-inf) becomes 0, so exp(x - m) is 0, not NaN."""
  return jnp.where(m == -jnp.inf, 0.0, m)


def _chunk(row0, c, *, n_rows, n_cols, block_rows, block_cols):
  """Column chunk c of the row block starting at row0."""
  return Tile.at(row0, block_rows, c * block_cols, block_cols,
                 n_rows=n_rows, n_cols=n_cols, mask_rows=n_rows % block_rows != 0,
                 mask_cols=n_cols % block_cols != 0)


def _fwd_kernel(x_ref, y_ref, *, n_rows, n_cols, block_rows, block_cols):
  tile = functools.partial(_chunk, pl.program_id(0) * block_rows, n_rows=n_rows,
                           n_cols=n_cols, block_rows=block_rows, block_cols=block_cols)

  if block_cols >= n_cols:
    t = tile(0)
    x = t.load(x_ref, other=-jnp.inf)
    e = exp(x - _finite(jnp.max(x, axis=1))[:, None])
    total = jnp.sum(e, axis=1)
    t.store(y_ref, e * (1.0 / jnp.where(total == 0, 1.0, total))[:, None])
    return

  def online(c, carry):
    peak, total = carry
    x = tile(c).load(x_ref, other=-jnp.inf)
    new_peak = jnp.maximum(peak, jnp.max(x, axis=1))
    safe = _finite(new_peak)
    total = total * exp(peak - safe) + jnp.sum(exp(x - safe[:, None]), axis=1)
    return new_peak, total

  n_chunks = cdiv(n_cols, block_cols)
  peak, total = lax.fori_loop(
      0, n_chunks, online,
      (jnp.full((block_rows,), -jnp.inf, jnp.float32), jnp.zeros((block_rows,), jnp.float32)))
  peak, scale = _finite(peak), 1.0 / jnp.where(total == 0, 1.0, total)

  @pl.loop(0, n_chunks)
  def _(c):
    t = tile(c)
    t.store(y_ref, exp(t.load(x_ref, other=-jnp.inf) - peak[:, None]) * scale[:, None])


def _bwd_kernel(y_ref, dy_ref, dx_ref, *, n_rows, n_cols, block_rows, block_cols):
  tile = functools.partial(_chunk, pl.program_id(0) * block_rows, n_rows=n_rows,
                           n_cols=n_cols, block_rows=block_rows, block_cols=block_cols)

  if block_cols >= n_cols:
    t = tile(0)
    y, dy = t.load(y_ref), t.load(dy_ref)
    t.store(dx_ref, y * (dy - jnp.sum(y * dy, axis=1)[:, None]))
    return

  n_chunks = cdiv(n_cols, block_cols)

  def dot(c, acc):
    t = tile(c)
    return acc + jnp.sum(t.load(y_ref) * t.load(dy_ref), axis=1)

  inner = lax.fori_loop(0, n_chunks, dot, jnp.zeros((block_rows,), jnp.float32))

  @pl.loop(0, n_chunks)
  def _(c):
    t = tile(c)
    t.store(dx_ref, t.load(y_ref) * (t.load(dy_ref) - inner[:, None]))


def _row_call(kernel, operands, out_dtype, block_rows, num_warps, config, cost, name, interpret):
  n_rows, n_cols = operands[0].shape
  return pl.pallas_call(
      functools.partial(kernel, n_rows=n_rows, n_cols=n_cols, block_rows=block_rows,
                        block_cols=config.block_cols),
      out_shape=jax.ShapeDtypeStruct(operands[0].shape, out_dtype),
      grid=(cdiv(n_rows, block_rows),),
      compiler_params=triton_params(num_warps),
      cost_estimate=cost.estimate(),
      interpret=interpret,
      name=name,
  )(*operands)


def forward(x, *, config: Config, interpret=False):
  return _row_call(_fwd_kernel, (x,), x.dtype, config.block_rows, config.num_warps, config,
                   roofline.softmax_fwd(x), "jk_softmax_fwd", interpret)


def backward(y, dy, *, config: Config, interpret=False):
  return _row_call(_bwd_kernel, (y, dy), dy.dtype, config.bwd_block_rows, config.bwd_num_warps,
                   config, roofline.softmax_bwd(y), "jk_softmax_bwd", interpret)
