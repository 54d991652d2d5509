"""matmul's test cases, shared by its test files and the sharded ones: the epilogues, the
float64 specs of the product and of the gated product, their inputs, and the base class every
kernel's class runs."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import jaxkernels as jk
from jaxkernels import _activations
from jaxkernels.ops.matmul import reference as matmul_reference
from jaxkernels.ops.matmul import triton
from bench import shapes
from tests import cases, numerics


EPILOGUES = (  # (activation, bias, residual)
    (None, False, False), ("gelu", True, True), ("gelu_tanh", True, False),
    ("silu", False, True), ("relu", True, True))


def reference(activation, has_bias, has_residual, glu=False):
  """The spec computed in ``compute_dtype`` throughout (float64: the oracle; the input dtype:
  the naive baseline whose error sets the tolerance); ``glu``: the gated product's,
  y = activation(z[..., :N]) * z[..., N:] + residual, z = a @ b + bias."""
  def make(cd):
    def fn(a, b, *rest):
      rest = list(rest)
      bias = rest.pop(0) if has_bias else None
      residual = rest.pop(0) if has_residual else None
      return matmul_reference.in_dtype(cd, a, b, bias=bias, residual=residual,
                                       activation=activation, glu=glu)
    return fn
  return make


def inputs(shape, dtype, has_bias, has_residual, *labels):
  """a (..., M, K), b (K, N) scaled so that a @ b ~ N(0, 1): activations stay where their
  accuracy is documented."""
  *lead, m, n, k = shape
  gen = numerics.rng("matmul", shape, jnp.dtype(dtype).name, has_bias, has_residual, *labels)
  s = k ** -0.25
  primals = [numerics.normal(gen, (*lead, m, k), dtype, s), numerics.normal(gen, (k, n), dtype, s)]
  if has_bias:
    primals.append(numerics.normal(gen, (n,), dtype, 0.5))
  if has_residual:
    primals.append(numerics.normal(gen, (*lead, m, n), dtype))
  return primals, numerics.normal(gen, (*lead, m, n), dtype)


class MatmulTest:
  IMPL = "xla"
  CONFIG = None  # small tiles, so that edges, K tails and many programs are all exercised

  def op(self, activation, has_bias, has_residual, config=None):
    def fn(a, b, *rest):
      rest = list(rest)
      bias = rest.pop(0) if has_bias else None
      residual = rest.pop(0) if has_residual else None
      return jk.matmul(a, b, bias=bias, residual=residual, activation=activation,
                       implementation=self.IMPL, config=config or self.CONFIG)
    return fn

  def check(self, shape, dtype, epilogue, grads=True):
    activation, has_bias, has_residual = epilogue
    primals, ct = inputs(shape, dtype, has_bias, has_residual, activation)
    cases.check("matmul", self.IMPL, self.op(activation, has_bias, has_residual),
                reference(activation, has_bias, has_residual), primals, ct, dtype=dtype,
                reduction=max(math.prod(shape[:-2]), shape[-1]),
                pointwise_rtol=_activations.RTOL, support=(primals[:2], {}), grads=grads)

  # M, N, K: one odd size each, none a multiple of any block; a batched a; K < one block. Each
  # with every epilogue compiled; interpreted, a cross through the first shape and gelu + bias +
  # residual (numerics.grid).
  @pytest.mark.parametrize("shape,epilogue", numerics.grid(
      shapes.MATMUL_ODD, EPILOGUES, center=(shapes.MATMUL_ODD[0], EPILOGUES[1])))
  def test_float32(self, shape, epilogue):
    self.check(shape, jnp.float32, epilogue)

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  @pytest.mark.parametrize("epilogue", EPILOGUES[:2], ids=lambda e: "-".join(map(str, e)))
  def test_low_precision(self, dtype, epilogue):
    self.check((3, 33, 140, 72), dtype, epilogue)

  def test_out_dtype(self):
    primals, _ = inputs((40, 50, 60), jnp.bfloat16, False, False)
    with numerics.kernel_mode():
      numerics.must_serve(jk.supports("matmul", self.IMPL, *primals, out_dtype=jnp.float32))
      y = jk.matmul(*primals, out_dtype=jnp.float32, implementation=self.IMPL,
                    config=self.CONFIG)
    assert y.dtype == jnp.float32
    want = np.asarray(primals[0], np.float64) @ np.asarray(primals[1], np.float64)
    # bf16 operands are exact in float32 products; only the float32 sums round.
    np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=1e-5 * np.abs(want).max())


def glu_reference(activation, has_bias, has_residual):
  """The gated product's spec (:func:`reference` with ``glu``)."""
  return reference(activation, has_bias, has_residual, glu=True)


def glu_inputs(shape, dtype, has_bias, has_residual, *labels):
  """a (..., M, K), b (K, 2N) [gate | up], as ``inputs`` scales them; the cotangent (..., M, N)."""
  *lead, m, n, k = shape
  primals, _ = inputs((*lead, m, 2 * n, k), dtype, has_bias, False, "glu", *labels)
  gen = numerics.rng("matmul-glu", shape, jnp.dtype(dtype).name, *labels)
  if has_residual:
    primals.append(numerics.normal(gen, (*lead, m, n), dtype))
  return primals, numerics.normal(gen, (*lead, m, n), dtype)


# Triton's product at small blocks: what its class interprets, and the fp8 tests' config.
TRITON_SMALL = triton.Config(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4,
                             num_stages=2)

# The bad-input tests' operands (zeros: only their shapes and dtypes are read).
A = jnp.zeros((4, 8), jnp.bfloat16)
B = jnp.zeros((8, 16), jnp.bfloat16)
