"""The numerics rule itself (jaxkernels.testing): it passes rounding and catches real errors,
also on a leaf that the exact answer makes zero everywhere."""

from __future__ import annotations

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
