"""The spec for matmul: jnp, float32 (int32 for int8) accumulation, the epilogue in float32.

y = activation(scale * (a @ b) + bias) + residual, cast to out_dtype, where
scale = a_scale[..., :, None] * b_scale[None, :] dequantizes fp8/int8 operands.
This is also the XLA fallback.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxkernels import _activations


def accumulator_dtype(dtype) -> jnp.dtype:
  return jnp.dtype(jnp.int32 if jnp.issubdtype(dtype, jnp.integer) else jnp.float32)


def epilogue(acc, *, bias=None, activation=None, residual=None, a_scale=None, b_scale=None):
  """The float32 epilogue on a float32 (..., M, N) accumulator, before the output cast."""
  z = acc.astype(jnp.float32)
  if a_scale is not None:
    z = z * (a_scale.astype(jnp.float32)[..., None] if a_scale.ndim else a_scale.astype(jnp.float32))
  if b_scale is not None:
    z = z * b_scale.astype(jnp.float32)
  if bias is not None:
    z = z + bias.astype(jnp.float32)
  if activation is not None:
    z = _activations.reference(activation, z)
  if residual is not None:
    z = z + residual.astype(jnp.float32)
  return z


def matmul(a, b, *, bias=None, activation=None, residual=None, a_scale=None, b_scale=None,
           out_dtype, precision=None):
  dims = (((a.ndim - 1,), (0,)), ((), ()))
  plain = bias is None and activation is None and residual is None and a_scale is None and \
      b_scale is None
  if plain and jnp.issubdtype(a.dtype, jnp.floating) and a.dtype == b.dtype == out_dtype:
    # No epilogue: the product straight in the operands' dtype, as jnp.dot gives it. XLA still
    # accumulates in float32 and rounds once; and under autodiff the gradients' matmuls take
    # the cotangent in that dtype too, where a float32 product would hand them a float32
    # cotangent and make them float32 matmuls (tf32 on a GPU, at twice the bytes: the plain-JAX
    # Llama's step ran 1.6x slower so, bench/NOTES.md model-2).
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=out_dtype)
  acc = lax.dot_general(a, b, dims, precision=precision,
                        preferred_element_type=accumulator_dtype(a.dtype))
  return epilogue(acc, bias=bias, activation=activation, residual=residual, a_scale=a_scale,
                  b_scale=b_scale).astype(out_dtype)
