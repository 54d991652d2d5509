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


def _product(dtype):
  return lambda a, b: a.astype(dtype) @ b.astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_rule_is_pinned(dtype):
  """The rule's bound for a product of 256-long sums, derived here on its own (the naive
  product's error, measured op by op against NumPy's float64 product, twice, plus float32's
  floor 4 eps sqrt(n)), is exactly what the library allows; an error of 1.5 times it fails,
  0.9 times passes. bfloat16 pins the factor two, float32 the floor: a rule made looser (ten
  times, or the factor three) passes its other tests, and fails here."""
  gen = numerics.rng("pinned", jnp.dtype(dtype).name)
  a = numerics.normal(gen, (8, 256), dtype)
  b = numerics.normal(gen, (256, 16), dtype)
  exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  with jax.disable_jit():  # op by op: each step rounded to the dtype
    naive = np.asarray(_product(dtype)(a, b), np.float64)
  scale = np.max(np.abs(exact))
  bound = 2 * np.max(np.abs(naive - exact)) / scale + 4 * testing.F32_EPS * np.sqrt(256)
  oracle, (allowed,) = testing.tolerances(_product, (a, b), dtype=dtype, reduction=256)
  np.testing.assert_allclose(allowed, bound, rtol=1e-6)
  worst = np.unravel_index(np.argmax(np.abs(exact)), exact.shape)
  for factor, passes in ((0.9, True), (1.5, False)):
    got = np.array(oracle, np.float64)
    got[worst] -= np.sign(got[worst]) * factor * bound * scale
    if passes:
      testing.assert_matches(got, _product, (a, b), dtype=dtype, reduction=256)
    else:
      with pytest.raises(AssertionError, match="leaf 0"):
        testing.assert_matches(got, _product, (a, b), dtype=dtype, reduction=256)


def test_a_loosening_applies_to_its_own_leaf():
  """pointwise_rtol given a leaf: the other leaves keep the rule's own bound (a loosening derived
  for one gradient once widened all five of attention's leaves); one number widens them all;
  the wrong count is refused by name."""
  x = _inputs()
  reference = lambda dtype: lambda x: (jnp.sin(x.astype(dtype)), jnp.cos(x.astype(dtype)))
  oracle, base = testing.tolerances(reference, (x,), dtype=jnp.float32, reduction=1)
  _, split = testing.tolerances(reference, (x,), dtype=jnp.float32, reduction=1,
                                pointwise_rtol=[0.0, 1e-3])
  assert split[0] == base[0] and split[1] == pytest.approx(1e-3 + base[1] - 4 * testing.F32_EPS)
  _, both = testing.tolerances(reference, (x,), dtype=jnp.float32, reduction=1,
                               pointwise_rtol=1e-3)
  assert both[0] > 1e-3 and both[1] > 1e-3
  got = (oracle[0] * (1 + 1e-4), oracle[1])
  with pytest.raises(AssertionError, match="leaf 0"):
    testing.assert_matches(got, reference, (x,), dtype=jnp.float32, reduction=1,
                           pointwise_rtol=[0.0, 1e-3])
  with pytest.raises(ValueError, match="pointwise_rtol: 3 values for 2 floating leaves"):
    testing.tolerances(reference, (x,), dtype=jnp.float32, reduction=1,
                       pointwise_rtol=[0.0, 0.0, 0.0])
