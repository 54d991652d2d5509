"""fp8 and int8 products: Mosaic GPU's and Triton's fp8 against the reference, block scales
(MXFP8's 1x32, DeepSeek-V3's 1x128 and 128x128) on every path, quantize, and bad scales."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkernels as jk
from jaxkernels import _mosaic_gpu, hardware
from jaxkernels.ops.matmul import mosaic_gpu, triton
from jaxkernels.ops.matmul import reference as matmul_reference
from jaxkernels.ops.matmul.common import Problem
from tests import numerics
from tests.conftest import cuda_lowering
from tests.matmul_cases import A, B, TRITON_SMALL


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("shape", [(3, 100, 1027, 130), (257, 383, 129)])
def test_mosaic_gpu_fp8(dtype, shape):
  """fp8 with per-row and per-column scales on odd shapes (B transposed to K-major by the
  wrapper, K padded to whole 128-deep steps). Compiled only: the interpreter hangs on fp8."""
  if not numerics.COMPILED:
    pytest.skip("the Mosaic GPU interpreter hangs on fp8 (jax 0.10.2): compiled only")
  *lead, m, k, n = shape
  gen = numerics.rng("mosaic-gpu-fp8", shape, jnp.dtype(dtype).name)
  a = numerics.normal(gen, (*lead, m, k), dtype)
  b = numerics.normal(gen, (k, n), dtype)
  a_scale = jnp.asarray(gen.uniform(0.5, 2, (*lead, m)), jnp.float32)
  b_scale = jnp.asarray(gen.uniform(0.5, 2, n), jnp.float32)
  numerics.must_serve(jk.supports("matmul", "mosaic_gpu", a, b, a_scale=a_scale,
                                  b_scale=b_scale))
  y = jk.matmul(a, b, a_scale=a_scale, b_scale=b_scale, implementation="mosaic_gpu")
  want = (np.asarray(a, np.float64) @ np.asarray(b, np.float64)
          * np.asarray(a_scale, np.float64)[..., None] * np.asarray(b_scale, np.float64))
  _assert_fp8_product(y, want, k)


def test_fp8_triton_and_reference():
  gen = numerics.rng("fp8-triton")
  a = numerics.normal(gen, (3, 20, 70), jnp.float8_e5m2)
  b = numerics.normal(gen, (70, 50), jnp.float8_e5m2)
  a_scale = jnp.asarray(gen.uniform(0.5, 2, (3, 20)), jnp.float32)
  want = np.einsum("bmk,kn->bmn", np.asarray(a, np.float64), np.asarray(b, np.float64)) * \
      np.asarray(a_scale, np.float64)[..., None]
  for impl in ("xla", "triton"):
    with numerics.kernel_mode():
      y = jk.matmul(a, b, a_scale=a_scale, implementation=impl,
                    config=triton.Config(block_m=16, block_n=32, block_k=32, num_warps=4,
                                         num_stages=2) if impl == "triton" else None)
    assert y.dtype == jnp.bfloat16
    # bf16 output: 2^-8 relative. Compiled, the tensor cores also round the fp8 products' sum
    # to about 14 bits as they accumulate (DeepSeek-V3 report, 3.3.2, measured on Hopper): a
    # random walk of sqrt(K) such roundings of the running sum.
    atol = (2 ** -14 * math.sqrt(70) if numerics.COMPILED else 1e-6) * np.abs(want).max()
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2 ** -8, atol=atol)
  with jk.interpret_mode(), pytest.raises(TypeError,
                                          match="no gradient through a float8_e5m2 matmul"):
    jax.grad(lambda s: jk.matmul(a, b, a_scale=s, implementation="triton",
                                 config=TRITON_SMALL).astype(jnp.float32).sum())(
        jnp.float32(1.0))


# --------------------------------------------------------------------------- #
# Block-scaled fp8: MXFP8 (1x32), DeepSeek-V3 (1x128 activations, 128x128 weights)
# --------------------------------------------------------------------------- #

# (a_scale's block (rows, K), b_scale's block (K, N)): None is per tensor, "row"/"col" per row
# of a and per column of b (repeated over the other's blocks).
BLOCK_SCHEMES = {
    "mxfp8": ((1, 32), (32, 1)),
    "deepseek": ((1, 128), (128, 128)),
    "a blocks, b per column": ((1, 64), "col"),
    "a per tensor, b blocks": (None, (256, 64)),
}


def _block_scaled_case(gen, lead, m, k, n, scheme, dtype=jnp.float8_e4m3fn):
  """fp8 a, b and scales of ``scheme``, from bf16 values with outlier rows and columns (whose
  blocks the scales exist for), with the float64 product they stand for."""
  a_block, b_block = BLOCK_SCHEMES[scheme]
  scale = lambda shape: jnp.asarray(gen.uniform(0.25, 4, shape), jnp.float32)
  a = numerics.normal(gen, (*lead, m, k), dtype)
  b = numerics.normal(gen, (k, n), dtype)
  a_scale = (scale(()) if a_block is None else
             scale((*lead, m // a_block[0], k // a_block[1])))
  b_scale = scale((n,)) if b_block == "col" else scale((k // b_block[0], n // b_block[1]))
  a64 = np.asarray(a, np.float64) * (np.repeat(np.asarray(a_scale, np.float64), a_block[1], -1)
                                     if a_block else np.asarray(a_scale, np.float64))
  b64 = np.asarray(b, np.float64) * (np.asarray(b_scale, np.float64) if b_block == "col" else
                                     np.repeat(np.repeat(np.asarray(b_scale, np.float64),
                                                         b_block[0], 0), b_block[1], 1))
  return a, b, a_scale, b_scale, a64 @ b64


def _assert_fp8_product(y, want, k):
  """bf16 output: 2^-8 relative. Compiled, the tensor cores round the fp8 products' running sum
  to about 14 bits (test_fp8_triton_and_reference): a random walk of sqrt(K) such roundings,
  each block's sum scaled; interpreted or on XLA, float32 sums (2^-24 a term)."""
  rtol, walk = matmul_reference.fp8_accuracy(k, tensor_cores=numerics.COMPILED)
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=rtol,
                             atol=walk * np.abs(want).max())


