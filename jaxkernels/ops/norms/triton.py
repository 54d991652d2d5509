"""Pallas Triton kernels for rms_norm and layer_norm, forward and backward (CUDA GPUs, sm80+).

Forward: one program normalises ``block_rows`` rows. Rows up to
``MAX_ONE_PASS_COLS`` wide are held in registers: x (and the residual) are read
once, y (and h = x + residual) written once, plus float32 rstd (and mean) per
row for the backward. Wider rows are walked in ``block_cols`` chunks twice
(statistics, then output), the second read mostly from L2.

Backward: a persistent grid of ``bwd_programs`` programs, each striding over
row blocks; dx is written as it is computed and d(scale), d(bias) accumulate in
registers, one float32 partial row per program, summed by XLA afterwards
(deterministic, unlike atomics). For wide rows the kernel computes dx and XLA
reduces d(scale), d(bias) in one extra pass over h and dy.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkernels import _triton, hardware, roofline
from jaxkernels._tiling import cdiv, check_fields, is_pow2, next_pow2
from jaxkernels._triton import Tile, row_sums, store_vector

# Widest row (power-of-two padded) kept in registers in one pass; wider rows are chunked.
MAX_ONE_PASS_COLS = 16384
# Elements per forward program. Measured on an H200 at (16384, 4096) bf16 with device timing
# (notes/rows.md, run 3): 2 rows x 8 warps (32 elements a thread) 3464 GB/s, 1 x 4 3381,
# 4 x 8 3416; a persistent grid and register prefetch were slower.
TARGET_TILE = 8192
# Forward elements a thread (runs 33-34, same shape): rms_norm at 16 (2 rows x 16 warps, 40
# registers, three programs an SM) 134-136 us against 139 at 32; layer_norm at 16 holds 42-43
# registers, two programs an SM, 160 us against 147 at 32.
FWD_ELEMENTS_PER_THREAD = {False: 16, True: 32}  # by layer
# Backward elements a program, by layer. The backward holds ~6 float32 values per element live:
# at 4096 columns 1 row x 8 warps was best (bwd 0.155 ms), 4 rows x 4 warps spilled (2-3 ms).
# rms_norm with the model's float32 residual (train-step-2, H200: x bfloat16, residual, h and
# dresidual float32, 16 bytes an element moved): at (16384, 1024) one row x 16 warps, four
# programs an SM, 70.5 us against 102.0 for 4 rows (the 4096-element tile), and at (8192,
# 2048) 71-76 us against 101.8: one row a program, many programs, hide the latency better.
TARGET_BWD_TILE = {False: 1024, True: 4096}
# Backward elements a thread (run 43, 4096 columns, after the FMAs): rms_norm at 8 (1 row x 16
# warps, 64 registers, two programs an SM) 143.6 us against 147.8 at 16; layer_norm at 8 holds
# 75 registers, one program of 16 warps an SM (199.7 us), so it keeps 16 (127 registers).
# rms_norm at 2 gives 16 warps to rows of 1024-4096 (at 4096 what 8 gave; at 1024 and 2048
# 16 warps beat 8 and 4: 70.5 / 71.5 / 78.4 us at 1024, train-step-2).
BWD_ELEMENTS_PER_THREAD = {False: 2, True: 16}  # by layer
# Persistent backward programs per SM, as registers allow (BWD_ELEMENTS_PER_SM): layer_norm 2
# x 8 warps beat 4 (run 3: 0.310 vs 0.313 ms); rms_norm's narrow rows 4 (train-step-2: 528
# programs 70.5 us, 264 91.6, at (16384, 1024); at 4096 columns registers allow 2, as before).
BWD_PROGRAMS_PER_SM = {False: 4, True: 2}
# ... as long as they fit: the backward holds ~8 registers an element of its row block (64-127
# a thread at 8-16 elements), so an SM's 64K registers hold 8192 elements, two 4096-wide row
# blocks but one 8192-wide. At 4096x8192 a second program an SM ran as a second wave: 264
# programs 81.9 / 90.2 us (rms / layer), 132 programs 77.5 / 83.1 (notes/rows.md, run 48).
BWD_ELEMENTS_PER_SM = 8192


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  block_rows: int  # rows per forward program
  block_cols: int  # columns per pass: next_pow2(N) for one pass, else the chunk width
  num_warps: int
  bwd_block_rows: int
  bwd_num_warps: int
  bwd_programs: int  # persistent backward grid size (one-pass rows)

  def __post_init__(self):
    check_fields(self, ("block_rows", "block_cols", "num_warps", "bwd_block_rows",
                        "bwd_num_warps"), is_pow2, "a power of two (Triton tiles are)")
    check_fields(self, ("bwd_programs",), lambda v: v >= 1, ">= 1")

  def one_pass(self, n_cols: int) -> bool:
    return self.block_cols >= n_cols


def heuristic(problem, chip: hardware.Chip) -> Config:
  """problem: the call's ``norms.api.Problem`` (x its (M, N) view)."""
  layer = problem.layer
  n_rows, n_cols = problem.x.shape
  padded = next_pow2(n_cols)
  block_cols = padded if padded <= MAX_ONE_PASS_COLS else 4096
  block_rows = max(1, min(TARGET_TILE // block_cols, next_pow2(n_rows)))
  per_thread = 32 * FWD_ELEMENTS_PER_THREAD[layer]
  num_warps = max(4, min(16, block_rows * block_cols // per_thread))
  bwd_block_rows = max(1, min(TARGET_BWD_TILE[layer] // block_cols, next_pow2(n_rows)))
  bwd_per_thread = 32 * BWD_ELEMENTS_PER_THREAD[layer]
  bwd_num_warps = max(4, min(16, bwd_block_rows * block_cols // bwd_per_thread))
  per_sm = max(1, min(BWD_PROGRAMS_PER_SM[layer],
                      BWD_ELEMENTS_PER_SM // (bwd_block_rows * block_cols)))
  bwd_programs = max(1, min(cdiv(n_rows, bwd_block_rows), per_sm * chip.cores))
  return Config(block_rows=block_rows, block_cols=block_cols, num_warps=num_warps,
                bwd_block_rows=bwd_block_rows, bwd_num_warps=bwd_num_warps,
                bwd_programs=bwd_programs)


def unsupported(problem, chip) -> str | None:
  del problem, chip  # any width: rows wider than a pass are chunked
  return None


# --------------------------------------------------------------------------- #
# Kernels
# --------------------------------------------------------------------------- #


def _centered(h, mean, col_mask):
  """h - mean (h itself for RMS), zero in padding columns so they add nothing to row sums."""
  if mean is None:
    return h  # padding columns were loaded as 0
  centered = h - mean[:, None]
  return centered if col_mask is None else jnp.where(col_mask[None, :], centered, 0.0)


def _fwd_kernel(*refs, layer, has_residual, has_bias, n_rows, n_cols, block_rows,
                block_cols, eps, fma):
  refs = list(refs)
  x_ref = refs.pop(0)
  r_ref = refs.pop(0) if has_residual else None
  s_ref = refs.pop(0)
  b_ref = refs.pop(0) if has_bias else None
  y_ref = refs.pop(0)
  h_ref = refs.pop(0) if has_residual else None
  rstd_ref = refs.pop(0)
  mean_ref = refs.pop(0) if layer else None

  pid = pl.program_id(0)
  mask_rows = n_rows % block_rows != 0
  mask_cols = n_cols % block_cols != 0

  def tile(block, col0=0):
    return Tile.at(block * block_rows, block_rows, col0, block_cols, n_rows=n_rows,
                   n_cols=n_cols, mask_rows=mask_rows, mask_cols=mask_cols)

  def load_h(t):
    h = t.load(x_ref, streamed=True)
    return h + t.load(r_ref, streamed=True) if has_residual else h

  def write_y(t, h, mean, rstd):
    n = _centered(h, mean, t.col_mask) * rstd[:, None]
    s = t.load_cols(s_ref)[None, :]
    # The bias past L1: the ~23 KB that Triton's launch leaves L1 then holds the float32 scale
    # row every program rereads, where scale and bias together (32 KB) evicted each other
    # (notes/rows.md, runs 45-46).
    t.store(y_ref, fma(n, s, t.load_cols(b_ref, streamed=True)[None, :]) if has_bias else n * s)

  def write_stats(t, mean, rstd):
    t.store_rows(rstd_ref, rstd)
    if layer:
      t.store_rows(mean_ref, mean)

  if block_cols < n_cols:  # chunked: statistics (Chan's parallel merge), then output
    n_chunks = cdiv(n_cols, block_cols)

    def stats(c, carry):
      mean, m2, count = carry
      t = tile(pid, c * block_cols)
      h = load_h(t)
      if has_residual:
        t.store(h_ref, h)
      if not layer:
        return mean, m2 + jnp.sum(h * h, axis=1), count
      width = jnp.minimum(block_cols, n_cols - c * block_cols).astype(jnp.float32)
      chunk_mean = jnp.sum(h, axis=1) / width
      d = _centered(h, chunk_mean, t.col_mask)
      delta = chunk_mean - mean
      total = count + width
      return (mean + delta * (width / total),
              m2 + jnp.sum(d * d, axis=1) + delta * delta * (count * width / total),
              total)

    zeros = jnp.zeros((block_rows,), jnp.float32)
    mean, m2, _ = lax.fori_loop(0, n_chunks, stats, (zeros, zeros, jnp.float32(0)))
    rstd = lax.rsqrt(m2 / n_cols + eps)
    mean = mean if layer else None

    @pl.loop(0, n_chunks)
    def _(c):
      t = tile(pid, c * block_cols)
      write_y(t, load_h(t), mean, rstd)  # x (+ residual) again: exact h, mostly L2 hits

    write_stats(tile(pid), mean, rstd)
    return

  # One pass: the rows stay in registers.
  t = tile(pid)
  h = load_h(t)
  if layer:
    # Mean and variance in one pass, shifted by a pivot (each row's first value) so the two
    # sums are independent reductions instead of a chain of two. Cancellation is bounded:
    # (mean - pivot)^2 <= N * var for any pivot drawn from the row, so the variance loses at
    # most ~N float32 ulps, and typically none. The pivot is loaded before h is stored (after
    # the store, the SASS issued it only once the stores were: 0.7% on the kernel clock, run 27).
    first = Tile(t.rows, jnp.zeros((1,), jnp.int32), t.row_mask, None)
    pivot = load_h(first)[:, 0]
  if has_residual:
    t.store(h_ref, h)
  if layer:
    shifted = _centered(h, pivot, t.col_mask)
    s1, s2 = row_sums(shifted, shifted * shifted)
    s1 = s1 / n_cols
    var = jnp.maximum(s2 / n_cols - s1 * s1, 0.0)
    mean = pivot + s1
  else:
    mean, var = None, jnp.sum(h * h, axis=1) / n_cols
  rstd = lax.rsqrt(var + eps)
  write_y(t, h, mean, rstd)
  write_stats(t, mean, rstd)


def _bwd_one_pass_kernel(*refs, layer, has_dh, has_bias, dual_dx, n_rows, n_cols,
                         block_rows, block_cols, iters, mask_rows, fma):
  refs = list(refs)
  h_ref, s_ref, dy_ref = refs.pop(0), refs.pop(0), refs.pop(0)
  dh_ref = refs.pop(0) if has_dh else None
  rstd_ref = refs.pop(0)
  mean_ref = refs.pop(0) if layer else None
  dx_ref = refs.pop(0)
  dr_ref = refs.pop(0) if dual_dx else None
  ds_ref = refs.pop(0)
  db_ref = refs.pop(0) if has_bias else None

  pid, programs = pl.program_id(0), pl.num_programs(0)
  mask_cols = n_cols % block_cols != 0
  scale = Tile.columns(0, block_cols, n_cols=n_cols, mask_cols=mask_cols)
  s = scale.load_cols(s_ref)[None, :]

  def body(i, carry):  # row blocks pid, pid + programs, ...: d(scale) stays in registers
    ds, db = carry
    t = Tile.at((pid + i * programs) * block_rows, block_rows, 0, block_cols, n_rows=n_rows,
                n_cols=n_cols, mask_rows=mask_rows, mask_cols=mask_cols)
    # Every load of the block before the row reduction, so all three streams are in flight
    # together: dh loaded after it (where it is used) cost 4-6% (notes/rows.md, run 16).
    h, dy = t.load(h_ref, streamed=True), t.load(dy_ref, streamed=True)
    dh_in = t.load(dh_ref, streamed=True) if has_dh else None
    rstd = t.load_rows(rstd_ref)  # 0 for rows past the end: no inf, no NaN
    mean = t.load_rows(mean_ref) if layer else None
    n = _centered(h, mean, t.col_mask) * rstd[:, None]
    g = dy * s
    if layer:
      gn, g_sum = row_sums(g * n, g)
      dh = fma(n, (-gn / n_cols)[:, None], g - (g_sum / n_cols)[:, None])
    else:
      dh = fma(n, (-jnp.sum(g * n, axis=1) / n_cols)[:, None], g)
    dh = fma(dh, rstd[:, None], dh_in) if has_dh else dh * rstd[:, None]
    t.store(dx_ref, dh)
    if dual_dx:
      t.store(dr_ref, dh)
    if block_rows == 1:  # the row is the partial sum's update: one FMA an element
      ds = jnp.sum(fma(dy, n, ds[None, :]), axis=0)
    else:
      ds = ds + jnp.sum(dy * n, axis=0)
    if has_bias:
      db = db + jnp.sum(dy, axis=0)
    return ds, db

  zeros = jnp.zeros((block_cols,), jnp.float32)
  ds, db = lax.fori_loop(0, iters, body, (zeros, zeros))
  offsets = pid * n_cols + scale.cols
  store_vector(ds_ref, offsets, ds, scale.col_mask)
  if has_bias:
    store_vector(db_ref, offsets, db, scale.col_mask)


def _bwd_chunked_kernel(*refs, layer, has_dh, dual_dx, n_rows, n_cols, block_rows, block_cols):
  refs = list(refs)
  h_ref, s_ref, dy_ref = refs.pop(0), refs.pop(0), refs.pop(0)
  dh_ref = refs.pop(0) if has_dh else None
  rstd_ref = refs.pop(0)
  mean_ref = refs.pop(0) if layer else None
  dx_ref = refs.pop(0)
  dr_ref = refs.pop(0) if dual_dx else None

  row0 = pl.program_id(0) * block_rows
  n_chunks = cdiv(n_cols, block_cols)

  def tile(c):
    return Tile.at(row0, block_rows, c * block_cols, block_cols, n_rows=n_rows,
                   n_cols=n_cols, mask_rows=n_rows % block_rows != 0,
                   mask_cols=n_cols % block_cols != 0)

  t0 = tile(0)
  rstd = t0.load_rows(rstd_ref)
  mean = t0.load_rows(mean_ref) if layer else None

  def n_and_g(t):
    n = _centered(t.load(h_ref, streamed=True), mean, t.col_mask) * rstd[:, None]
    return n, t.load(dy_ref, streamed=True) * t.load_cols(s_ref)[None, :]

  def sums(c, carry):
    gn, g_sum = carry
    n, g = n_and_g(tile(c))
    chunk_gn, chunk_g = row_sums(g * n, g)
    return gn + chunk_gn, g_sum + chunk_g

  zeros = jnp.zeros((block_rows,), jnp.float32)
  gn, g_sum = lax.fori_loop(0, n_chunks, sums, (zeros, zeros))
  c1, c2 = gn / n_cols, g_sum / n_cols

  @pl.loop(0, n_chunks)
  def _(c):
    t = tile(c)
    n, g = n_and_g(t)
    dh = g - n * c1[:, None]
    if layer:
      dh = dh - c2[:, None]
    dh = dh * rstd[:, None]
    if has_dh:
      dh = dh + t.load(dh_ref, streamed=True)
    t.store(dx_ref, dh)
    if dual_dx:
      t.store(dr_ref, dh)


# --------------------------------------------------------------------------- #
# Wrappers
# --------------------------------------------------------------------------- #


def forward(x, scale, bias, residual, *, layer: bool, eps: float, config: Config,
            interpret=False):
  """x, residual: (M, N). Returns (y, h or None, stats) with stats = (rstd,) or (rstd, mean)."""
  n_rows, n_cols = x.shape
  kernel = functools.partial(
      _fwd_kernel, layer=layer, has_residual=residual is not None, has_bias=bias is not None,
      n_rows=n_rows, n_cols=n_cols, block_rows=config.block_rows,
      block_cols=config.block_cols, eps=eps, fma=_triton.math(interpret).fma)
  stats = jax.ShapeDtypeStruct((n_rows,), jnp.float32)
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
  if residual is not None:
    out_shape.append(jax.ShapeDtypeStruct(residual.shape, residual.dtype))
  out_shape += [stats] * (2 if layer else 1)
  inputs = [a for a in (x, residual, scale, bias) if a is not None]
  cost = roofline.norm_fwd(x, scale, bias, residual, layer=layer, stats=2 if layer else 1)
  outs = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(cdiv(n_rows, config.block_rows),),
      compiler_params=_triton.params(config.num_warps),
      cost_estimate=cost.estimate(),
      interpret=interpret,
      name=f"jk_{'layer' if layer else 'rms'}_norm_fwd",
  )(*inputs)
  outs = list(outs)
  y = outs.pop(0)
  h = outs.pop(0) if residual is not None else None
  return y, h, tuple(outs)


def backward(h, scale, bias, stats, dy, dh, *, layer: bool, eps: float, config: Config,
             residual_dtype=None, interpret=False):
  """Returns (dx, dresidual, dscale, dbias) for the (M, N) views.

  dresidual is None unless residual_dtype differs from dy's (then dx serves for both);
  dbias is None without a bias.
  """
  del eps  # the forward saved rstd
  n_rows, n_cols = h.shape
  rstd = stats[0]
  mean = stats[1] if layer else None
  dual_dx = residual_dtype is not None and jnp.dtype(residual_dtype) != dy.dtype
  inputs = [a for a in (h, scale, dy, dh, rstd, mean) if a is not None]
  out_shape = [jax.ShapeDtypeStruct(h.shape, dy.dtype)]
  if dual_dx:
    out_shape.append(jax.ShapeDtypeStruct(h.shape, residual_dtype))
  cost = roofline.norm_bwd(dy, scale, bias, dh, layer=layer, stats=len(stats))
  name = f"jk_{'layer' if layer else 'rms'}_norm_bwd"

  def call(kernel, grid, extra_outputs=()):
    """(dx, dresidual or None, [extra outputs]) of one backward pallas_call."""
    outs = list(pl.pallas_call(
        kernel,
        out_shape=out_shape + list(extra_outputs),
        grid=(grid,),
        compiler_params=_triton.params(config.bwd_num_warps),
        cost_estimate=cost.estimate(),
        interpret=interpret,
        name=name,
    )(*inputs))
    return outs.pop(0), (outs.pop(0) if dual_dx else None), outs

  if config.one_pass(n_cols):
    block_rows = config.bwd_block_rows
    n_blocks = cdiv(n_rows, block_rows)
    programs = min(config.bwd_programs, n_blocks)
    iters = cdiv(n_blocks, programs)
    kernel = functools.partial(
        _bwd_one_pass_kernel, layer=layer, has_dh=dh is not None, has_bias=bias is not None,
        dual_dx=dual_dx, n_rows=n_rows, n_cols=n_cols, block_rows=block_rows,
        block_cols=config.block_cols, iters=iters,
        mask_rows=iters * programs * block_rows != n_rows, fma=_triton.math(interpret).fma)
    partial_sums = jax.ShapeDtypeStruct((programs * n_cols,), jnp.float32)
    dx, dr, sums = call(kernel, programs, [partial_sums] * (2 if bias is not None else 1))
    dscale = sums[0].reshape(programs, n_cols).sum(axis=0)
    dbias = sums[1].reshape(programs, n_cols).sum(axis=0) if bias is not None else None
  else:
    kernel = functools.partial(
        _bwd_chunked_kernel, layer=layer, has_dh=dh is not None, dual_dx=dual_dx,
        n_rows=n_rows, n_cols=n_cols, block_rows=config.bwd_block_rows,
        block_cols=config.block_cols)
    dx, dr, _ = call(kernel, cdiv(n_rows, config.bwd_block_rows))
    # Rows too wide for registers: XLA reduces d(scale), d(bias) in one fused pass over h, dy.
    dy32, h32 = dy.astype(jnp.float32), h.astype(jnp.float32)
    centered = h32 - mean[:, None] if layer else h32
    dscale = jnp.sum(dy32 * centered * rstd[:, None], axis=0)
    dbias = jnp.sum(dy32, axis=0) if bias is not None else None

  dscale = dscale.astype(scale.dtype)
  dbias = dbias.astype(bias.dtype) if bias is not None else None
  return dx, dr, dscale, dbias
