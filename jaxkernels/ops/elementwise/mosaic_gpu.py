"""Pallas Mosaic GPU kernels for bias_activation and glu (two inputs, or [gate | up] packed),
forward and backward (Hopper).

One-warpgroup CTAs, each fixed on one column chunk of the rows (``chunk`` columns, the row
walk's: ``_mosaic_gpu.Row``) and taking a run of ``per_cta`` consecutive blocks of ``rows``
rows in it (as many CTAs as runs, the hardware starting each as an earlier one ends), or, on
a persistent grid, every ``row_programs``-th block: each (rows, chunk) tile comes into shared
memory by a bulk copy, up to ``stages`` tiles ahead of the one computed
(``plgpu.emit_pipeline``), and the results go from registers straight to global memory.
bias_activation's backward sums d(bias) over a CTA's rows in registers, carried from step to
step, one float32 row a program, summed by XLA afterwards.
The activations are ``_activations``' formulas; compiled, their exp2 and reciprocal take the
hardware's approximate forms (approx_math), as the Triton kernels' do. Packed glu reads both
halves of each row in place and writes d[gate | up] side by side, as one array.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkernels import _activations, _mosaic_gpu, hardware
from jaxkernels._tiling import check_fields

# The persistent walk's tiles: rows a tile = TILE_BYTES // (chunk x itemsize), at least one
# and at most MOST_ROWS (a tile's rows are unrolled in the kernel).
TILE_BYTES = 16384
MOST_ROWS = 8
# Most tiles a CTA keeps in flight; fewer where shared memory holds fewer.
MOST_STAGES = 6
# Row blocks a CTA where the hardware hands out runs of them (``Config.per_cta``), and the
# CTAs an SM whose shared memory must fit for that to pay (else the persistent walk).
RUN = 2
RUN_CTAS_PER_SM = 4
# A run's tiles take rows enough that one step's tiles (every input's) are this many bytes:
# one row a tile where the row's chunk is wide (4096 bf16 columns: 2048-column chunks), more
# where it is narrow (2816 or 11008 columns, whose chunks are 256 wide; 5504's 128). One-row
# tiles of those moved 256-1024 bytes a copy: glu silu's forward 1.3-2.5x Triton's time,
# bias+silu's 1.7-3.3x; with these, at or under Triton's (notes/mgpurows.md mgpu-rows-4).
RUN_STEP_BYTES = 2048
# bias_activation's backward writes one float32 row of d(bias) partials a program: longer
# runs there, so that those stay a few MiB.
BIAS_BWD_RUN = 32
# Forwards that keep the persistent walk, its tiles of several rows side by side overlapping
# their chains: bias + erf's gelu, issue-bound on its polynomial (0.070 ms against 0.081 in
# runs on an H200, Triton's 0.070; mgpu-rows-3). Its backward still goes in runs.
PERSISTENT_FORWARD = frozenset({("bias_activation", "gelu")})


# Where dispatch prefers these kernels (op, activation): forward+backward measured at
# Triton's time, within 1%, on an H200 (notes/mgpurows.md mgpu-rows-3: glu silu 0.995x, glu gelu
# 1.004x, bias+silu 0.999x; mgpu-rows-4: glu gelu_tanh and relu 1.00x, bias+relu 1.006x).
# bias+gelu_tanh (0.98x) and bias+gelu (0.97x), their backwards 4-7% behind, serve a call
# naming them.
AT_PARITY = frozenset({("glu", "silu"), ("glu", "gelu"), ("glu", "gelu_tanh"), ("glu", "relu"),
                       ("bias_activation", "silu"), ("bias_activation", "relu")})


def on_auto(problem) -> bool:
  """Whether dispatch prefers these kernels for ``problem`` (``AT_PARITY``)."""
  return (problem.op, problem.activation) in AT_PARITY


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  rows: int  # rows a tile, where they divide the rows; else 1
  stages: int  # tiles in shared memory a CTA: the one computed and those in flight
  ctas_per_sm: int
  bwd_stages: int
  # Row blocks a CTA, one CTA a run of them (the hardware hands them out as CTAs finish); 0: a
  # persistent grid, ``ctas_per_sm`` an SM (``_mosaic_gpu.tile_blocks``).
  per_cta: int = 0
  bwd_per_cta: int = 0
  bwd_rows: int = 0  # the backward's rows a tile; 0: ``rows``
  # The backward's widest column chunk (fewer elements a thread an input: fewer registers, more
  # CTAs an SM), no narrower than the row walk allows (``_mosaic_gpu.row_geometry``: a 4096
  # bf16 row's 1024, a warpgroup vector of 16 bytes a thread); 0: up to MAX_CHUNK.
  bwd_chunk: int = 0

  def __post_init__(self):
    check_fields(self, ("rows", "stages", "ctas_per_sm", "bwd_stages"), lambda v: v >= 1,
                 ">= 1")
    check_fields(self, ("per_cta", "bwd_per_cta", "bwd_rows"), lambda v: v >= 0, ">= 0")
    check_fields(self, ("bwd_chunk",), lambda v: v == 0 or v % _mosaic_gpu.WARPGROUP == 0,
                 f"0 or a multiple of {_mosaic_gpu.WARPGROUP}")

  def max_chunk(self, backward: bool) -> int:
    """The widest column chunk of the forward's or the backward's walk."""
    return (self.bwd_chunk if backward else 0) or _mosaic_gpu.MAX_CHUNK

  def walk(self, backward: bool) -> tuple[int, int, int]:
    """(rows, stages, per_cta) of the forward's or the backward's walk."""
    if backward:
      return self.bwd_rows or self.rows, self.bwd_stages, self.bwd_per_cta
    return self.rows, self.stages, self.per_cta


def _walk(problem, max_chunk: int = _mosaic_gpu.MAX_CHUNK):
  """(n_cols, geometry) of the rows walked: x's (for glu, gate's; a packed [gate | up] is
  walked half by half, and its problem's x is one half)."""
  n_cols = problem.x.shape[1]
  return n_cols, _mosaic_gpu.row_geometry(n_cols, problem.x.dtype, jnp.float32,
                                          max_chunk=max_chunk)


