"""The spec of the fused elementwise ops: pure jnp in float32, also the "xla" implementation.

``compute_dtype`` exists for the tests (see ops/norms/reference.py).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxkernels import _activations


def bias_activation(x, bias, *, activation: str, compute_dtype=jnp.float32):
  """activation(x + bias), bias broadcast along the last axis; the result in x's dtype."""
  z = x.astype(compute_dtype) + bias.astype(compute_dtype)
  return _activations.reference(activation, z).astype(x.dtype)


def glu(gate, up, *, activation: str = "silu", compute_dtype=jnp.float32):
  """activation(gate) * up (SwiGLU with "silu", GeGLU with "gelu"); the result in gate's dtype."""
  g = gate.astype(compute_dtype)
  return (_activations.reference(activation, g) * up.astype(compute_dtype)).astype(gate.dtype)