@pytest.mark.parametrize("scheme", sorted(BLOCK_SCHEMES))
def test_block_scales(scheme):
  """Block scales on the backend's default (the XLA reference on the CPU, the Mosaic GPU kernel
  on Hopper) and on XLA, with leading dimensions and a bias + gelu epilogue after the scaled
  sum, against the float64 product of the dequantized operands."""
  gen = numerics.rng("block-scales", scheme)
  lead, m, k, n = (2,), 72, 512, 384
  a, b, a_scale, b_scale, want = _block_scaled_case(gen, lead, m, k, n, scheme)
  bias = numerics.normal(gen, (n,), jnp.float32)
  z = want + np.asarray(bias, np.float64)
  want_y = 0.5 * z * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
  for impl in (None, "xla"):
    y = jk.matmul(a, b, a_scale=a_scale, b_scale=b_scale, bias=bias, activation="gelu",
                  implementation=impl)
    chex.assert_shape(y, (*lead, m, n))
    chex.assert_type(y, jnp.bfloat16)
    _assert_fp8_product(y, want_y, k)


@pytest.mark.parametrize("scheme", ["mxfp8", "deepseek"])
def test_block_scales_on_mosaic_gpu(scheme):
  """The Hopper kernel at ragged M (and its ring over several tiles); compiled only (the
  interpreter hangs on fp8: test_mosaic_gpu_block_scales_interpreted runs the same main loop
  on bfloat16)."""
  if not numerics.COMPILED:
    pytest.skip("the Mosaic GPU interpreter hangs on fp8 (jax 0.10.2): compiled only")
  gen = numerics.rng("block-scales-mgpu", scheme)
  a, b, a_scale, b_scale, want = _block_scaled_case(gen, (), 1000, 1024, 768, scheme)
  numerics.must_serve(jk.supports("matmul", "mosaic_gpu", a, b, a_scale=a_scale,
                                  b_scale=b_scale))
  y = jk.matmul(a, b, a_scale=a_scale, b_scale=b_scale, implementation="mosaic_gpu")
  _assert_fp8_product(y, want, 1024)