def most_stages(problem, chip, *, backward: bool, rows: int, ctas_per_sm: int,
                max_chunk: int = _mosaic_gpu.MAX_CHUNK) -> int:
  """Tiles a CTA's rings hold (inputs only: outputs leave from registers), beside the bias
  chunk (counted as float32), ``ctas_per_sm`` CTAs sharing an SM
  (``_mosaic_gpu.ring_stages``)."""
  _, geometry = _walk(problem, max_chunk)
  if geometry is None:
    return 0
  chunk = geometry[1]
  streams = _streams(problem, backward)
  tile = rows * chunk * jnp.dtype(problem.x.dtype).itemsize
  vectors = [4 * chunk] if problem.op == "bias_activation" else []
  return _mosaic_gpu.ring_stages(chip, ctas_per_sm, [tile] * streams, vectors)


def _streams(problem, backward: bool) -> int:
  """Inputs a step brings into shared memory: x (gate and up for glu), and dy backward."""
  return (1 if problem.op == "bias_activation" else 2) + (1 if backward else 0)


def run_rows(problem, chunk: int, backward: bool) -> int:
  """Rows a run's tile (RUN_STEP_BYTES a step): the fewest, a power of two that divides the
  rows, at most MOST_ROWS."""
  step = _streams(problem, backward) * chunk * jnp.dtype(problem.x.dtype).itemsize
  rows = 1
  while (rows * step < RUN_STEP_BYTES and 2 * rows <= MOST_ROWS
         and problem.x.shape[0] % (2 * rows) == 0):
    rows *= 2
  return rows


