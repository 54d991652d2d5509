"""Pallas Mosaic GPU kernels for rms_norm and layer_norm, forward and backward (Hopper).

``ctas`` CTAs of one warpgroup: in the forward each takes a run of ``per_cta`` consecutive row
blocks, the hardware starting CTAs as earlier ones end; the backward (and a forward whose
rows are too wide for two CTAs an SM) is persistent, CTA c taking row blocks c, c + ctas, ...
Each block of ``rows`` whole rows comes into shared memory by one tiled bulk copy (a row seen
as (N / piece, piece): a copy moves at most 256 elements along a dimension), ``stages`` blocks
ahead of the one being computed (``plgpu.emit_pipeline``), so the copy engine, not threads,
keeps bytes in flight. A row is read from shared memory in ``chunk``-wide pieces, a
warpgroup-strided vector each (16 contiguous bytes a thread, 128 threads side by side), and
the outputs go from registers straight to global memory: plain vector stores, nothing waits
on them. The backward recomputes the row's statistics from h (already in shared memory), so
the forward writes none. d(scale) and d(bias) accumulate over a CTA's rows in its threads'
registers, carried from step to step, or in shared memory, each element owned by the thread
that updates it (``Config.bwd_sums_in_registers``: layer_norm's in registers where they fit,
rms_norm's in shared memory, as measured), and leave as one float32 row a CTA, summed by XLA.

Nothing here is Hopper-only but the bulk copy, which Blackwell has too: the kernels take no
wgmma, no cluster and no warpgroup register moves. Dispatch still offers them on sm90 alone
(``_mosaic_gpu.hopper_reason``) until a later chip is in ``hardware``'s table and measured.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkernels import _mosaic_gpu, hardware


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(_mosaic_gpu.RowConfig):
  # Pallas' automatic barriers (a warpgroup barrier around every store), or only the one a
  # row needs: all reads of its shared-memory slot done before the next copy refills it.
  auto_barriers: bool = False
  # The backward's d(scale) (and d(bias)) sums in registers, carried from step to step, or in
  # shared memory (``_sums_in_registers``: the widths whose sums registers hold).
  bwd_sums_in_registers: bool = False


def _rings(problem, backward: bool, rows: int) -> list[int]:
  """A block's bytes in each input's ring: x (and the residual) forward; h (the residual's
  dtype, or x's), dy (x's) and, with a residual, dh (the residual's) backward."""
  x, residual = problem.x, problem.residual
  h = x if residual is None else residual
  arrays = (h, x, residual) if backward else (x, residual)
  return [rows * x.shape[1] * jnp.dtype(a.dtype).itemsize for a in arrays if a is not None]


def _sums_in_registers(n_cols: int, has_bias: bool) -> bool:
  """Whether the backward's d(scale) (and d(bias)) sums fit a thread's registers: 64 float32
  a thread, a 4096-wide row's two sums. Wider rows keep them in shared memory."""
  return (2 if has_bias else 1) * n_cols <= _mosaic_gpu.RESIDENT_FLOATS * _mosaic_gpu.WARPGROUP


def _vectors(problem, backward: bool, sums_in_registers: bool) -> list[int]:
  """The float32 rows beside the rings: scale (and bias) forward; scale backward, and the
  d(scale) (and d(bias)) sums where they are not in registers."""
  has_bias, n_cols = problem.bias is not None, problem.x.shape[1]
  count = (2 if has_bias else 1) if not backward else (
      1 if sums_in_registers else 2 + has_bias)
  return [4 * n_cols] * count


def most_stages(problem, chip, *, backward: bool, rows: int, ctas_per_sm: int,
                sums_in_registers: bool = False) -> int:
  """Blocks of ``rows`` rows a CTA's rings hold beside its vectors
  (``_mosaic_gpu.ring_stages``), ``ctas_per_sm`` CTAs sharing an SM's shared memory."""
  return _mosaic_gpu.ring_stages(chip, ctas_per_sm, _rings(problem, backward, rows),
                                 _vectors(problem, backward, sums_in_registers))


# Blocks a forward CTA where the hardware hands out runs of them (``Config.per_cta``), and
# the CTAs an SM whose rings of RUN blocks must fit for that to pay (else a persistent grid):
# layer_norm's two-row blocks beside its float32 scale and bias fit two at (16384, 4096).
RUN = 2
RUN_CTAS_PER_SM = 2


def heuristic(problem, chip: hardware.Chip) -> Config:
  """problem: the call's ``norms.api.Problem``. Measured on an H200 at (16384, 4096) bf16 and
  at the model's (16384, 1024) with a float32 residual (notes/mgpunorm.md, mgpu-norms-3):
  layer_norm takes its rows two to a step (two rows' statistics in flight: forward 0.074 ms
  against 0.087 for one), rms_norm one; rms_norm's backward without a residual (two streams
  in, one out) runs three CTAs an SM (0.175 ms against 0.192 for one), its sums in shared
  memory (in registers its kernel took 0.110 ms against 0.098); the rest one CTA an SM, with as
  many steps in flight as shared memory holds, up to 8. layer_norm's backward carries its
  sums in registers where they fit: its kernel with a bias 0.105 ms against 0.125 in shared
  memory (Triton's 0.118), with a residual no different (mgpu-rows-3). The forward goes in runs of
  RUN blocks a CTA where they fit: rms+residual's 0.134 ms against 0.146 on a persistent grid
  (Triton's 0.132), layer+residual's 0.134 against 0.147 (0.140), layer_norm's 0.069 against
  0.080 (0.072) (mgpu-rows-2)."""
  rows = 2 if problem.layer else 1
  fwd = most_stages(problem, chip, backward=False, rows=rows, ctas_per_sm=1)
  if fwd < 2:
    rows, fwd = 1, most_stages(problem, chip, backward=False, rows=1, ctas_per_sm=1)
  sums = problem.layer and _sums_in_registers(problem.x.shape[1], problem.bias is not None)
  bwd_rows, bwd_per_sm = rows, 1
  if not problem.layer and problem.residual is None:
    bwd_per_sm = 3
  bwd = most_stages(problem, chip, backward=True, rows=bwd_rows, ctas_per_sm=bwd_per_sm,
                    sums_in_registers=sums)
  if bwd < 2:
    bwd_rows, bwd_per_sm = 1, 1
    bwd = most_stages(problem, chip, backward=True, rows=1, ctas_per_sm=1,
                      sums_in_registers=sums)
  # The forward in runs of RUN blocks a CTA, the hardware handing them out as CTAs end, where
  # RUN_CTAS_PER_SM CTAs fit an SM (the backward's d(scale) partials are one float32 row a
  # CTA: it keeps its persistent grid).
  run = 0
  if most_stages(problem, chip, backward=False, rows=rows, ctas_per_sm=RUN_CTAS_PER_SM) >= RUN:
    run = _mosaic_gpu.run_length(problem.x.shape[0] // rows, RUN, chip)
  return Config(stages=max(1, min(8, fwd)), ctas_per_sm=1, rows=rows,
                bwd_stages=max(1, min(8, bwd)), bwd_ctas_per_sm=bwd_per_sm, bwd_rows=bwd_rows,
                per_cta=run, bwd_sums_in_registers=sums)


def unsupported(problem, chip) -> str | None:
  reason = _mosaic_gpu.hopper_reason(chip)
  if reason is not None:
    return reason
  n_cols = problem.x.shape[1]
  reason = _mosaic_gpu.width_reason(n_cols, problem.x.dtype, jnp.float32,
                                    None if problem.residual is None else problem.residual.dtype)
  if reason is not None:
    return reason
  for backward in (False, True):
    if most_stages(problem, chip, backward=backward, rows=1, ctas_per_sm=1) < 2:
      return (f"mosaic_gpu's {'backward' if backward else 'forward'} holds two rows of "
              f"{n_cols} columns ({sum(_rings(problem, backward, 1))} bytes each) and its "
              f"float32 vectors in shared memory, more than the "
              f"{_mosaic_gpu.cta_smem_bytes(chip)} bytes a CTA has")
  return None


def config_error(problem, config: Config, chip: hardware.Chip) -> str | None:
  n_cols, has_bias = problem.x.shape[1], problem.bias is not None
  if config.bwd_sums_in_registers and not _sums_in_registers(n_cols, has_bias):
    return (f"bwd_sums_in_registers=True holds {2 if has_bias else 1} float32 rows of "
            f"{n_cols} a warpgroup in registers, more than "
            f"{_mosaic_gpu.RESIDENT_FLOATS} a thread; it takes False at this width")
  return config.error(functools.partial(most_stages,
                                        sums_in_registers=config.bwd_sums_in_registers),
                      problem, chip)


# --------------------------------------------------------------------------- #
# Kernels
# --------------------------------------------------------------------------- #


def _moments(row: _mosaic_gpu.Row, h_of, pivot, *, layer: bool, eps: float, g_of=None):
  """One pass over a row whose float32 chunk c is h_of(c): (mean or None, rstd) and, given the
  backward's g_of (dy * scale), mean(g * n) and (layer_norm) mean(g) for n = (h - mean) * rstd.

  layer_norm's sums are shifted by ``pivot`` (the row's first value), so that they are
  independent reductions in one pass where the mean and the centred squares would take two,
  with bounded cancellation: (mean - pivot)^2 <= N * var for any pivot drawn from the row, so
  the variance loses at most ~N float32 ulps, and typically none (the Triton kernel's scheme).
  """
  n = float(row.n_cols)
  if not layer:
    def terms(c):
      h = h_of(c)
      return (h * h,) if g_of is None else (h * h, g_of(c) * h)
    sums = row.sums(terms)
    rstd = lax.rsqrt(sums[0] / n + eps)
    return (None, rstd) if g_of is None else (None, rstd, sums[1] * rstd / n, None)

  def shifted(c):
    d = h_of(c) - pivot
    if g_of is None:
      return d, d * d
    g = g_of(c)
    return d, d * d, g * d, g
  sums = row.sums(shifted)
  mean_d = sums[0] / n
  rstd = lax.rsqrt(jnp.maximum(sums[1] / n - mean_d * mean_d, 0.0) + eps)
  mean = pivot + mean_d
  if g_of is None:
    return mean, rstd
  # sum(g * n) = rstd * sum(g * (d - mean_d)), taken from the shifted sums
  return mean, rstd, rstd * (sums[2] - mean_d * sums[3]) / n, sums[3] / n


def _fwd_kernel(*refs, layer, has_residual, has_bias, n_blocks, rows, row, stages, ctas,
                per_cta, eps, auto_barriers):
  refs = list(refs)
  x_g = refs.pop(0)
  r_g = refs.pop(0) if has_residual else None
  s_g = refs.pop(0)
  b_g = refs.pop(0) if has_bias else None
  y_g = refs.pop(0)
  h_g = refs.pop(0) if has_residual else None
  s_smem = refs.pop(0)
  b_smem = refs.pop(0) if has_bias else None
  barrier = refs.pop(0)

  cta = lax.axis_index("cta")
  _mosaic_gpu.copy_vectors([(s_g, s_smem)] + ([(b_g, b_smem)] if has_bias else []), barrier.at[0])
  count, block, spec = _mosaic_gpu.row_blocks(cta, ctas, n_blocks, rows, row, per_cta)

  def body(indices, x_block, *rest):
    (i,) = indices
    first = block(i) * rows

    def h_of(j):
      def h(c):
        out = row.load(x_block.at[j], c)
        return out + row.load(rest[0].at[j], c) if has_residual else out
      return h

    def pivot(j):  # the row's first value
      p = x_block[j, 0, 0].astype(jnp.float32)
      return p + rest[0][j, 0, 0].astype(jnp.float32) if has_residual else p

    # Every row's statistics, then the outputs chunk by chunk, the block's rows side by side.
    stats = [_moments(row, h_of(j), pivot(j) if layer else None, layer=layer, eps=eps)
             for j in range(rows)]
    for c in row.chunks:
      scale = row.load(s_smem, c)
      bias = row.load(b_smem, c) if has_bias else None
      for j, (mean, rstd) in enumerate(stats):
        h = h_of(j)(c)
        y = (h - mean if layer else h) * rstd * scale
        if has_bias:
          y = y + bias
        y_g.at[first + j, row.cols(c)][...] = y.astype(y_g.dtype)
        if has_residual:
          h_g.at[first + j, row.cols(c)][...] = h.astype(h_g.dtype)
    if not auto_barriers:  # every thread's reads of the slot done before it is refilled
      plgpu.commit_smem()

  inputs = [x_g] + ([r_g] if has_residual else [])
  plgpu.emit_pipeline(body, grid=(count,), in_specs=[spec] * len(inputs),
                      max_concurrent_steps=stages)(*inputs)


def _bwd_kernel(*refs, layer, has_dh, has_bias, dual_dx, n_blocks, rows, row, stages, ctas,
                per_cta, eps, auto_barriers):
  refs = list(refs)
  h_g, s_g, dy_g = refs.pop(0), refs.pop(0), refs.pop(0)
  dh_g = refs.pop(0) if has_dh else None
  dx_g = refs.pop(0)
  dr_g = refs.pop(0) if dual_dx else None
  ds_g = refs.pop(0)
  db_g = refs.pop(0) if has_bias else None
  s_smem = refs.pop(0)
  # The sums: (d(scale), d(bias)) chunks carried in registers from step to step, or rows in
  # shared memory, each element owned by the thread that updates it.
  sums_smem = refs[:-1]
  barrier = refs[-1]
  n_sums = 2 if has_bias else 1

  cta = lax.axis_index("cta")
  _mosaic_gpu.copy_vectors([(s_g, s_smem)], barrier.at[0])
  for acc in sums_smem:
    for c in row.chunks:
      acc.at[row.cols(c)][...] = row.zeros()
  count, block, spec = _mosaic_gpu.row_blocks(cta, ctas, n_blocks, rows, row, per_cta)

  def body(indices, h_block, dy_block, *rest):
    (i,) = indices
    first = block(i) * rows
    if not sums_smem:
      *rest, carry = rest
      carry = [list(chunks) for chunks in carry]

    def h_of(j):
      return lambda c: row.load(h_block.at[j], c)

    def g_of(j):
      return lambda c: row.load(dy_block.at[j], c) * row.load(s_smem, c)

    stats = [_moments(row, h_of(j), h_block[j, 0, 0].astype(jnp.float32) if layer else None,
                      layer=layer, eps=eps, g_of=g_of(j)) for j in range(rows)]
    for c in row.chunks:
      scale = row.load(s_smem, c)
      d_scale = d_bias = None
      for j, (mean, rstd, gn, g_mean) in enumerate(stats):
        dy, h = row.load(dy_block.at[j], c), h_of(j)(c)
        n = (h - mean if layer else h) * rstd
        d = dy * scale - n * gn
        if layer:
          d = d - g_mean
        dx = d * rstd
        if has_dh:
          dx = dx + row.load(rest[0].at[j], c)
        dx_g.at[first + j, row.cols(c)][...] = dx.astype(dx_g.dtype)
        if dual_dx:
          dr_g.at[first + j, row.cols(c)][...] = dx.astype(dr_g.dtype)
        d_scale = dy * n if d_scale is None else d_scale + dy * n
        if has_bias:
          d_bias = dy if d_bias is None else d_bias + dy
      for k, term in enumerate([d_scale, d_bias][:n_sums]):
        if sums_smem:
          sums_smem[k].at[row.cols(c)][...] = row.load(sums_smem[k], c) + term
        else:
          carry[k][c] = carry[k][c] + term
    if not auto_barriers:
      plgpu.commit_smem()
    if not sums_smem:
      return tuple(tuple(chunks) for chunks in carry)
    return None

  inputs = [h_g, dy_g] + ([dh_g] if has_dh else [])
  init = (None if sums_smem else
          tuple(tuple(row.zeros() for _ in row.chunks) for _ in range(n_sums)))
  carry = plgpu.emit_pipeline(body, grid=(count,), in_specs=[spec] * len(inputs),
                              max_concurrent_steps=stages, init_carry=init)(*inputs)
  for k, out in enumerate([ds_g] + ([db_g] if has_bias else [])):
    for c in row.chunks:
      out.at[cta, row.cols(c)][...] = (row.load(sums_smem[k], c) if sums_smem
                                       else carry[k][c])


# --------------------------------------------------------------------------- #
# Wrappers
# --------------------------------------------------------------------------- #


def forward(x, scale, bias, residual, *, layer: bool, eps: float, config: Config,
            interpret=False):
  """x, residual: (M, N). Returns (y, h or None, ()): the backward recomputes the statistics."""
  n_rows, n_cols = x.shape
  row = _mosaic_gpu.Row.of(n_cols, interpret, x, residual)
  rows = config.rows if n_rows % config.rows == 0 else 1
  per_cta, ctas, stages = _mosaic_gpu.row_launch(n_rows // rows, config.ctas_per_sm,
                                                 config.per_cta, config.stages)
  kernel = functools.partial(
      _fwd_kernel, layer=layer, has_residual=residual is not None, has_bias=bias is not None,
      n_blocks=n_rows // rows, rows=rows, row=row, stages=stages, ctas=ctas, per_cta=per_cta,
      eps=eps,
      auto_barriers=config.auto_barriers)
  shape = row.pieces(x).shape
  out_type = [jax.ShapeDtypeStruct(shape, x.dtype)]
  if residual is not None:
    out_type.append(jax.ShapeDtypeStruct(shape, residual.dtype))
  vectors = [scale] + ([bias] if bias is not None else [])
  vectors = [row.pieces(v.astype(jnp.float32)) for v in vectors]
  scratch = [plgpu.SMEM(v.shape, jnp.float32) for v in vectors]
  scratch.append(plgpu.Barrier(num_arrivals=len(vectors), num_barriers=1))
  inputs = [row.pieces(x)] + ([row.pieces(residual)] if residual is not None else [])
  name = f"jk_{'layer' if layer else 'rms'}_norm_fwd_mgpu"
  outs = _mosaic_gpu.row_kernel(kernel, out_type, scratch, ctas, name=name, interpret=interpret,
                                auto_barriers=config.auto_barriers)(*inputs, *vectors)
  outs = [o.reshape(n_rows, n_cols) for o in outs]
  return outs[0], (outs[1] if residual is not None else None), ()


def backward(h, scale, bias, stats, dy, dh, *, layer: bool, eps: float, config: Config,
             residual_dtype=None, interpret=False):
  """Returns (dx, dresidual, dscale, dbias) for the (M, N) views, as the Triton backward does;
  ``stats`` is the forward's () (recomputed here from h)."""
  del stats
  n_rows, n_cols = h.shape
  dual_dx = residual_dtype is not None and jnp.dtype(residual_dtype) != dy.dtype
  row = _mosaic_gpu.Row.of(n_cols, interpret, h, dy, dh)
  rows = config.bwd_rows if n_rows % config.bwd_rows == 0 else 1
  per_cta, ctas, stages = _mosaic_gpu.row_launch(n_rows // rows, config.bwd_ctas_per_sm,
                                                 config.bwd_per_cta, config.bwd_stages)
  kernel = functools.partial(
      _bwd_kernel, layer=layer, has_dh=dh is not None, has_bias=bias is not None,
      dual_dx=dual_dx, n_blocks=n_rows // rows, rows=rows, row=row, stages=stages, ctas=ctas,
      per_cta=per_cta, eps=eps,
      auto_barriers=config.auto_barriers)
  shape = row.pieces(h).shape
  out_type = [jax.ShapeDtypeStruct(shape, dy.dtype)]
  if dual_dx:
    out_type.append(jax.ShapeDtypeStruct(shape, residual_dtype))
  partials = jax.ShapeDtypeStruct((ctas, *shape[1:]), jnp.float32)
  out_type += [partials] * (2 if bias is not None else 1)
  n_smem = 1 + (0 if config.bwd_sums_in_registers else (2 if bias is not None else 1))
  scratch = [plgpu.SMEM(shape[1:], jnp.float32) for _ in range(n_smem)]
  scratch.append(plgpu.Barrier(num_arrivals=1, num_barriers=1))
  inputs = [row.pieces(h), row.pieces(scale.astype(jnp.float32)), row.pieces(dy)]
  if dh is not None:
    inputs.append(row.pieces(dh))
  name = f"jk_{'layer' if layer else 'rms'}_norm_bwd_mgpu"
  outs = list(_mosaic_gpu.row_kernel(kernel, out_type, scratch, ctas, name=name,
                                     interpret=interpret,
                                     auto_barriers=config.auto_barriers)(*inputs))
  dx = outs.pop(0).reshape(n_rows, n_cols)
  dr = outs.pop(0).reshape(n_rows, n_cols) if dual_dx else None
  dscale = outs.pop(0).sum(axis=0).reshape(n_cols).astype(scale.dtype)
  dbias = (outs.pop(0).sum(axis=0).reshape(n_cols).astype(bias.dtype) if bias is not None
           else None)
  return dx, dr, dscale, dbias
