"""The kernels' activations against float64, pointwise, on a dense grid: the documented accuracy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkernels import _activations


def _fma_rounded_once(a, b, c):
  """A hardware FMA's result (the float32 product is exact in float64), as compiled Triton
  kernels compute it (_triton.MATH); needs x64 enabled."""
  f64 = lambda v: jnp.asarray(v).astype(jnp.float64)
  return (f64(a) * f64(b) + f64(c)).astype(jnp.float32)


# The formulas as the plain arithmetic and as fused multiply-adds: both keep the documented
# accuracy (the hardware's approximate exp2 and reciprocal are checked on the GPU, bench/).
MATHS = {"exact": _activations.EXACT, "fused": _activations.Math(fma=_fma_rounded_once)}


@pytest.mark.parametrize("math", MATHS)
@pytest.mark.parametrize("name", _activations.ACTIVATIONS)
def test_pointwise_accuracy(name, math):
  bound = _activations.ACCURATE_RANGE
  m = MATHS[math]
  x = np.linspace(-bound, bound, 200_001, dtype=np.float32)
  with jax.enable_x64(math == "fused"):
    value, slope = jax.jit(lambda a: _activations.value_and_grad(name, a, m))(jnp.asarray(x))
    applied = jax.jit(lambda a: _activations.apply(name, a, m))(jnp.asarray(x))
  assert value.dtype == slope.dtype == applied.dtype == jnp.float32
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


@pytest.mark.parametrize("math", MATHS)
@pytest.mark.parametrize("name", _activations.ACTIVATIONS)
def test_non_finite_and_huge_inputs_match_the_reference(name, math):
  """inf, -inf, NaN and values near float32's end give what the reference gives (NaN where it
  does): no NaN from a formula's inf * 0 where the reference returns inf."""
  x = jnp.asarray([np.inf, -np.inf, np.nan, 3e38, -3e38, 1e20, -1e20, -40.0, 40.0], jnp.float32)
  want = np.asarray(_activations.reference(name, x))
  with jax.enable_x64(math == "fused"):
    got = (_activations.apply(name, x, MATHS[math]),
           _activations.value_and_grad(name, x, MATHS[math])[0])
  for g in got:
    np.testing.assert_array_equal(np.asarray(g), want)
