"""The spec for matmul: jnp, float32 (int32 for int8) accumulation, the epilogue in float32.

y = activation(scale * (a @ b) + bias) + residual, cast to out_dtype, where
scale = a_scale[..., :, None] * b_scale[None, :] dequantizes fp8/int8 operands.
Block scales (``block_scaled``): y = activation(sum over K blocks j of
a_scale[..., j] * (a[..., block j] @ b[block j, :]) * b_scale[j, column block] + bias) + ...
This is also the XLA fallback.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxkernels import _activations, partitioning


def fp8_accuracy(k: int, *, tensor_cores: bool = True) -> tuple[float, float]:
  """The documented accuracy of an fp8 product with a bfloat16 output, (relative per element,
  relative to the output's largest magnitude): the output's rounding, 2^-8; and the running sum
  of the fp8 products, which Hopper's tensor cores round to about 14 bits as they accumulate
  (DeepSeek-V3 report, 3.3.2): a random walk of sqrt(k) such roundings (float32 sums, the
  interpreter's and XLA's on a CPU: 2^-22 a term). fp8 has no naive computation of its own to
  measure against (XLA's runs on the same tensor cores): this bound is its tolerance."""
  return 2 ** -8, (2 ** -14 if tensor_cores else 2 ** -22) * math.sqrt(k)


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


def block_scaled(a, b, a_scale, b_scale):
  """The float32 product of ``a`` (..., M, K) and ``b`` (K, N) under block scales: a_scale
  (..., M, K / bk) scales each row's bk-deep blocks of K, b_scale (K / bk, N / bn) each
  bk x bn block of b. The operands are dequantized in float32 (each element times its block's
  scale, rounded once: 2^-24 relative) and multiplied at full float32 precision: the sum of
  the scaled partial products block by block, without a (K / bk)-fold intermediate."""
  k, n = b.shape
  bk, bn = k // a_scale.shape[-1], n // b_scale.shape[-1]
  a_deq = a.astype(jnp.float32) * jnp.repeat(a_scale.astype(jnp.float32), bk, axis=-1)
  b_deq = b.astype(jnp.float32) * jnp.repeat(jnp.repeat(b_scale.astype(jnp.float32), bk, axis=0),
                                             bn, axis=1)
  return lax.dot_general(a_deq, b_deq, (((a.ndim - 1,), (0,)), ((), ())),
                         precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def is_blocked(a_scale, b_scale) -> bool:
  """Whether the scales are block scales: b_scale of rank 2 (K / bk, N / bn), with a_scale
  (..., M, K / bk) (matmul's validation makes both so where either is)."""
  return b_scale is not None and b_scale.ndim == 2


def _summed_split(a, b):
  """Where a's and b's K are split over a mesh of Explicit axes (a row-parallel product in
  plain JAX), the output's sharding, which JAX asks for (the partial sums then added across
  K's axes); else None."""
  have_a, have_b = partitioning.layout(a), partitioning.layout(b)
  if have_a is None or have_b is None or not (have_a[1][-1] or have_b[1][0]):
    return None
  return jax.sharding.PartitionSpec(*have_a[1][:-1], *have_b[1][1:])


def stacked(a, b, *, bias=None, out_dtype, precision=None):
  """z = a @ b + bias for b (K, 2, N), bias (2, N): (..., M, 2, N), the stacked glu's gate
  and up products (matmul's reference, contracting a's last dimension with b's first)."""
  dims = (((a.ndim - 1,), (0,)), ((), ()))
  acc_dtype = out_dtype if bias is None else accumulator_dtype(a.dtype)
  z = lax.dot_general(a, b, dims, precision=precision, preferred_element_type=acc_dtype,
                      out_sharding=_summed_split(a, b))
  return z if bias is None else epilogue(z, bias=bias).astype(out_dtype)


def matmul(a, b, *, bias=None, activation=None, residual=None, a_scale=None, b_scale=None,
           out_dtype, precision=None):
  if is_blocked(a_scale, b_scale):
    acc = block_scaled(a, b, a_scale, b_scale)
    return epilogue(acc, bias=bias, activation=activation,
                    residual=residual).astype(out_dtype)
  dims = (((a.ndim - 1,), (0,)), ((), ()))
  plain = bias is None and activation is None and residual is None and a_scale is None and \
      b_scale is None
  if plain and jnp.issubdtype(a.dtype, jnp.floating) and a.dtype == b.dtype == out_dtype:
    # No epilogue: the product straight in the operands' dtype, as jnp.dot gives it. XLA still
    # accumulates in float32 and rounds once; and under autodiff the gradients' matmuls take
    # the cotangent in that dtype too, where a float32 product would hand them a float32
    # cotangent and make them float32 matmuls (tf32 on a GPU, at twice the bytes: the plain-JAX
    # Llama's step ran 1.6x slower so, notes/model.md model-2).
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=out_dtype,
                           out_sharding=_summed_split(a, b))
  acc = lax.dot_general(a, b, dims, precision=precision,
                        preferred_element_type=accumulator_dtype(a.dtype),
                        out_sharding=_summed_split(a, b))
  return epilogue(acc, bias=bias, activation=activation, residual=residual, a_scale=a_scale,
                  b_scale=b_scale).astype(out_dtype)


def in_dtype(compute_dtype, a, b, *, bias=None, activation=None, residual=None, a_scale=None,
             b_scale=None, glu=False):
  """The spec computed in ``compute_dtype`` throughout: every operand cast, the product and each
  step of the epilogue rounded to that dtype. float64 is the numerics rule's oracle
  (jaxkernels.testing), the inputs' dtype the naive computation whose error sets a kernel's
  tolerance. Block scales dequantize the operands first (exactly, in float64); ``glu``: b is
  [gate | up] and y = activation(gate) * up."""
  cd = compute_dtype
  a, b = a.astype(cd), b.astype(cd)
  if is_blocked(a_scale, b_scale):
    k, n = b.shape
    bk, bn = k // a_scale.shape[-1], n // b_scale.shape[-1]
    a = a * jnp.repeat(a_scale.astype(cd), bk, axis=-1)
    b = b * jnp.repeat(jnp.repeat(b_scale.astype(cd), bk, axis=0), bn, axis=1)
    a_scale = b_scale = None
  z = jnp.matmul(a, b, preferred_element_type=cd)
  if a_scale is not None:
    z = z * (a_scale.astype(cd)[..., None] if a_scale.ndim else a_scale.astype(cd))
  if b_scale is not None:
    z = z * b_scale.astype(cd)
  if bias is not None:
    z = z + bias.astype(cd)
  if glu:
    gate, up = jnp.split(z, 2, axis=-1)
    y = (gate if activation is None else _activations.reference(activation, gate)) * up
  else:
    y = z if activation is None else _activations.reference(activation, z)
  if residual is not None:
    y = y + residual.astype(cd)
  return y

