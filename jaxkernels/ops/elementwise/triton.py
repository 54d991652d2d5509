"""Pallas Triton kernels for bias_activation and glu, forward and backward (CUDA GPUs, sm80+).

Both are one read and one write of each operand: (rows, cols) tiles of
``block_rows x block_cols``, float32 inside. The forward saves nothing beyond
its inputs; the backward recomputes the activation (cheaper than storing it).
d(bias) needs a sum over rows: a persistent grid of ``bwd_programs`` programs
per column block strides over row blocks and keeps its partial sum in
registers, one float32 partial row per program, summed by XLA afterwards.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkernels import _activations, _triton, hardware, roofline
from jaxkernels._tiling import cdiv, check_fields, is_pow2, next_pow2
from jaxkernels._triton import Tile, store_vector

# Elements per program. H200, (16384, 4096) bf16 (notes/rows.md, run 4): glu forward
# 1 x 4096 on 4 warps 3965 GB/s, 2 x 4096 on 8 warps 3883.
TARGET_TILE = 4096
MAX_BLOCK_COLS = 4096
# bias_activation forward: 8 x 1024 on 8 warps, each thread's bias columns reused over 8 rows:
# +5% on bias+silu and bias+gelu over 1 x 4096 (run 23).
BIAS_TARGET_TILE = 8192
BIAS_MAX_BLOCK_COLS = 1024
# Backward: 2 x 4096 on 8 warps beat 1 x 4096 on 4 or 8 (bias+gelu fwd+bwd 0.271 vs 0.311 ms).
TARGET_BWD_TILE = 8192
BWD_PROGRAMS_PER_SM = 2
# Elements a thread holds in bias_activation's backward: 32, but 16 (twice the warps) for the
# GELUs, whose derivatives hold 94-97 registers a thread at 32: bias+gelu backward 0.112 vs
# 0.134 ms, bias+gelu_tanh 0.110 vs 0.121 (runs 23, 25). silu (80 registers) gains nothing.
BWD_ELEMENTS_PER_THREAD = {"gelu": 16, "gelu_tanh": 16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  block_rows: int
  block_cols: int
  num_warps: int
  bwd_block_rows: int
  bwd_num_warps: int
  bwd_programs: int  # bias_activation backward: persistent programs per column block
  bwd_block_cols: int | None = None  # None: block_cols

  def __post_init__(self):
    check_fields(self, ("block_rows", "block_cols", "num_warps", "bwd_block_rows",
                        "bwd_num_warps"), is_pow2, "a power of two (Triton tiles are)")
    check_fields(self, ("bwd_block_cols",), lambda v: v is None or is_pow2(v),
                 "None or a power of two (Triton tiles are)")
    check_fields(self, ("bwd_programs",), lambda v: v >= 1, ">= 1")

  def block(self, backward: bool) -> tuple[int, int]:
    """(rows, cols) of one program's tile in the forward or the backward."""
    if backward:
      return self.bwd_block_rows, self.bwd_block_cols or self.block_cols
    return self.block_rows, self.block_cols


