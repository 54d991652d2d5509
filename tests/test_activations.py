"""The kernels' activations against float64, pointwise, on a dense grid: the documented accuracy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkernels import _activations


@pytest.mark.parametrize("name", _activations.ACTIVATIONS)
def test_pointwise_accuracy(name):
  bound = _activations.ACCURATE_RANGE
  x = np.linspace(-bound, bound, 200_001, dtype=np.float32)
  value, slope = jax.jit(lambda a: _activations.value_and_grad(name, a))(jnp.asarray(x))
  applied = jax.jit(lambda a: _activations.apply(name, a))(jnp.asarray(x))
  with jax.enable_x64(True):
    x64 = jnp.asarray(x, jnp.float64)
    true_value = np.asarray(_activations.reference(name, x64))
    true_slope = np.asarray(jax.vmap(jax.grad(lambda a: _activations.reference(name, a)))(x64))
  for got in (value, applied):
    got = np.asarray(got, np.float64)
    assert np.max(np.abs(got - true_value) / np.maximum(np.abs(true_value), 1e-300)) <= \
        _activations.RTOL
  slope = np.asarray(slope, np.float64)
  assert np.max(np.abs(slope - true_slope) / np.maximum(np.abs(true_slope), 1.0)) <= \
      _activations.RTOL


def test_gelu_left_tail_keeps_relative_accuracy():
  """Where 1 + erf(x / sqrt 2) would cancel, the erfc fit keeps the CDF's relative accuracy."""
  x = np.linspace(-6, -4, 2001, dtype=np.float32)
  got = np.asarray(_activations.apply("gelu", jnp.asarray(x)), np.float64)
  with jax.enable_x64(True):
    want = np.asarray(_activations.reference("gelu", jnp.asarray(x, jnp.float64)))
  # Exponent rounding: relative error ~ x^2 * 2^-24 (see the module docstring).
  assert np.all(np.abs(got - want) / np.abs(want) <= 8 * x.astype(np.float64) ** 2 * 2.0**-24)


@pytest.mark.parametrize("name", _activations.ACTIVATIONS)
def test_non_finite_and_huge_inputs_match_the_reference(name):
  """inf, -inf, NaN and values near float32's end give what the reference gives (NaN where it
  does): no NaN from a formula's inf * 0 where the reference returns inf."""
  x = jnp.asarray([np.inf, -np.inf, np.nan, 3e38, -3e38, 1e20, -1e20, -40.0, 40.0], jnp.float32)
  want = np.asarray(_activations.reference(name, x))
  for got in (_activations.apply(name, x), _activations.value_and_grad(name, x)[0]):
    np.testing.assert_array_equal(np.asarray(got), want)
