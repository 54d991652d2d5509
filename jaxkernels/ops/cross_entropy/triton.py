"""Pallas Triton kernels for softmax cross-entropy over rows of logits (CUDA GPUs, sm80+).

The forward reads each row once: the online softmax (``_online_softmax``, one running maximum
and sum per lane, reduced across the row once at the end) gives the log-sum-exp; the label's
logit is one load; label smoothing adds a running sum of the logits. The backward reads the row
again and writes its gradient, g * (softmax * (1 + 2 z_loss lse) - target), with the target
(1 - e) * onehot + e / V built from column indices, never stored. Rows wider than a register
pass are walked as softmax's are (``_triton.RowSteps``: one row a program, unrolled chunks;
rows off a 16-byte vector boundary through the flat view).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxkernels import _online_softmax, _triton, hardware, roofline
from jaxkernels._activations import exp
from jaxkernels._tiling import cdiv
from jaxkernels._triton import (FLAT_MAX_ELEMENTS, RowSteps, load_vector, pltriton,
                                store_vector)

@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(_triton.RowWalkConfig):
  """The row walk's blocks (``_triton.RowWalkConfig``), for the logits' rows."""


def heuristic(problem, chip: hardware.Chip) -> Config:
  """problem: the call's ``cross_entropy.rows.Problem`` (logits as (M, V) rows); softmax's row
  walk (``_triton.row_walk``)."""
  del chip
  return Config(**_triton.row_walk(*problem.logits.shape))


def unsupported(problem, chip) -> str | None:
  del problem, chip
  return None


def _columns(steps: RowSteps, index):
  """The class (column) of each element of a chunk at ``index``."""
  return index - steps.start[:, None] if steps.flat else index[1]


def _at(steps: RowSteps, cols):
  """The index of column ``cols`` (one per row) of each of the program's rows."""
  return steps.start + cols if steps.flat else (steps.rows, cols)


def _labels(labels_ref, steps: RowSteps):
  """The program's rows' labels, int32 (not through float32: any int32 ignore_index holds)."""
  if steps.row_mask is None:
    return pltriton.load(labels_ref.at[steps.rows])
  return pltriton.load(labels_ref.at[steps.rows], mask=steps.row_mask, other=0)


def _statistics(logits_ref, labels_ref, steps: RowSteps, n_cols, label_smoothing, z_loss,
                ignore_index):
  """(labels, loss, lse) of the program's rows, from one walk along them."""
  def load(chunks):
    return [load_vector(logits_ref, o, m, -jnp.inf, _triton.stream_cache_modifier())
            for o, m in chunks]

  def online(chunks, xs, state):
    running, total = state
    running = _online_softmax.lanes_update(running, xs)
    if label_smoothing:  # the sum of the logits, masked lanes out of it
      for (_, m), x in zip(chunks, xs):
        total = total + (x if m is None else jnp.where(m, x, 0.0))
    return running, total

  start = (_online_softmax.Running(steps.lanes(-jnp.inf), steps.lanes(0.0)), steps.lanes(0.0))
  lanes, total = steps.walk(load, online, start, prefetch=False)
  edges = steps.edges()
  edge_xs = load(edges)
  peak, sum_exp = _online_softmax.merge_lanes(lanes, edge_xs)
  lse = peak + jnp.log(sum_exp)

  labels = _labels(labels_ref, steps)
  in_range = (labels >= 0) & (labels < n_cols)
  mask = in_range if steps.row_mask is None else in_range & steps.row_mask
  picked = load_vector(logits_ref, _at(steps, jnp.clip(labels, 0, n_cols - 1)), mask, 0.0)
  loss = lse - picked  # the smoothing as a correction to it (reference.py)
  if label_smoothing:
    row_sum = jnp.sum(total, axis=1)
    for (_, m), x in zip(edges, edge_xs):
      row_sum = row_sum + jnp.sum(jnp.where(m, x, 0.0), axis=1)
    loss = loss + label_smoothing * (picked - row_sum / n_cols)
  if z_loss:
    loss = loss + z_loss * lse * lse
  loss = jnp.where(in_range, loss, jnp.nan)
  if ignore_index is not None:
    loss = jnp.where(labels == ignore_index, 0.0, loss)
  return labels, loss, lse


