"""Pallas Mosaic GPU kernels for softmax cross-entropy over rows of logits (Hopper), forward
and backward.

A persistent grid of one-warpgroup CTAs, CTA c taking rows c, c + ctas, ... Each row is walked
in tiles of ``tile`` chunks (a chunk: the row walk's, ``_mosaic_gpu.Row``, whole pieces that
divide the vocabulary), each tile brought into shared memory by a bulk copy, up to ``stages``
tiles ahead across row boundaries (one pipeline over (rows, tiles)). Where the tiles do not
divide the row, the last one runs past it: the bulk copy fills the missing chunks with zeros,
and they are masked whole, from the statistics forward and from the stores backward.

The forward keeps the online softmax per register element (a running maximum and sum each, no
reduction across threads inside the row), reduced once at the row's last tile into the
log-sum-exp; the label's logit is read from the tile that holds it, and label smoothing keeps
a running sum of the logits. The backward reads the row again and writes its gradient,
g (p - onehot) + 2 g z lse p + g e (onehot - 1 / V), from registers (as the Triton and Mosaic
TPU kernels do). The fused loss's rows (the loss and its gradient together) are one launch
that walks each row twice, the statistics and then the gradient, the second read close
behind the first (from the L2 where the rows in flight fit it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkernels import _mosaic_gpu, hardware
from jaxkernels._activations import exp
from jaxkernels._tiling import cdiv, check_fields

# A tile's bytes: chunks a tile = TILE_BYTES // a chunk's bytes (at least one).
TILE_BYTES = 32768
MOST_STAGES = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  tile: int  # chunks a tile (a pipeline step), forward
  stages: int  # tiles in shared memory a CTA: the one computed and those in flight
  ctas_per_sm: int
  bwd_tile: int
  bwd_stages: int
  bwd_ctas_per_sm: int

  def __post_init__(self):
    check_fields(self, ("tile", "stages", "ctas_per_sm", "bwd_tile", "bwd_stages",
                        "bwd_ctas_per_sm"), lambda v: v >= 1, ">= 1")


def _geometry(problem):
  n_cols = problem.logits.shape[1]
  return n_cols, _mosaic_gpu.row_geometry(n_cols, problem.logits.dtype, jnp.float32)


def most_stages(problem, chip, *, tile: int, ctas_per_sm: int) -> int:
  """Tiles of ``tile`` chunks a CTA's ring holds, ``ctas_per_sm`` CTAs sharing an SM
  (``_mosaic_gpu.ring_stages``)."""
  _, geometry = _geometry(problem)
  if geometry is None:
    return 0
  tile_bytes = tile * geometry[1] * jnp.dtype(problem.logits.dtype).itemsize
  return _mosaic_gpu.ring_stages(chip, ctas_per_sm, [tile_bytes], [])


def heuristic(problem, chip: hardware.Chip) -> Config:
  """problem: the call's ``cross_entropy.rows.Problem``. 32 KiB tiles, two CTAs an SM, as many
  tiles in flight as fit (three), forward and backward: at (8192, 128256) bfloat16 on an H200
  the best of 8-32 KiB tiles at one to four CTAs an SM, 1.3x Triton's forward and 1.07x its
  forward and backward (notes/mgpurows.md mgpu-ce-2). One CTA an SM starves the online softmax's
  chain of exps and maxima (0.56-1.06 ms forward against 0.48)."""
  _, geometry = _geometry(problem)
  chunk = geometry[1] if geometry is not None else _mosaic_gpu.MAX_CHUNK
  itemsize = jnp.dtype(problem.logits.dtype).itemsize
  tile = max(1, min(cdiv(problem.logits.shape[1], chunk), TILE_BYTES // (chunk * itemsize)))
  stages = max(1, min(MOST_STAGES, most_stages(problem, chip, tile=tile, ctas_per_sm=2)))
  return Config(tile=tile, stages=stages, ctas_per_sm=2, bwd_tile=tile, bwd_stages=stages,
                bwd_ctas_per_sm=2)


def unsupported(problem, chip) -> str | None:
  if (reason := _mosaic_gpu.hopper_reason(chip)) is not None:
    return reason
  n_cols, geometry = _geometry(problem)
  if geometry is None:
    return _mosaic_gpu.width_reason(n_cols, problem.logits.dtype, jnp.float32,
                                    whose="the logits'")
  return None


def config_error(problem, config: Config, chip: hardware.Chip) -> str | None:
  for prefix, tile, stages, per_sm in (
      ("", config.tile, config.stages, config.ctas_per_sm),
      ("bwd_", config.bwd_tile, config.bwd_stages, config.bwd_ctas_per_sm)):
    most = most_stages(problem, chip, tile=tile, ctas_per_sm=per_sm)
    if stages > most:
      return (f"{prefix}stages={stages} tiles of {prefix}tile={tile} chunks do not fit a CTA's "
              f"shared memory at {prefix}ctas_per_sm={per_sm} (at most {max(most, 0)})")
  return None


# --------------------------------------------------------------------------- #
# Kernels
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class _Walk:
  """A launch's walk: the row walk (its chunks divide the vocabulary), chunks a tile, tiles a
  row (the last one past the row where they do not divide it), rows, CTAs, stages."""

  row: _mosaic_gpu.Row
  tile: int
  n_tiles: int
  n_rows: int
  ctas: int
  stages: int
  passes: int = 1  # walks over each row: 2 for the loss and its gradient in one launch

  @classmethod
  def of(cls, logits, tile: int, stages: int, ctas_per_sm: int, interpret,
         passes: int = 1) -> _Walk:
    n_rows, n_cols = logits.shape
    row = _mosaic_gpu.Row.of(n_cols, interpret, logits)
    tile = min(tile, len(row.chunks))
    n_tiles = cdiv(len(row.chunks), tile)
    ctas = _mosaic_gpu.row_ctas(n_rows, ctas_per_sm)
    steps = cdiv(n_rows, ctas) * n_tiles * passes
    return cls(row, tile, n_tiles, n_rows, ctas, max(1, min(stages, steps)), passes)

  @property
  def ragged(self) -> bool:
    """Whether the last tile runs past the row (its missing chunks masked)."""
    return len(self.row.chunks) % self.tile != 0

  def pipeline(self, body, gmem, init_carry=None):
    """body((i, step), tile, [carry]) over this CTA's rows i and their steps: tile t of pass
    p is step p * n_tiles + t."""
    cta = lax.axis_index("cta")
    count = (self.n_rows - cta + self.ctas - 1) // self.ctas
    pieces = self.tile * self.row.chunk // self.row.piece
    tile = (lambda step: step) if self.passes == 1 else (lambda step: step % self.n_tiles)
    spec = pl.BlockSpec((1, pieces, self.row.piece),
                        lambda i, step: (cta + i * self.ctas, tile(step), 0))
    return plgpu.emit_pipeline(body, grid=(count, self.passes * self.n_tiles), in_specs=[spec],
                               max_concurrent_steps=self.stages,
                               init_carry=init_carry)(gmem)

  def row_of(self, i):
    return lax.axis_index("cta") + i * self.ctas

  def chunk_in_row(self, t, c):
    return t * self.tile + c

  def inside(self, t, c):
    """Whether the tile's chunk c is in the row (statically True where no tile runs past)."""
    return True if not self.ragged else self.chunk_in_row(t, c) < len(self.row.chunks)