def heuristic(problem, chip: hardware.Chip) -> Config:
  """problem: the call's ``elementwise.api.Problem``. Runs of RUN tiles a CTA (one row, or
  ``run_rows`` where chunks are narrow), the hardware handing them out as CTAs end, where
  RUN_CTAS_PER_SM CTAs' rings fit an SM: on an H200 that beat a persistent grid by 5-15% (a
  static share per CTA ends with the slowest SM) and matched or beat Triton's forwards and
  backwards for silu (notes/mgpurows.md mgpu-rows-2); for erf's gelu too (glu's 0.096 / 0.160 ms
  forward / backward against 0.114 / 0.178 persistent; bias+gelu's backward 0.105 against
  0.115, mgpu-rows-3), but for PERSISTENT_FORWARD's forwards. Where runs do not fit, the
  persistent walk: 16 KiB tiles, one CTA an SM, up to MOST_STAGES in flight."""
  _, geometry = _walk(problem)
  chunk = geometry[1] if geometry is not None else _mosaic_gpu.MAX_CHUNK
  fwd_rows, bwd_rows = (run_rows(problem, chunk, b) for b in (False, True))
  fwd, bwd = (most_stages(problem, chip, backward=b, rows=r, ctas_per_sm=RUN_CTAS_PER_SM)
              for b, r in ((False, fwd_rows), (True, bwd_rows)))
  rows = max(1, min(MOST_ROWS, TILE_BYTES // (chunk * jnp.dtype(problem.x.dtype).itemsize)))
  persistent = Config(
      rows=rows, ctas_per_sm=1,
      stages=max(1, min(MOST_STAGES, most_stages(problem, chip, backward=False, rows=rows,
                                                  ctas_per_sm=1))),
      bwd_stages=max(1, min(MOST_STAGES, most_stages(problem, chip, backward=True, rows=rows,
                                                     ctas_per_sm=1))))
  if min(fwd, bwd) < RUN:
    return persistent
  chunks = problem.x.shape[1] // chunk
  tiles = lambda rows: problem.x.shape[0] // rows * chunks  # a direction's: CTAs x runs
  # bias_activation's backward: about BIAS_BWD_RUN rows a CTA, whatever its tiles' rows.
  bwd_run = max(RUN, BIAS_BWD_RUN // bwd_rows) if problem.op == "bias_activation" else RUN
  runs = dict(bwd_rows=bwd_rows, bwd_stages=min(MOST_STAGES, bwd),
              bwd_per_cta=_mosaic_gpu.run_length(tiles(bwd_rows), bwd_run, chip))
  if (problem.op, problem.activation) in PERSISTENT_FORWARD:
    return dataclasses.replace(persistent, **runs)
  return Config(rows=fwd_rows, stages=min(MOST_STAGES, fwd), ctas_per_sm=RUN_CTAS_PER_SM,
                per_cta=_mosaic_gpu.run_length(tiles(fwd_rows), RUN, chip), **runs)


def unsupported(problem, chip) -> str | None:
  reason = _mosaic_gpu.hopper_reason(chip)
  if reason is not None:
    return reason
  n_cols, geometry = _walk(problem)
  if geometry is None:
    return _mosaic_gpu.width_reason(n_cols, problem.x.dtype, jnp.float32)
  return None


def config_error(problem, config: Config, chip: hardware.Chip) -> str | None:
  if config.bwd_chunk and _walk(problem, config.bwd_chunk)[1] is None:
    return (f"bwd_chunk={config.bwd_chunk}: rows of {problem.x.shape[1]} columns have no "
            "walk in chunks that narrow")
  for backward in (False, True):
    rows, stages, _ = config.walk(backward)
    most = most_stages(problem, chip, backward=backward, rows=rows,
                       ctas_per_sm=config.ctas_per_sm, max_chunk=config.max_chunk(backward))
    if stages > most:
      prefix = "bwd_" if backward else ""
      return (f"{prefix}stages={stages} tiles of rows={rows} do not fit a CTA's shared "
              f"memory at ctas_per_sm={config.ctas_per_sm} (at most {max(most, 0)})")
  return None


# --------------------------------------------------------------------------- #
# Kernels
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class _Grid:
  """A launch's walk: the row walk (its chunks are the grid's columns), rows a tile, row
  blocks, programs a column chunk (each a CTA), row blocks a program (0: a persistent grid),
  stages."""

  row: _mosaic_gpu.Row
  rows: int
  n_row_blocks: int
  row_programs: int
  per_cta: int
  stages: int

  @classmethod
  def of(cls, n_rows: int, n_cols: int, config: Config, backward: bool, interpret, *arrays):
    row = _mosaic_gpu.Row.of(n_cols, interpret, *arrays, max_chunk=config.max_chunk(backward))
    rows, stages, per_cta = config.walk(backward)
    rows = rows if n_rows % rows == 0 else 1
    n_row_blocks = n_rows // rows
    # Each column chunk's rows are a walk of their own, its programs a share of the SMs'.
    per_cta, row_programs, stages = _mosaic_gpu.row_launch(
        n_row_blocks, config.ctas_per_sm, per_cta, stages, walks=len(row.chunks))
    return cls(row, rows, n_row_blocks, row_programs, per_cta, stages)

  @property
  def ctas(self) -> int:
    return self.row_programs * len(self.row.chunks)

  def walk(self):
    """This CTA's (count, chunk, program, block, spec) (``_mosaic_gpu.tile_blocks``)."""
    return _mosaic_gpu.tile_blocks(lax.axis_index("cta"), self.row_programs, self.n_row_blocks,
                                   self.rows, self.row, self.per_cta)

  def pipeline(self, body, specs, count, *gmem, init_carry=None):
    """Runs ``body`` over this CTA's tiles; with ``init_carry``, body takes and returns a
    carry (registers kept across steps), and this returns the last one."""
    return plgpu.emit_pipeline(body, grid=(count,), in_specs=specs,
                               max_concurrent_steps=self.stages, init_carry=init_carry)(*gmem)

  def out(self, n_rows: int, n_cols: int, dtype):
    """An (n_rows, n_cols) output as the kernel writes it: (n_rows, pieces, piece)."""
    return jax.ShapeDtypeStruct((n_rows, n_cols // self.row.piece, self.row.piece), dtype)


def _bias_act_fwd_kernel(x_g, b_g, y_g, b_smem, barrier, *, activation, grid):
  row = grid.row
  count, chunk, program, block, spec = grid.walk()
  _mosaic_gpu.copy_vectors([(b_g.at[0, row.cols(chunk)], b_smem)], barrier.at[0])
  bias = row.load(b_smem, 0)  # in registers for every step: no shared-memory reads a row

  def body(indices, x_tile):
    first = block(indices[0]) * grid.rows
    for j in range(grid.rows):
      y = _activations.apply(activation, row.load(x_tile.at[j], 0) + bias, row.math())
      y_g.at[first + j, row.cols(chunk)][...] = y.astype(y_g.dtype)
    plgpu.commit_smem()  # every thread's reads done before the slot is refilled

  grid.pipeline(body, [spec()], count, x_g)


def _bias_act_bwd_kernel(x_g, b_g, dy_g, dx_g, db_g, b_smem, barrier, *, activation, grid):
  row = grid.row
  count, chunk, program, block, spec = grid.walk()
  _mosaic_gpu.copy_vectors([(b_g.at[0, row.cols(chunk)], b_smem)], barrier.at[0])
  bias = row.load(b_smem, 0)  # in registers for every step

  def body(indices, x_tile, dy_tile, d_bias):
    first = block(indices[0]) * grid.rows
    for j in range(grid.rows):
      _, slope = _activations.value_and_grad(activation, row.load(x_tile.at[j], 0) + bias,
                                                  row.math())
      dx = row.load(dy_tile.at[j], 0) * slope
      dx_g.at[first + j, row.cols(chunk)][...] = dx.astype(dx_g.dtype)
      d_bias = d_bias + dx
    plgpu.commit_smem()
    return d_bias

  # d(bias) over the CTA's rows in registers, carried from step to step, written once.
  d_bias = grid.pipeline(body, [spec(), spec()], count, x_g, dy_g, init_carry=row.zeros())
  db_g.at[program, row.cols(chunk)][...] = d_bias


def _glu_fwd_kernel(*refs, activation, packed, grid):
  refs = list(refs)
  g_g = refs.pop(0)
  u_g = g_g if packed else refs.pop(0)
  y_g = refs.pop(0)
  row = grid.row
  count, chunk, program, block, spec = grid.walk()

  def body(indices, g_tile, u_tile):
    first = block(indices[0]) * grid.rows
    for j in range(grid.rows):
      y = (_activations.apply(activation, row.load(g_tile.at[j], 0), row.math())
           * row.load(u_tile.at[j], 0))
      y_g.at[first + j, row.cols(chunk)][...] = y.astype(y_g.dtype)
    plgpu.commit_smem()

  up_shift = len(row.chunks) if packed else 0  # packed: the up half, half a row on
  grid.pipeline(body, [spec(), spec(up_shift)], count, g_g, u_g)


def _glu_bwd_kernel(*refs, activation, packed, grid):
  refs = list(refs)
  g_g = refs.pop(0)
  u_g = g_g if packed else refs.pop(0)
  dy_g, dg_g = refs.pop(0), refs.pop(0)
  du_g = dg_g if packed else refs.pop(0)
  row = grid.row
  count, chunk, program, block, spec = grid.walk()
  up_shift = len(row.chunks) if packed else 0

  def body(indices, g_tile, u_tile, dy_tile):
    first = block(indices[0]) * grid.rows
    for j in range(grid.rows):
      value, slope = _activations.value_and_grad(activation, row.load(g_tile.at[j], 0),
                                                        row.math())
      dy = row.load(dy_tile.at[j], 0)
      dg = dy * row.load(u_tile.at[j], 0) * slope
      dg_g.at[first + j, row.cols(chunk)][...] = dg.astype(dg_g.dtype)
      # packed: d[gate | up] side by side in one array, up's half a row on
      du_g.at[first + j, row.cols(chunk + up_shift)][...] = (dy * value).astype(du_g.dtype)
    plgpu.commit_smem()

  grid.pipeline(body, [spec(), spec(up_shift), spec()], count, g_g, u_g, dy_g)


# --------------------------------------------------------------------------- #
# Wrappers
# --------------------------------------------------------------------------- #


def _run(kernel, grid: _Grid, operands, out_type, scratch=(), *, name, interpret):
  outs = _mosaic_gpu.row_kernel(
      functools.partial(kernel, grid=grid), out_type, list(scratch), grid.ctas, name=name,
      interpret=interpret, approx_math=not interpret)(
          *[a.reshape(*a.shape[:-1], a.shape[-1] // grid.row.piece, grid.row.piece)
            for a in operands])
  outs = outs if isinstance(outs, (list, tuple)) else [outs]
  return [o.reshape(o.shape[0], -1) for o in outs]


def _bias_vector(x, bias):
  """The bias as the kernels copy it, one (1, N) row: in its own dtype where the row walk's
  loads take it (x's, or float32: converted in registers, no XLA launch before the kernel),
  else as float32."""
  if bias.dtype not in (x.dtype, jnp.dtype(jnp.float32)):
    bias = bias.astype(jnp.float32)
  return bias[None]


def _bias_scratch(grid: _Grid, bias):
  chunk = (grid.row.chunk // grid.row.piece, grid.row.piece)
  return [plgpu.SMEM(chunk, bias.dtype), plgpu.Barrier(num_arrivals=1, num_barriers=1)]


def bias_activation_fwd(x, bias, *, activation, config: Config, interpret=False):
  n_rows, n_cols = x.shape
  grid = _Grid.of(n_rows, n_cols, config, False, interpret, x)
  bias = _bias_vector(x, bias)
  (y,) = _run(functools.partial(_bias_act_fwd_kernel, activation=activation), grid,
              (x, bias), [grid.out(n_rows, n_cols, x.dtype)], _bias_scratch(grid, bias),
              name=f"jk_bias_{activation}_fwd_mgpu", interpret=interpret)
  return y


def bias_activation_bwd(x, bias, dy, *, activation, config: Config, interpret=False):
  n_rows, n_cols = x.shape
  grid = _Grid.of(n_rows, n_cols, config, True, interpret, x, dy)
  vector = _bias_vector(x, bias)
  dx, partials = _run(
      functools.partial(_bias_act_bwd_kernel, activation=activation), grid, (x, vector, dy),
      [grid.out(n_rows, n_cols, dy.dtype), grid.out(grid.row_programs, n_cols, jnp.float32)],
      _bias_scratch(grid, vector), name=f"jk_bias_{activation}_bwd_mgpu",
      interpret=interpret)
  return dx, partials.sum(axis=0).astype(bias.dtype)


def glu_fwd(gate, up, *, activation, config: Config, interpret=False):
  """glu's rows; ``up=None``: gate holds [gate | up] side by side, both halves read in
  place."""
  packed = up is None
  n_rows, n_cols = gate.shape[0], gate.shape[1] // (2 if packed else 1)
  grid = _Grid.of(n_rows, n_cols, config, False, interpret, gate)
  operands = (gate,) if packed else (gate, up)
  (y,) = _run(functools.partial(_glu_fwd_kernel, activation=activation, packed=packed), grid,
              operands, [grid.out(n_rows, n_cols, gate.dtype)],
              name=f"jk_glu_{activation}_fwd_mgpu", interpret=interpret)
  return y


def glu_bwd(gate, up, dy, *, activation, config: Config, interpret=False):
  """(d gate, d up); ``up=None``: (d[gate | up], None), written side by side as one array."""
  packed = up is None
  n_rows, n_cols = gate.shape[0], gate.shape[1] // (2 if packed else 1)
  grid = _Grid.of(n_rows, n_cols, config, True, interpret, gate, dy)
  if packed:
    (dx,) = _run(functools.partial(_glu_bwd_kernel, activation=activation, packed=True), grid,
                 (gate, dy), [grid.out(n_rows, 2 * n_cols, gate.dtype)],
                 name=f"jk_glu_{activation}_bwd_mgpu", interpret=interpret)
    return dx, None
  dg, du = _run(functools.partial(_glu_bwd_kernel, activation=activation, packed=False), grid,
                (gate, up, dy), [grid.out(n_rows, n_cols, gate.dtype),
                                 grid.out(n_rows, n_cols, up.dtype)],
                name=f"jk_glu_{activation}_bwd_mgpu", interpret=interpret)
  return dg, du