def _write_grad(logits_ref, dlogits_ref, steps: RowSteps, labels, lse, g, n_cols,
                label_smoothing, z_loss, ignore_index):
  """dlogits of the program's rows: g (p (1 + 2 z_loss lse) - target), from a walk that reads
  each chunk and then writes its gradient (the same place, where they alias)."""
  if ignore_index is not None:
    g = jnp.where(labels == ignore_index, 0.0, g)
  # A fully masked row (lse -inf) has no softmax: 0, not exp(x + inf).
  lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
  # g (p - onehot) + g e (onehot - 1 / V) + 2 g l lse p, each term apart: one class (V = 1,
  # p = 1) gives exactly the z-loss's share, not (g (1 + 2 l lse)) p - g, which rounds off the
  # share's leading digits (reference.py).
  g_smooth = (g * label_smoothing)[:, None]
  g_z = (2.0 * z_loss * g * jnp.where(jnp.isinf(lse), 0.0, lse))[:, None]

  def load(chunks):
    return [load_vector(logits_ref, o, m, -jnp.inf, _triton.stream_cache_modifier())
            for o, m in chunks]

  def write(chunks, xs, carry):
    for (o, m), x in zip(chunks, xs):
      onehot = jnp.where(_columns(steps, o) == labels[:, None], 1.0, 0.0)
      p = exp(x - lse[:, None])
      d = g[:, None] * (p - onehot)
      if z_loss:
        d = d + g_z * p
      if label_smoothing:
        d = d + g_smooth * (onehot - 1.0 / n_cols)
      store_vector(dlogits_ref, o, d, m)
    return carry

  steps.walk(load, write, jnp.int32(0), prefetch=False)
  edges = steps.edges()
  write(edges, load(edges), None)


def _steps(n_rows, n_cols, block_rows, block_cols, unroll, vec, flat):
  return RowSteps(n_rows=n_rows, n_cols=n_cols, block_rows=block_rows, block_cols=block_cols,
                  unroll=unroll, vec=vec, flat=flat)


def _fwd_kernel(logits_ref, labels_ref, loss_ref, lse_ref, *, n_rows, n_cols, block_rows,
                block_cols, unroll, vec, flat, **options):
  steps = _steps(n_rows, n_cols, block_rows, block_cols, unroll, vec, flat)
  _, loss, lse = _statistics(logits_ref, labels_ref, steps, n_cols, **options)
  store_vector(loss_ref, steps.rows, loss, steps.row_mask)
  store_vector(lse_ref, steps.rows, lse, steps.row_mask)


def _bwd_kernel(logits_ref, labels_ref, lse_ref, g_ref, dlogits_ref, *, n_rows, n_cols,
                block_rows, block_cols, unroll, vec, flat, **options):
  steps = _steps(n_rows, n_cols, block_rows, block_cols, unroll, vec, flat)
  labels = _labels(labels_ref, steps)
  lse = load_vector(lse_ref, steps.rows, steps.row_mask, 0.0)
  g = load_vector(g_ref, steps.rows, steps.row_mask, 0.0)
  _write_grad(logits_ref, dlogits_ref, steps, labels, lse, g, n_cols, **options)


