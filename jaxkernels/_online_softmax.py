"""The online softmax: a row's maximum and its sum of exponentials, kept while the row is read
block by block, the sum rescaled each time the maximum grows (Milakov and Gimelshein, 2018).

Backend-neutral float32 arithmetic on tiles, for any kernel that meets a row in pieces:
softmax's rows too wide for registers (``ops/softmax/triton.py``), attention's keys, a
cross-entropy's vocabulary. Two forms of one recurrence:

* ``lanes_update``: state per element of a block (one running maximum and sum per column
  lane), no reduction across the row inside the loop, so a step's loads can all be in flight
  together; ``merge_lanes`` reduces the lanes once at the end.
* ``rows_update``: state per row, each block reduced as it comes; it also returns the
  factor that rescales any accumulator kept beside the sum (attention's P @ V) and the
  block's exponentials.

A fully masked row (every score -inf) keeps a maximum of -inf; ``finite`` turns it into 0
wherever it is subtracted, so exp(-inf - 0) = 0 and the row sums to 0, never NaN.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax.numpy as jnp

from jaxkernels._activations import exp


def finite(peak):
  """A fully masked row's maximum (-inf) becomes 0, so exp(x - peak) is 0, not NaN."""
  return jnp.where(peak == -jnp.inf, 0.0, peak)


class Running(NamedTuple):
  """The running maximum and the sum of exp(x - maximum) seen so far."""

  peak: jnp.ndarray
  total: jnp.ndarray

  @classmethod
  def start(cls, shape) -> Running:
    return cls(jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32))


def lanes_update(state: Running, blocks) -> Running:
  """``state`` (per element, shaped like each block) after the blocks ``blocks``."""
  peak, total = state
  new_peak = functools.reduce(jnp.maximum, blocks, peak)
  safe = finite(new_peak)
  total = total * exp(peak - safe)
  for x in blocks:
    total = total + exp(x - safe)
  return Running(new_peak, total)


def merge_lanes(state: Running, edges=()) -> Running:
  """Per-lane ``state`` (rows, lanes) reduced to one per row, with the blocks ``edges``
  (rows, any width: elements the lanes did not walk) folded in. The maximum comes back
  ``finite``: ready to subtract."""
  peak, total = state
  row_peak = functools.reduce(jnp.maximum, [jnp.max(e, axis=1) for e in edges],
                              jnp.max(peak, axis=1))
  row_peak = finite(row_peak)
  row_total = jnp.sum(total * exp(peak - row_peak[:, None]), axis=1)
  for e in edges:
    row_total = row_total + jnp.sum(exp(e - row_peak[:, None]), axis=1)
  return Running(row_peak, row_total)


def rows_update(state: Running, scores, exp=exp):
  """(state, rescale, p) after a (rows, cols) block of ``scores``: ``rescale`` (rows,)
  multiplies whatever was accumulated against the old maximum, ``p`` = exp(scores - new
  maximum) is the block's share. ``exp`` may be another base's (attention passes 2**x on
  scores already in base 2, saving a multiply an element): the state is then in that base."""
  peak, total = state
  new_peak = jnp.maximum(peak, jnp.max(scores, axis=1))
  safe = finite(new_peak)
  rescale = exp(peak - safe)
  p = exp(scores - safe[:, None])
  return Running(new_peak, total * rescale + jnp.sum(p, axis=1)), rescale, p


def combine(a: Running, b: Running) -> Running:
  """Two partial states of the same rows, over disjoint parts of them, as one (the split
  walks of flash-decoding)."""
  peak = jnp.maximum(a.peak, b.peak)
  safe = finite(peak)
  return Running(peak, a.total * exp(a.peak - safe) + b.total * exp(b.peak - safe))


def log_sum_exp(state: Running):
  """log(sum(exp(x))) of the rows: -inf for a fully masked row."""
  return finite(state.peak) + jnp.log(state.total)
