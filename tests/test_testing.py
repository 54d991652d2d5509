"""The numerics rule itself (jaxkernels.testing): it passes rounding and catches real errors,
also on a leaf that the exact answer makes zero everywhere."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkernels import testing
from tests import numerics


def _inputs():
  return numerics.normal(numerics.rng("testing"), (64,), jnp.float32, 3.0)


def _difference(dtype):
  """x - x by a route that rounds in float32: (x + 8) - 8 - x, exactly zero in float64 (a
  float32 x plus 8 fits its 53 bits), not in float32."""
  return lambda x: (x.astype(dtype) + 8.0) - 8.0 - x.astype(dtype)


def test_rounding_passes_and_an_error_fails():
  x = _inputs()
  reference = lambda dtype: lambda x: jnp.sin(x.astype(dtype)) * 2
  got = jnp.sin(x) * 2
  testing.assert_matches(got, reference, (x,), dtype=jnp.float32, reduction=1)
  with pytest.raises(AssertionError, match="leaf 0"):
    testing.assert_matches(got * (1 + 1e-4), reference, (x,), dtype=jnp.float32, reduction=1)


def test_an_all_zero_leaf_is_judged_against_the_inputs_scale():
  x = _inputs()
  oracle = testing.evaluate(_difference, jnp.float64, (x,))
  assert np.all(oracle == 0.0)
  got = _difference(jnp.float32)(x)
  assert np.any(np.asarray(got) != 0)  # float32 leaves rounding behind
  testing.assert_matches(got, _difference, (x,), dtype=jnp.float32, reduction=1)
  assert max(testing.errors(got, oracle, testing.input_scale((x,)))) < 4 * testing.F32_EPS
  # An error that is no rounding still fails: a thousandth of the inputs' scale.
  with pytest.raises(AssertionError, match="leaf 0"):
    testing.assert_matches(got + 1e-3 * float(jnp.max(jnp.abs(x))), _difference, (x,),
                           dtype=jnp.float32, reduction=1)


@pytest.mark.cpu_only
def test_the_baseline_rounds_every_step():
  """The naive baseline, one program, rounds each step to its dtype as evaluation op by op
  does (with XLA's excess precision, its default, it would not: a fusion's intermediates stay
  in float32, and the bar the baseline sets would be tighter than the rule's): a chain of
  bfloat16 elementwise ops, a reduction and the vjp, bit for bit against evaluation with jit
  disabled."""
  gen = numerics.rng("baseline")
  x = numerics.normal(gen, (16, 96), jnp.bfloat16, 2.0)
  ct = numerics.normal(gen, (16, 96), jnp.bfloat16)

  def reference(dtype):
    def f(x):
      y = jnp.exp(x.astype(dtype) * 0.7) * 1.3 - x
      return y / jnp.sum(y * y, axis=-1, keepdims=True)
    return f

  jitted = testing.evaluate(reference, jnp.bfloat16, (x,), ct)
  with jax.disable_jit():
    eager = testing.evaluate(reference, jnp.bfloat16, (x,), ct)
  for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager), strict=True):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
