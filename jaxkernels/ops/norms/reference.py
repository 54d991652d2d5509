"""The spec of rms_norm and layer_norm: pure jnp in float32, also the "xla" implementation.

With a residual, the pre-norm pattern is fused: h = x + residual (in float32),
y = norm(h); the op returns (y, h). y takes x's dtype (the branch's compute
dtype), h the residual's (the residual stream keeps its own precision).

``compute_dtype`` exists for the tests: float32 is the spec; the input dtype
gives the naive low-precision baseline whose error bounds the kernels'
(``jaxkernels.testing``); float64 (with x64 enabled) is the oracle.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def _pre_norm(x, residual, compute_dtype):
  h = x.astype(compute_dtype)
  return h if residual is None else h + residual.astype(compute_dtype)


def _finish(y, x, h, residual):
  y = y.astype(x.dtype)
  return y if residual is None else (y, h.astype(residual.dtype))


def rms_norm(x, scale, *, eps: float, residual=None, compute_dtype=jnp.float32):
  """y = h / sqrt(mean(h^2) + eps) * scale over the last axis, h = x (+ residual)."""
  h = _pre_norm(x, residual, compute_dtype)
  rstd = lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
  return _finish(h * rstd * scale.astype(compute_dtype), x, h, residual)


def layer_norm(x, scale, bias=None, *, eps: float, residual=None, compute_dtype=jnp.float32):
  """y = (h - mean) / sqrt(var + eps) * scale (+ bias) over the last axis, h = x (+ residual)."""
  h = _pre_norm(x, residual, compute_dtype)
  centered = h - jnp.mean(h, axis=-1, keepdims=True)
  rstd = lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + eps)
  y = centered * rstd * scale.astype(compute_dtype)
  if bias is not None:
    y = y + bias.astype(compute_dtype)
  return _finish(y, x, h, residual)