@pytest.mark.parametrize("block_k, block_n, tile_k, stages", [(64, 1, 64, 3), (128, 128, 64, 2)])
def test_mosaic_gpu_block_scales_interpreted(block_k, block_n, tile_k, stages, monkeypatch):
  """The block-scaled main loop in the interpreter, on bfloat16 operands (its fp8 hangs): two
  SMs, so that each CTA walks several tiles through a ring that wraps mid-tile; a 128-deep block
  in two 64-deep K steps (its scales repeated by the wrapper); b scales per column, or one per
  128 x 128 block (a CTA tile's one scale, handed over along its rows); bias + relu after the
  sum; float32 out."""
  monkeypatch.setattr(_mosaic_gpu, "num_sms", lambda: 2)
  gen = numerics.rng("block-scales-interpreted", block_k)
  m, k, n = 256, 5 * block_k if block_k == 64 else 384, 256
  a = numerics.normal(gen, (m, k), jnp.bfloat16)
  b = numerics.normal(gen, (k, n), jnp.bfloat16)
  a_scale = jnp.asarray(gen.uniform(0.25, 4, (m, k // block_k)), jnp.float32)
  b_scale = jnp.asarray(gen.uniform(0.25, 4, (k // block_k, n // block_n)), jnp.float32)
  bias = numerics.normal(gen, (n,), jnp.float32)
  p = Problem(m=m, n=n, k=k, dtype=jnp.dtype(jnp.bfloat16), out_dtype=jnp.dtype(jnp.float32),
              block_k=block_k, block_n=block_n, has_bias=True, activation="relu")
  config = mosaic_gpu.Config(tile_m=64, tile_n=128, tile_k=tile_k, stages=stages, split="m",
                             ring=True)
  assert mosaic_gpu.config_error(p, config, None) is None
  assert mosaic_gpu.heuristic(p, hardware.DEFAULT_GPU).tile_k == tile_k
  y = mosaic_gpu.matmul(a, b, bias=bias, a_scale=a_scale, b_scale=b_scale, problem=p,
                        config=config, interpret=_mosaic_gpu.interpret_params())
  a64 = np.asarray(a, np.float64) * np.repeat(np.asarray(a_scale, np.float64), block_k, 1)
  b64 = np.asarray(b, np.float64) * np.repeat(np.repeat(np.asarray(b_scale, np.float64),
                                                        block_k, 0), block_n, 1)
  want = np.maximum(a64 @ b64 + np.asarray(bias, np.float64), 0)
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-5,
                             atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("block_k", [32, 128, 256])
def test_mosaic_gpu_block_scales_lower_for_cuda(block_k):
  """fp8 block scales 32, 128 and 256 deep (two K steps a block) lower for CUDA, Mosaic GPU's
  layout inference included."""
  a = jax.ShapeDtypeStruct((300, 512), jnp.float8_e4m3fn)
  b = jax.ShapeDtypeStruct((512, 384), jnp.float8_e4m3fn)
  a_scale = jax.ShapeDtypeStruct((300, 512 // block_k), jnp.float32)
  b_scale = jax.ShapeDtypeStruct((512 // block_k, 3), jnp.float32)
  f = lambda a, b, sa, sb: jk.matmul(a, b, a_scale=sa, b_scale=sb, implementation="mosaic_gpu")
  assert "mosaic_gpu" in cuda_lowering(f, a, b, a_scale, b_scale)


def test_block_scales_choose_the_kernel_or_say_why():
  """Which kernels take a block-scaled product: mosaic_gpu for fp8 blocks a multiple of 32
  deep (to 128, then multiples of 128); the others say they scale only in their epilogue."""
  chip = hardware.DEFAULT_GPU
  f8 = jnp.dtype(jnp.float8_e4m3fn)
  problem = lambda bk: Problem(m=256, n=256, k=768, dtype=f8, out_dtype=jnp.dtype(jnp.bfloat16),
                               block_k=bk, block_n=128)
  for bk in (32, 64, 128, 256, 384):
    assert mosaic_gpu.unsupported(problem(bk), chip) is None, bk
    config = mosaic_gpu.heuristic(problem(bk), chip)
    assert mosaic_gpu.config_error(problem(bk), config, chip) is None
    assert (config.tile_m, config.tile_n, config.split, config.tile_k) == (64, 128, "m",
                                                                           min(bk, 128))
  for bk in (16, 48, 192):
    assert "block scales a multiple of 32" in mosaic_gpu.unsupported(problem(bk), chip)
  assert "epilogue only" in triton.unsupported(problem(128), chip)
  wide = mosaic_gpu.Config(tile_m=128, tile_n=128, tile_k=128, stages=2, split="m", ring=True)
  assert "two accumulators" in mosaic_gpu.config_error(problem(128), wide, chip)


@pytest.mark.parametrize("kwargs, match", [
    (dict(a_scale=jnp.ones((4, 3)), b_scale=jnp.ones((2, 16))), "disagree on K's blocks"),
    (dict(a_scale=jnp.ones((4, 3))), r"K=8 is not a whole number of the scales' 3 blocks"),
    (dict(b_scale=jnp.ones((2, 3))), r"N=16 is not a whole number of b_scale's 3 blocks"),
    (dict(a_scale=jnp.ones((4, 2, 1))), r"a_scale must have shape \(\), \(4,\) \(per row\)"),
    (dict(b_scale=jnp.ones((2, 2, 2))), r"b_scale must have shape \(\), \(16,\) \(per column\)"),
])
def test_bad_block_scales(kwargs, match):
  a, b = A.astype(jnp.float8_e4m3fn), B.astype(jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match=match):
    jk.matmul(a, b, **kwargs)


def test_quantize_blocks_and_per_tensor():
  """Each block's largest magnitude maps to the dtype's largest value (a power of two at most
  that under power_of_two); dequantized, every element is within half an fp8 ulp of its block's
  scale times its value; an all-zero block gets scale 1."""
  gen = numerics.rng("quantize")
  x = numerics.normal(gen, (2, 64, 256), jnp.float32)
  x = x.at[0, 3].multiply(1000.0).at[1, :, 7].set(0.0)  # an outlier row, a zero column
  x = x.at[1, :32, :32].set(0.0)  # an all-zero (32, 32) block
  for dtype, block, pow2 in ((jnp.float8_e4m3fn, (1, 128), False),
                             (jnp.float8_e4m3fn, (32, 32), False),
                             (jnp.float8_e5m2, (32, 1), True), (jnp.int8, None, False)):
    q, scale = jk.quantize(x, dtype=dtype, block=block, power_of_two=pow2)
    chex.assert_type(q, dtype)
    chex.assert_shape(scale, () if block is None else (2, 64 // block[0], 256 // block[1]))
    full = np.asarray(scale, np.float64) if block is None else np.repeat(np.repeat(
        np.asarray(scale, np.float64), block[0], -2), block[1], -1)
    x64, q64 = np.asarray(x, np.float64), np.asarray(q, np.float64)
    top = float(jnp.iinfo(dtype).max if dtype == jnp.int8 else jnp.finfo(dtype).max)
    assert np.abs(q64).max() <= top
    # Relative spacing of the dtype's values (int8: absolute half a unit).
    if dtype == jnp.int8:
      assert np.abs(q64 * full - x64).max() <= 0.5 * full.max() * (1 + 1e-6)
    else:
      ulp = 2.0 ** -jnp.finfo(dtype).nmant
      normal_min = float(jnp.finfo(dtype).smallest_normal)
      bound = 0.5 * ulp * np.abs(x64) + 0.5 * normal_min * ulp * full
      assert np.all(np.abs(q64 * full - x64) <= bound * (1 + 1e-6))
    if pow2:
      assert np.all(np.log2(np.asarray(scale)) == np.round(np.log2(np.asarray(scale))))
    if block == (32, 32):
      assert float(scale[1, 0, 0]) == 1.0
  with pytest.raises(ValueError, match=r"block \(3, 128\) must divide"):
    jk.quantize(x, block=(3, 128))
  with pytest.raises(TypeError, match="dtype must be one of"):
    jk.quantize(x, dtype=jnp.bfloat16)


def test_block_scales_beat_per_tensor_on_outliers():
  """What block scales are for: activation rows 1e5 times the others (past e4m3's 2^15 between
  its largest and its smallest normal value), quantized per tensor, flush the ordinary rows into
  subnormals; in 1 x 128 blocks each row keeps its 3 bits. Each product's error against the
  float64 product of the unquantized values, median over rows."""
  gen = numerics.rng("block-outliers")
  m, k, n = 128, 512, 256
  a = numerics.normal(gen, (m, k), jnp.float32).at[::16].multiply(1e5)
  b = numerics.normal(gen, (k, n), jnp.float32, k ** -0.5)
  want = np.asarray(a, np.float64) @ np.asarray(b, np.float64)

  def row_error(a_block, b_block):
    a8, sa = jk.quantize(a, block=a_block)
    b8, sb = jk.quantize(b, block=b_block)
    y = np.asarray(jk.matmul(a8, b8, a_scale=sa, b_scale=sb, out_dtype=jnp.float32), np.float64)
    return np.median(np.linalg.norm(y - want, axis=1) / np.linalg.norm(want, axis=1))

  blocks = row_error((1, 128), (128, 128))
  # e4m3's 3 mantissa bits, rounding to nearest in both operands: ~2^-4 / sqrt(3) * sqrt(2).
  assert blocks <= 0.06
  assert row_error(None, None) >= 5 * blocks
