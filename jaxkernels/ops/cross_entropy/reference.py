"""The spec of softmax cross-entropy: pure jnp in float32, also the "xla" implementation.

Per row of logits z (V classes) with label y, label smoothing e and z-loss weight l:

    lse  = log(sum(exp(z)))
    loss = (lse - z[y]) + e * (z[y] - sum(z) / V) + l * lse**2

the cross-entropy against the target (1 - e) * onehot(y) + e / V, plus PaLM's z-loss. The
smoothing is a correction to the plain loss, not a reweighting of it: written as
lse - (1 - e) z[y] - (e / V) sum(z), (1 - e) + e rounds off 1, and one class (V = 1), whose
loss and gradient are exactly 0 for any logit, came out ~1e-8 relative to the logits. A row
whose label is ``ignore_index`` gives 0 and no gradient. A label outside [0, V) that is not
``ignore_index`` gives NaN (never another row's or class's number). ``compute_dtype`` exists for
the tests (see ops/norms/reference.py).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def softmax_cross_entropy(logits, labels, *, label_smoothing: float = 0.0, z_loss: float = 0.0,
                          ignore_index: int | None = None, compute_dtype=jnp.float32):
  """(loss, lse), each shaped like ``labels``: the loss per row (0 where ignored), and the
  log-sum-exp of its logits."""
  z = logits.astype(compute_dtype)
  vocab = z.shape[-1]
  if ignore_index is not None:  # an ignored row's logits take no part, even all -inf ones
    z = jnp.where((labels == ignore_index)[..., None], 0, z)
  peak = lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
  peak = jnp.where(jnp.isfinite(peak), peak, 0)
  lse = (jnp.log(jnp.sum(jnp.exp(z - peak), axis=-1, keepdims=True)) + peak)[..., 0]
  in_range = (labels >= 0) & (labels < vocab)
  picked = jnp.take_along_axis(z, jnp.clip(labels, 0, vocab - 1)[..., None], axis=-1)[..., 0]
  loss = lse - picked
  if label_smoothing:
    loss = loss + label_smoothing * (picked - jnp.sum(z, axis=-1) / vocab)
  if z_loss:
    loss = loss + z_loss * lse * lse
  out_of_range = ~in_range if ignore_index is None else ~in_range & (labels != ignore_index)
  loss = nan_where(out_of_range, loss)
  if ignore_index is not None:
    loss = jnp.where(labels == ignore_index, 0, loss)
  return loss.astype(compute_dtype), lse


def nan_where(bad, x):
  """x, NaN where ``bad``, with no gradient there (as jnp.where(bad, jnp.nan, x) gives). The
  NaN is made only where ``bad`` (sqrt(-1)), so that a program with no bad label holds no NaN
  anywhere and ``jax.debug_nans`` stays quiet; jnp.where with a NaN constant materializes one
  however few labels are bad."""
  there = jnp.sqrt(jnp.where(bad, -1.0, 1.0)).astype(x.dtype)
  return jnp.where(bad, lax.stop_gradient(x) * there, x)


def linear_softmax_cross_entropy(x, w, labels, *, compute_dtype=jnp.float32, **options):
  """(loss, lse) of the logits x @ w (x (..., D), w (D, V)), every step in ``compute_dtype``."""
  logits = jnp.dot(x.astype(compute_dtype), w.astype(compute_dtype),
                   preferred_element_type=compute_dtype)
  return softmax_cross_entropy(logits, labels, compute_dtype=compute_dtype, **options)