class _Rows:
  """The arithmetic of a walk's rows, one tile at a time: the forward's online statistics and
  the loss they end in, and the backward's gradient of a tile."""

  def __init__(self, walk: _Walk, label_smoothing, z_loss, ignore_index):
    self.walk, self.row = walk, walk.row
    self.label_smoothing, self.z_loss, self.ignore_index = label_smoothing, z_loss, ignore_index

  def start(self):
    """Per register element: the running maximum and sum of exp(x - maximum), the sum of the
    logits (label smoothing); then the label's logit."""
    lanes = lambda value: self.row.zeros() + value
    return lanes(-jnp.inf), lanes(0.0), lanes(0.0), jnp.float32(0.0)

  def statistics(self, state, x_tile, t, label):
    """The state after tile t of a row (t = 0 starts it again)."""
    walk, row = self.walk, self.row
    first = (t == 0).astype(jnp.float32)
    peak, total, logit_sum, picked = state
    peak = peak + jnp.where(t == 0, -jnp.inf, 0.0)
    total, logit_sum, picked = total * (1.0 - first), logit_sum * (1.0 - first), \
        picked * (1.0 - first)
    xs = []
    for c in range(walk.tile):
      x = row.load(x_tile.at[0], c)
      inside = walk.inside(t, c)
      if inside is not True:  # a chunk past the row came as zeros: out of every sum
        xs.append(x + jnp.where(inside, 0.0, -jnp.inf))
        if self.label_smoothing:
          logit_sum = logit_sum + x * inside.astype(jnp.float32)
      else:
        xs.append(x)
        if self.label_smoothing:
          logit_sum = logit_sum + x
    new_peak = functools.reduce(jnp.maximum, xs, peak)
    # A finite stand-in for a maximum still -inf: exp(-inf - it) is 0, never exp(nan).
    safe = jnp.maximum(new_peak, jnp.finfo(jnp.float32).min)
    total = total * exp(peak - safe)
    for x in xs:
      total = total + exp(x - safe)

    span = walk.tile * row.chunk  # a tile's columns
    where = label - t * span  # the label's column in this tile, if it is here
    here = (where >= 0) & (where < span) & (label < row.n_cols)
    at = jnp.clip(where, 0, span - 1)
    logit = x_tile[0, at // row.piece, at % row.piece].astype(jnp.float32)
    return new_peak, total, logit_sum, picked + jnp.where(here, logit, 0.0)

  def finish(self, state, label):
    """(loss, lse) of a row from its state after the last tile."""
    peak, total, logit_sum, picked = state
    row_peak = jnp.max(peak)
    row_peak = jnp.where(row_peak == -jnp.inf, 0.0, row_peak)
    lse = row_peak + jnp.log(jnp.sum(total * exp(peak - row_peak)))
    loss = lse - picked  # the smoothing as a correction to it (reference.py)
    if self.label_smoothing:
      loss = loss + self.label_smoothing * (picked - jnp.sum(logit_sum) / self.row.n_cols)
    if self.z_loss:
      loss = loss + self.z_loss * lse * lse
    loss = jnp.where((label >= 0) & (label < self.row.n_cols), loss, jnp.nan)
    if self.ignore_index is not None:
      loss = jnp.where(label == self.ignore_index, 0.0, loss)
    return loss, lse

  def columns(self):
    """Each register element's column in its chunk (built once, before the walk)."""
    row = self.row
    shape = (row.chunk // row.piece, row.piece)
    iota = lambda dim: (lax.broadcasted_iota(jnp.int32, shape, dim) if row.interpret else
                        plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=row.layout()))
    return iota(0) * row.piece + iota(1)

  def gradient(self, x_tile, t, r, label, lse, g, columns, dx_g):
    """Writes row r's gradient over tile t: g (p - onehot) + g e (onehot - 1 / V)
    + 2 g z lse p, each term apart (triton.py)."""
    walk, row = self.walk, self.row
    if self.ignore_index is not None:
      g = jnp.where(label == self.ignore_index, 0.0, g)
    finite = lse != -jnp.inf  # a fully masked row has no softmax: 0, not exp(x + inf)
    lse_or_inf = jnp.where(finite, lse, jnp.inf)
    g_z = 2.0 * self.z_loss * g * jnp.where(finite, lse, 0.0)
    g_smooth = g * self.label_smoothing
    for c in range(walk.tile):
      def write(c=c):
        chunk = walk.chunk_in_row(t, c)
        x = row.load(x_tile.at[0], c)
        p = exp(x - lse_or_inf)
        onehot = (columns == label - chunk * row.chunk).astype(jnp.float32)
        d = g * (p - onehot)
        if self.z_loss:
          d = d + g_z * p
        if self.label_smoothing:
          d = d + g_smooth * (onehot - 1.0 / row.n_cols)
        dx_g.at[r, row.cols(chunk)][...] = d.astype(dx_g.dtype)
      inside = walk.inside(t, c)
      if inside is True:
        write()
      else:  # a chunk past the row: nothing to write
        pl.when(inside)(write)


def _fwd_kernel(x_g, labels_g, loss_g, lse_g, *, walk: _Walk, **options):
  rows = _Rows(walk, **options)

  def body(indices, x_tile, state):
    i, t = indices
    r = walk.row_of(i)
    label = labels_g[r]
    state = rows.statistics(state, x_tile, t, label)

    @pl.when(t == walk.n_tiles - 1)
    def _():
      loss_g[r], lse_g[r] = rows.finish(state, label)

    plgpu.commit_smem()  # every thread's reads done before the slot is refilled
    return state

  walk.pipeline(body, x_g, init_carry=rows.start())


def _bwd_kernel(x_g, labels_g, lse_g, g_g, dx_g, *, walk: _Walk, **options):
  rows = _Rows(walk, **options)
  columns = rows.columns()

  def body(indices, x_tile):
    i, t = indices
    r = walk.row_of(i)
    rows.gradient(x_tile, t, r, labels_g[r], lse_g[r], g_g[r], columns, dx_g)
    plgpu.commit_smem()

  walk.pipeline(body, x_g)


def _fused_kernel(x_g, labels_g, g_g, loss_g, lse_g, dx_g, *, walk: _Walk, **options):
  """The loss and its gradient in one launch: each row walked twice (``walk.passes``), the
  statistics on the first pass, the gradient on the second, whose reads follow the first's
  from the L2 where the rows in flight fit it."""
  rows = _Rows(walk, **options)
  columns = rows.columns()
  last = walk.n_tiles - 1

  def body(indices, x_tile, carry):
    i, step = indices
    r = walk.row_of(i)
    label = labels_g[r]

    def statistics(carry):
      state = rows.statistics(carry[:4], x_tile, step, label)

      def finish(lse):
        loss, lse = rows.finish(state, label)
        loss_g[r], lse_g[r] = loss, lse
        return lse
      return (*state, lax.cond(step == last, finish, lambda lse: lse, carry[4]))

    def gradient(carry):
      rows.gradient(x_tile, step - walk.n_tiles, r, label, carry[4], g_g[r], columns, dx_g)
      return carry

    carry = lax.cond(step < walk.n_tiles, statistics, gradient, carry)
    plgpu.commit_smem()
    return carry

  walk.pipeline(body, x_g, init_carry=(*rows.start(), jnp.float32(0.0)))


# --------------------------------------------------------------------------- #
# Wrappers
# --------------------------------------------------------------------------- #


def _launch(kernel, walk: _Walk, operands, out_type, name, interpret, options):
  body = functools.partial(kernel, walk=walk, **options)
  logits, *rest = operands
  return _mosaic_gpu.row_kernel(body, out_type, [], walk.ctas, name=name,
                                interpret=_mosaic_gpu.reading_zeros_past_the_end(interpret),
                                approx_math=not interpret)(walk.row.pieces(logits), *rest)


def forward(logits, labels, *, label_smoothing, z_loss, ignore_index, config: Config,
            interpret=False):
  """(loss, lse) per row of ``logits`` (M, V), float32."""
  walk = _Walk.of(logits, config.tile, config.stages, config.ctas_per_sm, interpret)
  column = jax.ShapeDtypeStruct((logits.shape[0],), jnp.float32)
  loss, lse = _launch(_fwd_kernel, walk, (logits, labels), [column, column],
                      "jk_cross_entropy_fwd_mgpu", interpret,
                      dict(label_smoothing=label_smoothing, z_loss=z_loss,
                           ignore_index=ignore_index))
  return loss, lse


def backward(logits, labels, lse, g, *, label_smoothing, z_loss, ignore_index, config: Config,
             dtype=None, interpret=False):
  """d loss / d logits for the cotangent ``g`` of each row's loss, in ``dtype`` (the logits').
  With ``lse`` None, the loss too, in one launch: (loss, lse, dlogits)."""
  options = dict(label_smoothing=label_smoothing, z_loss=z_loss, ignore_index=ignore_index)
  dtype = logits.dtype if dtype is None else dtype
  walk = _Walk.of(logits, config.bwd_tile, config.bwd_stages, config.bwd_ctas_per_sm,
                  interpret, passes=1 if lse is not None else 2)
  grad = jax.ShapeDtypeStruct(walk.row.pieces(logits).shape, dtype)
  g = g.astype(jnp.float32)
  if lse is None:
    column = jax.ShapeDtypeStruct((logits.shape[0],), jnp.float32)
    loss, lse, dlogits = _launch(_fused_kernel, walk, (logits, labels, g),
                                 [column, column, grad], "jk_cross_entropy_fused_mgpu",
                                 interpret, options)
    return loss, lse, dlogits.reshape(logits.shape)
  dlogits = _launch(_bwd_kernel, walk, (logits, labels, lse, g), grad,
                    "jk_cross_entropy_bwd_mgpu", interpret, options)
  return dlogits.reshape(logits.shape)
