"""Activations and their derivatives as kernels compute them (float32 in, float32 out).

One definition serves every backend. Triton has no ``erf`` lowering, so exact
GELU's normal CDF is computed here from Numerical Recipes' Chebyshev fit of
erfc (fractional error 1.2e-7 in float64): CDF(x) = erfc(|x| / sqrt 2) / 2 for
x < 0, one minus that otherwise, so the CDF keeps its relative accuracy in the
left tail where 1 + erf(x / sqrt 2) would cancel; GELU itself is
max(x, 0) - |x| CDF(-|x|), which needs no select. ``exp`` is 2**(x log2 e), one
SFU instruction on a GPU.

Accuracy against float64 (tests/test_activations.py): on [-4, 4], values
within ``RTOL`` relative and slopes within ``RTOL`` of max(|slope|, 1),
pointwise. Past that, values are below ~1e-4 and their relative error grows
like x**2 * 2**-24 from rounding the exponent (at -6: ~4e-6), where the naive
float32 formulas return 0.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")

# Numerical Recipes' erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z / 2); Horner order.
_ERFC = (0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806,
         0.09678418, 0.37409196, 1.00002368, -1.26551223)
RTOL = 2e-6  # measured worst on [-4, 4]: 1.4e-6 (gelu), 1.3e-6 (gelu_tanh), 3e-7 (silu)
ACCURATE_RANGE = 4.0
_SQRT_HALF = 1 / math.sqrt(2)
_INV_SQRT_2PI = 1 / math.sqrt(2 * math.pi)
_TANH_C = math.sqrt(2 / math.pi)
_TANH_K = 0.044715
_LOG2E = math.log2(math.e)
_FLOAT32_MAX = 3.4028234663852886e38
# The same fit for log2(erfc(z) / 2) + z^2 log2 e: scaled by log2 e, less 1 for the halving.
_ERFC_LOG2 = tuple(c * _LOG2E for c in _ERFC[:-1]) + (_ERFC[-1] * _LOG2E - 1.0,)


def _horner(coefficients, x):
  acc = jnp.full_like(x, coefficients[0])
  for c in coefficients[1:]:
    acc = acc * x + c
  return acc


def exp(x):
  """e**x as 2**(x log2 e): one SFU instruction on a GPU (libdevice's expf is ~10).

  Relative error ~|x| * 2**-24 from rounding the product: at most ~5e-6 over
  float32's range, and where |x| is large the values it feeds saturate.
  """
  return jnp.exp2(x * _LOG2E)


def _sigmoid(x, reciprocal=None):
  return _reciprocal(1.0 + exp(-x), reciprocal)


def _reciprocal(x, reciprocal):
  return 1.0 / x if reciprocal is None else reciprocal(x)


def _normal_tail(x, reciprocal=None):
  """P(N(0, 1) <= -|x|) = erfc(|x| / sqrt 2) / 2: relative error bounded on the whole line.

  The fit's exp(-z^2 + P(t)) / 2 is evaluated as 2**(P'(t) - x^2 log2(e) / 2), with log2 e
  and the halving folded into P' (_ERFC_LOG2), and t from |x| by one FMA: 11 FMAs, 2
  multiplies, a reciprocal and an exp2 an element, where the unfolded form took 2 multiplies
  more (SASS counts in bench/results/nvidia_h200/*_matmul-gelu-epilogue-sass-counts.txt).
  """
  t = _reciprocal(1.0 + (0.5 * _SQRT_HALF) * jnp.abs(x), reciprocal)
  return t * jnp.exp2(_horner(_ERFC_LOG2, t) + (-0.5 * _LOG2E) * x * x)


def apply(name: str, x, reciprocal=None):
  """act(x) for float32 x; ``reciprocal`` may swap in a faster 1/x (a kernel's hardware one)."""
  if name == "gelu":
    # x * CDF(x) = max(x, 0) - |x| * CDF(-|x|): one max and one FMA, no select on the sign.
    # The min keeps gelu(+inf) = inf (inf * a zero tail is NaN), as the reference has it.
    return (jnp.maximum(x, 0.0)
            - jnp.abs(jnp.minimum(x, _FLOAT32_MAX)) * _normal_tail(x, reciprocal))
  if name == "gelu_tanh":
    # 0.5 * (1 + tanh(u)) == sigmoid(2u): the same function without 1 + tanh(u)'s
    # cancellation for x << 0, and an exp instead of a tanh.
    return x * _sigmoid(2.0 * _TANH_C * (x + _TANH_K * x * x * x), reciprocal)
  if name == "silu":
    return x * _sigmoid(x, reciprocal)
  if name == "relu":
    return jnp.maximum(x, 0.0)
  raise ValueError(f"activation={name!r}: expected one of {ACTIVATIONS}")


def value_and_grad(name: str, x, reciprocal=None):
  """(act(x), act'(x)) for float32 x, sharing the transcendental work."""
  if name == "gelu":
    tail = _normal_tail(x, reciprocal)
    cdf = jnp.where(x < 0, tail, 1.0 - tail)
    return x * cdf, cdf + x * _INV_SQRT_2PI * exp(-0.5 * x * x)
  if name == "gelu_tanh":
    s = _sigmoid(2.0 * _TANH_C * (x + _TANH_K * x * x * x), reciprocal)
    du = 2.0 * _TANH_C * (1.0 + 3.0 * _TANH_K * x * x)
    return x * s, s + x * s * (1.0 - s) * du
  if name == "silu":
    s = _sigmoid(x, reciprocal)
    return x * s, s * (1.0 + x * (1.0 - s))
  if name == "relu":
    return jnp.maximum(x, 0.0), jnp.where(x > 0, 1.0, 0.0).astype(x.dtype)
  raise ValueError(f"activation={name!r}: expected one of {ACTIVATIONS}")


def reference(name: str, x):
  """The spec: jax.nn's definition, differentiated by JAX itself."""
  if name == "gelu":
    return jax.nn.gelu(x, approximate=False)
  if name == "gelu_tanh":
    return jax.nn.gelu(x, approximate=True)
  if name == "silu":
    return jax.nn.silu(x)
  if name == "relu":
    return jax.nn.relu(x)
  raise ValueError(f"activation={name!r}: expected one of {ACTIVATIONS}")