def _fused_kernel(logits_ref, labels_ref, g_ref, loss_ref, lse_ref, dlogits_ref, *, n_rows,
                  n_cols, block_rows, block_cols, unroll, vec, flat, **options):
  """Loss, lse and the gradient in one launch: the row's second read (the gradient's) follows
  its first in the same program, from the L2 where the rows in flight fit it."""
  steps = _steps(n_rows, n_cols, block_rows, block_cols, unroll, vec, flat)
  labels, loss, lse = _statistics(logits_ref, labels_ref, steps, n_cols, **options)
  store_vector(loss_ref, steps.rows, loss, steps.row_mask)
  store_vector(lse_ref, steps.rows, lse, steps.row_mask)
  g = load_vector(g_ref, steps.rows, steps.row_mask, 0.0)
  _write_grad(logits_ref, dlogits_ref, steps, labels, lse, g, n_cols, **options)


def _row_call(kernel, logits, rows_in, out_shapes, block_rows, num_warps, unroll, config, cost,
              name, interpret, options, aliases=None):
  n_rows, n_cols = logits.shape
  vec = 16 // min(jnp.dtype(s.dtype).itemsize for s in (logits, *out_shapes)
                  if len(s.shape) == 2)
  flat = (config.block_cols < n_cols and n_cols % vec != 0
          and n_rows * n_cols < FLAT_MAX_ELEMENTS)
  view = lambda s: jax.ShapeDtypeStruct((n_rows * n_cols,), s.dtype) if (
      flat and len(s.shape) == 2) else s
  out = pl.pallas_call(
      functools.partial(kernel, n_rows=n_rows, n_cols=n_cols, block_rows=block_rows,
                        block_cols=config.block_cols, unroll=unroll, vec=vec, flat=flat,
                        **options),
      out_shape=[view(s) for s in out_shapes],
      grid=(cdiv(n_rows, block_rows),),
      compiler_params=_triton.params(num_warps),
      cost_estimate=cost.estimate(),
      input_output_aliases=aliases or {},
      interpret=interpret,
      name=name,
  )(logits.reshape(-1) if flat else logits, *rows_in)
  return [o.reshape(s.shape) for o, s in zip(out, out_shapes)]


def forward(logits, labels, *, label_smoothing, z_loss, ignore_index, config: Config,
            interpret=False):
  """(loss, lse) per row of ``logits`` (M, V), float32."""
  rows = jax.ShapeDtypeStruct((logits.shape[0],), jnp.float32)
  return tuple(_row_call(
      _fwd_kernel, logits, [labels], [rows, rows], config.block_rows, config.num_warps,
      config.unroll, config, roofline.cross_entropy_fwd(logits), "jk_cross_entropy_fwd",
      interpret, dict(label_smoothing=label_smoothing, z_loss=z_loss,
                      ignore_index=ignore_index)))


def backward(logits, labels, lse, g, *, label_smoothing, z_loss, ignore_index, config: Config,
             dtype=None, interpret=False):
  """d loss / d logits for the cotangent ``g`` of each row's loss, in ``dtype`` (the logits').
  With ``lse`` None, the loss too, in one launch: (loss, lse, dlogits), dlogits written over
  the logits where their dtypes agree (the logits are then spent)."""
  dtype = logits.dtype if dtype is None else dtype
  options = dict(label_smoothing=label_smoothing, z_loss=z_loss, ignore_index=ignore_index)
  grad = jax.ShapeDtypeStruct(logits.shape, dtype)
  if lse is None:
    rows = jax.ShapeDtypeStruct((logits.shape[0],), jnp.float32)
    cost = roofline.cross_entropy_fwd(logits) + roofline.cross_entropy_bwd(logits, dtype)
    return tuple(_row_call(
        _fused_kernel, logits, [labels, g], [rows, rows, grad], config.bwd_block_rows,
        config.bwd_num_warps, config.bwd_unroll, config, cost, "jk_cross_entropy_fused",
        interpret, options, aliases={0: 2} if jnp.dtype(dtype) == logits.dtype else None))
  (dlogits,) = _row_call(
      _bwd_kernel, logits, [labels, lse, g], [grad], config.bwd_block_rows,
      config.bwd_num_warps, config.bwd_unroll, config, roofline.cross_entropy_bwd(logits, dtype),
      "jk_cross_entropy_bwd", interpret, options)
  return dlogits
