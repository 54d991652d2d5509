"""The spec of softmax: pure jnp in float32, also the "xla" implementation.

A row whose entries are all -inf (fully masked) gives zeros, not NaN: its
maximum is replaced by 0 before the exponent, and its zero sum by 1.
``compute_dtype`` exists for the tests (see ops/norms/reference.py).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def softmax(x, *, axis: int = -1, compute_dtype=jnp.float32):
  z = x.astype(compute_dtype)
  peak = lax.stop_gradient(jnp.max(z, axis=axis, keepdims=True))
  peak = jnp.where(jnp.isneginf(peak), 0, peak)
  e = jnp.exp(z - peak)
  total = jnp.sum(e, axis=axis, keepdims=True)
  return (e / jnp.where(total == 0, 1, total)).astype(x.dtype)
