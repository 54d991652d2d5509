"""Pallas Mosaic TPU kernels for softmax cross-entropy over rows of logits.

The grid walks (row blocks, vocabulary blocks). The forward keeps each row's running maximum,
sum of exponentials (rescaled as the maximum grows), label logit and, for label smoothing, sum
of logits in VMEM scratch along the vocabulary ("arbitrary": one core walks a row block's
vocabulary in order) and writes the loss and log-sum-exp at the last block. The backward's
blocks are independent ("parallel" both ways): each writes g * (softmax * (1 + 2 z_loss lse)
- target) from its logits and the row's saved log-sum-exp. Any vocabulary fits: a block is
``block_rows`` x ``block_cols``, float32 inside.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxkernels import _mosaic_tpu, hardware, roofline
from jaxkernels._activations import exp
from jaxkernels._mosaic_tpu import sublanes, vmem_limit
from jaxkernels._tiling import cdiv, round_up

TARGET_ELEMENTS = 256 * 1024  # a block's elements: 1 MiB of float32 a temporary
WHOLE_ROW_COLS = 8192  # vocabularies up to this take whole rows a block


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(_mosaic_tpu.BlockConfig):
  """Blocks of the logits' (M, V) rows (``_mosaic_tpu.BlockConfig``): a row block's per-row
  float32 statistics take the same rows, whose packing the logits' dtype sets."""