def heuristic(problem, chip: hardware.Chip) -> Config:
  """problem: the call's ``elementwise.api.Problem`` (x the (M, N) view of its first operand)."""
  n_rows, n_cols = problem.x.shape
  activation = problem.activation
  bias = problem.op == "bias_activation"
  target = BIAS_TARGET_TILE if bias else TARGET_TILE
  block_cols = min(next_pow2(n_cols), BIAS_MAX_BLOCK_COLS if bias else MAX_BLOCK_COLS)
  block_rows = max(1, min(target // block_cols, next_pow2(n_rows)))
  bwd_block_cols = min(next_pow2(n_cols), MAX_BLOCK_COLS)
  bwd_block_rows = max(1, min(TARGET_BWD_TILE // bwd_block_cols, next_pow2(n_rows)))
  per_thread = BWD_ELEMENTS_PER_THREAD.get(activation, 32) if bias else 32
  return Config(
      block_rows=block_rows, block_cols=block_cols,
      num_warps=max(4, min(8, block_rows * block_cols // 1024)),
      bwd_block_rows=bwd_block_rows, bwd_block_cols=bwd_block_cols,
      bwd_num_warps=max(4, min(16, bwd_block_rows * bwd_block_cols // (32 * per_thread))),
      bwd_programs=max(1, min(cdiv(n_rows, bwd_block_rows),
                              BWD_PROGRAMS_PER_SM * chip.cores // cdiv(n_cols, bwd_block_cols)
                              or 1)))


def unsupported(problem, chip) -> str | None:
  del problem, chip
  return None


def _tile(row_block, col_block, *, n_rows, n_cols, block_rows, block_cols, mask_rows=None):
  return Tile.at(row_block * block_rows, block_rows, col_block * block_cols, block_cols,
                 n_rows=n_rows, n_cols=n_cols,
                 mask_rows=n_rows % block_rows != 0 if mask_rows is None else mask_rows,
                 mask_cols=n_cols % block_cols != 0)


# --------------------------------------------------------------------------- #
# Kernels
# --------------------------------------------------------------------------- #


def _bias_act_fwd_kernel(x_ref, b_ref, y_ref, *, activation, math, **tiling):
  t = _tile(pl.program_id(0), pl.program_id(1), **tiling)
  z = t.load(x_ref, streamed=True) + t.load_cols(b_ref)[None, :]
  t.store(y_ref, _activations.apply(activation, z, math))


def _bias_act_bwd_kernel(x_ref, b_ref, dy_ref, dx_ref, db_ref, *, activation, math, iters,
                         mask_rows, **tiling):
  pid, col_block, programs = pl.program_id(0), pl.program_id(1), pl.num_programs(0)
  n_cols, block_cols = tiling["n_cols"], tiling["block_cols"]
  columns = Tile.columns(col_block * block_cols, block_cols, n_cols=n_cols,
                         mask_cols=n_cols % block_cols != 0)
  bias = columns.load_cols(b_ref)[None, :]

  def body(i, db):
    t = _tile(pid + i * programs, col_block, mask_rows=mask_rows, **tiling)
    x = t.load(x_ref, streamed=True)
    _, slope = _activations.value_and_grad(activation, x + bias, math)
    dx = t.load(dy_ref, streamed=True) * slope
    t.store(dx_ref, dx)
    return db + jnp.sum(dx, axis=0)  # masked rows loaded dy = 0: they add nothing

  db = lax.fori_loop(0, iters, body, jnp.zeros((block_cols,), jnp.float32))
  store_vector(db_ref, pid * n_cols + columns.cols, db, columns.col_mask)


def _glu_fwd_kernel(g_ref, u_ref, y_ref, *, activation, math, **tiling):
  t = _tile(pl.program_id(0), pl.program_id(1), **tiling)
  gate, up = t.load(g_ref, streamed=True), t.load(u_ref, streamed=True)
  t.store(y_ref, _activations.apply(activation, gate, math) * up)


def _glu_bwd_kernel(g_ref, u_ref, dy_ref, dg_ref, du_ref, *, activation, math, **tiling):
  t = _tile(pl.program_id(0), pl.program_id(1), **tiling)
  value, slope = _activations.value_and_grad(activation, t.load(g_ref, streamed=True), math)
  dy = t.load(dy_ref, streamed=True)
  t.store(dg_ref, dy * t.load(u_ref, streamed=True) * slope)
  t.store(du_ref, dy * value)


def _glu_packed_fwd_kernel(x_ref, y_ref, *, activation, math, **tiling):
  """glu of x = [gate | up] (the two side by side along the row), read in place."""
  t = _tile(pl.program_id(0), pl.program_id(1), **tiling)
  gate = t.load(x_ref, streamed=True)
  up = t.shifted(tiling["n_cols"]).load(x_ref, streamed=True)
  t.store(y_ref, _activations.apply(activation, gate, math) * up)


def _glu_packed_bwd_kernel(x_ref, dy_ref, dx_ref, *, activation, math, **tiling):
  """d[gate | up] written side by side as one array: no concatenation after."""
  t = _tile(pl.program_id(0), pl.program_id(1), **tiling)
  up_tile = t.shifted(tiling["n_cols"])
  value, slope = _activations.value_and_grad(activation, t.load(x_ref, streamed=True), math)
  dy = t.load(dy_ref, streamed=True)
  t.store(dx_ref, dy * up_tile.load(x_ref, streamed=True) * slope)
  up_tile.store(dx_ref, dy * value)


# --------------------------------------------------------------------------- #
# Wrappers
# --------------------------------------------------------------------------- #


def _grid(x, block):
  return (cdiv(x.shape[0], block[0]), cdiv(x.shape[1], block[1]))


def _tiled_call(kernel, operands, out_shape, *, backward, activation, config, cost, name,
                interpret, grid=None, shape=None, **static):
  """A pallas_call over (row block, column block) tiles of ``shape`` (default: the first
  operand's)."""
  (n_rows, n_cols), block = shape or operands[0].shape, config.block(backward)
  return pl.pallas_call(
      functools.partial(kernel, activation=activation, math=_triton.math(interpret),
                        n_rows=n_rows, n_cols=n_cols, block_rows=block[0], block_cols=block[1],
                        **static),
      out_shape=out_shape,
      grid=grid or (cdiv(n_rows, block[0]), cdiv(n_cols, block[1])),
      compiler_params=_triton.params(config.bwd_num_warps if backward else config.num_warps),
      cost_estimate=cost.estimate(),
      interpret=interpret,
      name=name,
  )(*operands)


def bias_activation_fwd(x, bias, *, activation, config: Config, interpret=False):
  return _tiled_call(_bias_act_fwd_kernel, (x, bias), jax.ShapeDtypeStruct(x.shape, x.dtype),
                     backward=False, activation=activation, config=config,
                     cost=roofline.bias_activation_fwd(x, bias, activation),
                     name=f"jk_bias_{activation}_fwd", interpret=interpret)


def bias_activation_bwd(x, bias, dy, *, activation, config: Config, interpret=False):
  n_rows, n_cols = x.shape
  n_blocks, col_blocks = _grid(x, config.block(backward=True))
  programs = min(config.bwd_programs, n_blocks)
  iters = cdiv(n_blocks, programs)
  dx, partial_sums = _tiled_call(
      _bias_act_bwd_kernel, (x, bias, dy),
      [jax.ShapeDtypeStruct(x.shape, dy.dtype),
       jax.ShapeDtypeStruct((programs * n_cols,), jnp.float32)],
      backward=True, activation=activation, config=config,
      cost=roofline.bias_activation_bwd(x, bias, activation), name=f"jk_bias_{activation}_bwd",
      interpret=interpret, grid=(programs, col_blocks), iters=iters,
      mask_rows=iters * programs * config.bwd_block_rows != n_rows)
  return dx, partial_sums.reshape(programs, n_cols).sum(axis=0).astype(bias.dtype)


def glu_fwd(gate, up, *, activation, config: Config, interpret=False):
  """glu's rows; ``up=None``: gate holds [gate | up] side by side, both halves read in
  place."""
  if up is None:
    half = _halves(gate)
    return _tiled_call(_glu_packed_fwd_kernel, (gate,), half, backward=False,
                       activation=activation, config=config,
                       cost=roofline.glu_fwd(half, half, activation),
                       name=f"jk_glu_{activation}_fwd", interpret=interpret, shape=half.shape)
  return _tiled_call(_glu_fwd_kernel, (gate, up), jax.ShapeDtypeStruct(gate.shape, gate.dtype),
                     backward=False, activation=activation, config=config,
                     cost=roofline.glu_fwd(gate, up, activation), name=f"jk_glu_{activation}_fwd",
                     interpret=interpret)


def glu_bwd(gate, up, dy, *, activation, config: Config, interpret=False):
  """(d gate, d up); ``up=None``: (d[gate | up], None), written side by side as one array (no
  concatenation after)."""
  if up is None:
    half = _halves(gate)
    dx = _tiled_call(_glu_packed_bwd_kernel, (gate, dy), jax.ShapeDtypeStruct(gate.shape,
                                                                              gate.dtype),
                     backward=True, activation=activation, config=config,
                     cost=roofline.glu_bwd(half, half, activation),
                     name=f"jk_glu_{activation}_bwd", interpret=interpret, shape=half.shape)
    return dx, None
  dg, du = _tiled_call(
      _glu_bwd_kernel, (gate, up, dy),
      [jax.ShapeDtypeStruct(gate.shape, gate.dtype), jax.ShapeDtypeStruct(up.shape, up.dtype)],
      backward=True, activation=activation, config=config,
      cost=roofline.glu_bwd(gate, up, activation), name=f"jk_glu_{activation}_bwd",
      interpret=interpret)
  return dg, du


def _halves(x):
  """x = [gate | up]: the shape of one half."""
  return jax.ShapeDtypeStruct((x.shape[0], x.shape[1] // 2), x.dtype)
