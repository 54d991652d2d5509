"""The online softmax's recurrences (jaxkernels/_online_softmax.py) against a whole-row
log-sum-exp in float64: blocks in any order and size, masked rows, and split walks combined."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from jaxkernels import _online_softmax as online
from tests import numerics


def _scores(seed, rows, cols, masked_rows):
  """float32 scores, held as float64 (so the float64 answer sees the same inputs)."""
  gen = numerics.rng("online-softmax", seed, rows, cols)
  x = (4 * gen.standard_normal((rows, cols))).astype(np.float32).astype(np.float64)
  x[:masked_rows] = -np.inf  # fully masked rows: their maximum stays -inf
  return x


def _want(x):
  with np.errstate(divide="ignore", invalid="ignore"):
    peak = np.max(x, axis=1)
    safe = np.where(np.isinf(peak), 0.0, peak)
    total = np.sum(np.exp(x - safe[:, None]), axis=1)
    return safe + np.log(total), total


def _tolerance(cols, blocks):
  """The log-sum-exp's absolute error is the running sum's relative one: each exp and each add
  rounds once in float32, and each of the blocks' rescales once more."""
  return 2 * (cols + blocks) * numerics.F32_EPS


@settings(max_examples=numerics.draws(25), deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 9), blocks=st.integers(1, 5),
       width=st.integers(1, 33), masked=st.integers(0, 2))
def test_rows_update_matches_the_whole_row(seed, rows, blocks, width, masked):
  x = _scores(seed, rows, blocks * width, min(masked, rows))
  state = online.Running.start((rows,))
  acc = jnp.zeros((rows, 1), jnp.float32)  # an accumulator kept beside the sum: sum of p
  for b in range(blocks):
    state, rescale, p = online.rows_update(state, jnp.asarray(x[:, b * width:(b + 1) * width],
                                                              jnp.float32))
    acc = acc * rescale[:, None] + jnp.sum(p, axis=1, keepdims=True)
  lse, total = _want(x)
  got = np.asarray(online.log_sum_exp(state), np.float64)
  with np.errstate(invalid="ignore"):
    chex.assert_trees_all_close(np.where(np.isinf(lse), 0, got - lse), np.zeros(rows),
                                atol=_tolerance(blocks * width, blocks))
  assert np.all(np.isneginf(got[np.isneginf(lse)]))  # masked: -inf, not NaN
  # The accumulator rescaled alongside equals the running sum itself.
  chex.assert_trees_all_close(np.asarray(acc[:, 0]), np.asarray(state.total), rtol=1e-6)


@settings(max_examples=numerics.draws(20), deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 6), lanes=st.integers(1, 16),
       steps=st.integers(1, 4), edge=st.integers(0, 5))
def test_lanes_then_merge_and_combine(seed, rows, lanes, steps, edge):
  x = _scores(seed, rows, lanes * steps + edge, 1 if rows > 1 else 0)
  body, tail = x[:, :lanes * steps], x[:, lanes * steps:]
  state = online.Running(jnp.full((rows, lanes), -jnp.inf), jnp.zeros((rows, lanes)))
  for s in range(steps):
    state = online.lanes_update(state, [jnp.asarray(body[:, s * lanes:(s + 1) * lanes],
                                                    jnp.float32)])
  merged = online.merge_lanes(state, [jnp.asarray(tail, jnp.float32)] if edge else [])
  lse, _ = _want(x)
  with np.errstate(divide="ignore"):
    got = np.asarray(merged.peak, np.float64) + np.log(np.asarray(merged.total, np.float64))
  finite = ~np.isinf(lse)
  np.testing.assert_allclose(got[finite], lse[finite], atol=_tolerance(x.shape[1], steps + 1))
  # Two halves of the same rows walked apart and combined: the whole row's statistics.
  half = x.shape[1] // 2
  parts = []
  for piece in (x[:, :half], x[:, half:]):
    part = online.Running.start((rows,))
    if piece.shape[1]:
      part, _, _ = online.rows_update(part, jnp.asarray(piece, jnp.float32))
    parts.append(part)
  both = online.log_sum_exp(online.combine(*parts))
  np.testing.assert_allclose(np.asarray(both, np.float64)[finite], lse[finite],
                             atol=_tolerance(x.shape[1], 3))
  assert np.all(np.isneginf(np.asarray(both)[~finite]))
