"""Activations and their derivatives as kernels compute them (float32 in, float32 out).

One definition serves every backend. Triton has no ``erf`` lowering, so exact
GELU's normal CDF is computed here from Numerical Recipes' Chebyshev fit of
erfc (fractional error 1.2e-7 in float64): CDF(x) = erfc(|x| / sqrt 2) / 2 for
x < 0, one minus that otherwise, so the CDF keeps its relative accuracy in the
left tail where 1 + erf(x / sqrt 2) would cancel; GELU itself is
max(x, 0) - |x| CDF(-|x|), which needs no select. ``exp`` is 2**(x log2 e), one
SFU instruction on a GPU.

The formulas are written as fused multiply-adds through ``Math``, the arithmetic a kernel
swaps in: Triton kernels compiled by XLA get no FMA contraction (their SASS has FMUL and FADD
only), so there ``Math.fma`` is an explicit fma.rn.f32 (notes/rows.md run 22).

Accuracy against float64 (tests/test_activations.py): on [-4, 4], values
within ``RTOL`` relative and slopes within ``RTOL`` of max(|slope|, 1),
pointwise. Past that, values are below ~1e-4 and their relative error grows
like x**2 * 2**-24 from rounding the exponent (at -6: ~4e-6), where the naive
float32 formulas return 0.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

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
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_FLOAT32_MAX = 3.4028234663852886e38
# The same fit for log2(erfc(z) / 2) + z^2 log2 e: scaled by log2 e, less 1 for the halving.
_ERFC_LOG2 = tuple(c * LOG2E for c in _ERFC[:-1]) + (_ERFC[-1] * LOG2E - 1.0,)


@dataclasses.dataclass(frozen=True)
class Math:
  """The arithmetic the activations are built from. The default is plain jnp (any backend,
  interpret mode); a compiled kernel swaps in its hardware's forms (``_triton.MATH``)."""
  reciprocal: Callable = lambda x: 1.0 / x
  exp2: Callable = jnp.exp2
  fma: Callable = lambda a, b, c: a * b + c  # a * b + c, rounded once where the hardware can


EXACT = Math()


def _horner(coefficients, x, m: Math):
  acc = jnp.full_like(x, coefficients[0])
  for c in coefficients[1:]:
    acc = m.fma(acc, x, c)
  return acc


def exp(x):
  """e**x as 2**(x log2 e): one SFU instruction on a GPU (libdevice's expf is ~10).

  Relative error ~|x| * 2**-24 from rounding the product: at most ~5e-6 over
  float32's range, and where |x| is large the values it feeds saturate.
  """
  return jnp.exp2(x * LOG2E)


def _sigmoid_exp2(arg, m: Math):
  """1 / (1 + 2**arg): sigmoid(v) for arg = -v log2 e, the scale folded into arg's constants."""
  return m.reciprocal(1.0 + m.exp2(arg))


def _normal_tail(x, xx, m: Math):
  """P(N(0, 1) <= -|x|) = erfc(|x| / sqrt 2) / 2 (xx = x * x): relative error bounded on the
  whole line.

  The fit's exp(-z^2 + P(t)) / 2 is evaluated as 2**(P'(t) - x^2 log2(e) / 2), with log2 e
  and the halving folded into P' (_ERFC_LOG2), and t from |x| by one FMA: 11 FMAs, 2
  multiplies, a reciprocal and an exp2 an element (SASS counts in
  results/nvidia_h200/*_matmul-gelu-epilogue-sass-counts.txt).
  """
  t = m.reciprocal(m.fma(jnp.abs(x), 0.5 * _SQRT_HALF, 1.0))
  return t * m.exp2(m.fma(xx, -0.5 * LOG2E, _horner(_ERFC_LOG2, t, m)))


def _tanh_arg(x, xx, m: Math):
  """-2u log2 e for GELU-tanh's u = sqrt(2/pi) (x + 0.044715 x^3), as x (a + b x^2)."""
  return x * m.fma(xx, -2.0 * _TANH_C * _TANH_K * LOG2E, -2.0 * _TANH_C * LOG2E)


def apply(name: str, x, m: Math = EXACT):
  """act(x) for float32 x, in the arithmetic ``m`` (a kernel's fast forms)."""
  if name == "gelu":
    # x * CDF(x) = max(x, 0) - |x| * CDF(-|x|): one max and one FMA, no select on the sign.
    # The min keeps gelu(+inf) = inf (inf * a zero tail is NaN), as the reference has it.
    return m.fma(-jnp.abs(jnp.minimum(x, _FLOAT32_MAX)), _normal_tail(x, x * x, m),
                 jnp.maximum(x, 0.0))
  if name == "gelu_tanh":
    # 0.5 * (1 + tanh(u)) == sigmoid(2u): the same function without 1 + tanh(u)'s
    # cancellation for x << 0, and an exp instead of a tanh.
    return x * _sigmoid_exp2(_tanh_arg(x, x * x, m), m)
  if name == "silu":
    return x * _sigmoid_exp2(x * -LOG2E, m)
  if name == "relu":
    return jnp.maximum(x, 0.0)
  raise ValueError(f"activation={name!r}: expected one of {ACTIVATIONS}")


def value_and_grad(name: str, x, m: Math = EXACT):
  """(act(x), act'(x)) for float32 x, sharing the transcendental work."""
  if name == "gelu":
    xx = x * x
    tail = _normal_tail(x, xx, m)
    cdf = jnp.where(x < 0, tail, 1.0 - tail)
    pdf = m.exp2(xx * (-0.5 * LOG2E))  # sqrt(2 pi) times the normal density
    return x * cdf, m.fma(x * _INV_SQRT_2PI, pdf, cdf)
  if name == "gelu_tanh":
    xx = x * x
    s = _sigmoid_exp2(_tanh_arg(x, xx, m), m)
    du = m.fma(xx, 6.0 * _TANH_C * _TANH_K, 2.0 * _TANH_C)  # d(2u)/dx
    return x * s, m.fma(x * du, m.fma(-s, s, s), s)  # s + x du s (1 - s)
  if name == "silu":
    s = _sigmoid_exp2(x * -LOG2E, m)
    return x * s, s * m.fma(x, 1.0 - s, 1.0)  # s (1 + x (1 - s))
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