def heuristic(problem, chip: hardware.Chip) -> Config:
  """problem: the call's ``cross_entropy.rows.Problem`` (logits as (M, V) rows)."""
  n_rows, n_cols = problem.logits.shape
  cols = n_cols if n_cols <= WHOLE_ROW_COLS else 4096
  packing = sublanes(problem.logits.dtype)
  rows = max(packing, TARGET_ELEMENTS // round_up(cols, 128) // packing * packing)
  return Config(block_rows=n_rows if n_rows <= rows else rows, block_cols=cols,
                vmem_limit_bytes=vmem_limit(chip))


def unsupported(problem, chip) -> str | None:
  del chip
  if jnp.dtype(problem.logits.dtype) == jnp.float16:
    return "float16 is not a TPU dtype (use bfloat16 or float32)"
  return None


def _columns(shape, block_cols: int):
  return pl.program_id(1) * block_cols + lax.broadcasted_iota(jnp.int32, shape, 1)


def _fwd_kernel(labels_ref, logits_ref, loss_ref, lse_ref, peak_ref, sum_ref, pick_ref,
                total_ref, *, n_cols, block_cols, label_smoothing, z_loss, ignore_index):
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _():
    peak_ref[...] = jnp.full(peak_ref.shape, -jnp.inf, jnp.float32)
    for ref in (sum_ref, pick_ref, total_ref):
      ref[...] = jnp.zeros(ref.shape, jnp.float32)

  x = logits_ref[...].astype(jnp.float32)
  cols = _columns(x.shape, block_cols)
  inside = cols < n_cols
  if n_cols % block_cols:  # the last block's columns past V hold whatever VMEM held
    x = jnp.where(inside, x, -jnp.inf)
  labels = labels_ref[...]
  peak = peak_ref[...]
  new_peak = jnp.maximum(peak, jnp.max(x, axis=1, keepdims=True))
  safe = jnp.where(new_peak == -jnp.inf, 0.0, new_peak)
  sum_ref[...] = sum_ref[...] * exp(peak - safe) + jnp.sum(exp(x - safe), axis=1, keepdims=True)
  peak_ref[...] = new_peak
  pick_ref[...] += jnp.sum(jnp.where(cols == labels, x, 0.0), axis=1, keepdims=True)
  if label_smoothing:
    total_ref[...] += jnp.sum(jnp.where(inside, x, 0.0), axis=1, keepdims=True)

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    peak = peak_ref[...]
    lse = jnp.where(peak == -jnp.inf, 0.0, peak) + jnp.log(sum_ref[...])
    loss = lse - pick_ref[...]  # the smoothing as a correction to it (reference.py)
    if label_smoothing:
      loss = loss + label_smoothing * (pick_ref[...] - total_ref[...] / n_cols)
    if z_loss:
      loss = loss + z_loss * lse * lse
    loss = jnp.where((labels >= 0) & (labels < n_cols), loss, jnp.nan)
    if ignore_index is not None:
      loss = jnp.where(labels == ignore_index, 0.0, loss)
    loss_ref[...] = loss
    lse_ref[...] = lse


def _bwd_kernel(labels_ref, lse_ref, g_ref, logits_ref, dlogits_ref, *, n_cols, block_cols,
                label_smoothing, z_loss, ignore_index):
  x = logits_ref[...].astype(jnp.float32)
  labels, lse, g = labels_ref[...], lse_ref[...], g_ref[...]
  if ignore_index is not None:
    g = jnp.where(labels == ignore_index, 0.0, g)
  finite = lse != -jnp.inf  # a fully masked row has no softmax: 0, not exp(x + inf)
  p = exp(x - jnp.where(finite, lse, jnp.inf))
  # g (p - onehot) + g e (onehot - 1 / V) + 2 g l lse p, each term apart (triton.py).
  onehot = jnp.where(_columns(x.shape, block_cols) == labels, 1.0, 0.0)
  d = g * (p - onehot)
  if z_loss:
    d = d + (2.0 * z_loss * g * jnp.where(finite, lse, 0.0)) * p
  if label_smoothing:
    d = d + (g * label_smoothing) * (onehot - 1.0 / n_cols)
  dlogits_ref[...] = d.astype(dlogits_ref.dtype)


def _specs(rows, cols):
  per_row = pl.BlockSpec((rows, 1), lambda i, j: (i, 0))
  block = pl.BlockSpec((rows, cols), lambda i, j: (i, j))
  return per_row, block


def forward(logits, labels, *, label_smoothing, z_loss, ignore_index, config: Config,
            interpret=False):
  """(loss, lse) per row of ``logits`` (M, V), float32."""
  n_rows, n_cols = logits.shape
  rows, cols = config.blocks(logits)
  per_row, block = _specs(rows, cols)
  column = jax.ShapeDtypeStruct((n_rows, 1), jnp.float32)
  loss, lse = pl.pallas_call(
      lambda *refs: _fwd_kernel(*refs, n_cols=n_cols, block_cols=cols,
                                label_smoothing=label_smoothing, z_loss=z_loss,
                                ignore_index=ignore_index),
      out_shape=[column, column],
      grid=(cdiv(n_rows, rows), cdiv(n_cols, cols)),
      in_specs=[per_row, block],
      out_specs=[per_row, per_row],
      scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32)] * 4,
      compiler_params=_mosaic_tpu.params(("parallel", "arbitrary"), config.vmem_limit_bytes,
                                         interpret),
      cost_estimate=roofline.cross_entropy_fwd(logits).estimate(),
      interpret=interpret,
      name="jk_cross_entropy_fwd",
  )(labels.reshape(n_rows, 1), logits)
  return loss[:, 0], lse[:, 0]


def backward(logits, labels, lse, g, *, label_smoothing, z_loss, ignore_index, config: Config,
             dtype=None, interpret=False):
  """d loss / d logits for the cotangent ``g`` of each row's loss, in ``dtype`` (the logits')."""
  n_rows, n_cols = logits.shape
  dtype = logits.dtype if dtype is None else dtype
  rows, cols = config.blocks(logits)
  per_row, block = _specs(rows, cols)
  column = lambda x: x.reshape(n_rows, 1)
  return pl.pallas_call(
      lambda *refs: _bwd_kernel(*refs, n_cols=n_cols, block_cols=cols,
                                label_smoothing=label_smoothing, z_loss=z_loss,
                                ignore_index=ignore_index),
      out_shape=jax.ShapeDtypeStruct(logits.shape, dtype),
      grid=(cdiv(n_rows, rows), cdiv(n_cols, cols)),
      in_specs=[per_row, per_row, per_row, block],
      out_specs=block,
      compiler_params=_mosaic_tpu.params(("parallel", "parallel"), config.vmem_limit_bytes,
                                         interpret),
      cost_estimate=roofline.cross_entropy_bwd(logits, dtype).estimate(),
      interpret=interpret,
      name="jk_cross_entropy_bwd",
  )(column(labels), column(lse), column(g), logits)
