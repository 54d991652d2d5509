"""quantize: a bfloat16/float32 array to fp8 or int8 with the scales matmul dequantizes by.

    a8, a_scale = jk.quantize(a, block=(1, 128))     # DeepSeek-V3's activations
    b8, b_scale = jk.quantize(b, block=(128, 128))   # and weights
    y = jk.matmul(a8, b8, a_scale=a_scale, b_scale=b_scale)

The scales have one entry a block of the last two dimensions: ``x`` (..., R, C) in blocks of
(br, bc) gives a scale (..., R / br, C / bc), the shapes ``matmul`` reads block sizes off
(a_scale (M, K / bk), b_scale (K / bk, N / bn)). MXFP8 is ``block=(1, 32)`` for A and
``(32, 1)`` for B with ``power_of_two=True`` (its scales are E8M0, powers of two).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxkernels import _checks

OP = "quantize"
DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2), jnp.dtype(jnp.int8))


def largest(dtype) -> float:
  """The largest finite value of ``dtype`` (448 for e4m3, 57344 for e5m2, 127 for int8)."""
  dtype = jnp.dtype(dtype)
  return float(jnp.iinfo(dtype).max if dtype == jnp.int8 else jnp.finfo(dtype).max)


def quantize(x, *, dtype=jnp.float8_e4m3fn, block=None, power_of_two=False):
  """(q, scale) with x ~= q * scale, scale repeated over each block.

  Args:
    x: a floating array of rank >= 2 (rank >= 0 with ``block=None``).
    dtype: float8_e4m3fn (default), float8_e5m2 or int8.
    block: None (one scale for the whole array, shape ()), or (br, bc): one scale for each
      br x bc block of the last two dimensions, which they must divide.
    power_of_two: round each scale up to a power of two (MX formats' E8M0 scales): the
      largest element of a block then maps at most to the dtype's largest value.

  Each scale is its block's largest magnitude over the dtype's largest value (1 for an all-zero
  block, float32's least normal at the smallest), float32; q is x / scale rounded to nearest (int8: rounded, then clipped to +-127).

  ``q.astype(jnp.float32)`` in the same jitted program may not be fp8's values on a GPU: XLA
  drops an f32 -> fp8 -> f32 round trip there as excess precision (its flag
  ``--xla_allow_excess_precision``, on by default). ``matmul``'s kernels read q itself; its
  XLA path dequantizes in float32 and so may take x's own values where quantize ran in the same
  program (``fp8_matmul`` keeps its fp8 copies behind a barrier). To see fp8's rounding,
  dequantize outside the program that quantized.
  """
  x = _checks.array(OP, "x", x, min_rank=0 if block is None else 2)
  dtype = jnp.dtype(dtype)
  if dtype not in DTYPES:
    raise TypeError(f"{OP}: dtype must be one of {', '.join(map(str, DTYPES))}, got {dtype}")
  x32 = x.astype(jnp.float32)
  if block is None:
    amax = jnp.max(jnp.abs(x32))
    scale = _scale(amax, dtype, power_of_two)
    return _cast(x32 / scale, dtype), scale
  if not (isinstance(block, (tuple, list)) and len(block) == 2
          and all(isinstance(b, int) and b > 0 for b in block)):
    raise ValueError(f"{OP}: block must be None or (rows, columns) of positive ints, got "
                     f"{block!r}")
  *lead, rows, cols = x.shape
  br, bc = block
  if rows % br or cols % bc:
    raise ValueError(f"{OP}: block {tuple(block)} must divide x's last two dimensions "
                     f"({rows}, {cols})")
  blocks = x32.reshape(*lead, rows // br, br, cols // bc, bc)
  amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
  scale = _scale(amax, dtype, power_of_two)
  q = _cast(blocks / scale[..., :, None, :, None], dtype).reshape(x.shape)
  return q, scale


def _scale(amax, dtype, power_of_two):
  # A block of float32 subnormals has amax / largest below float32's least normal, which
  # flushes to zero on a GPU and in XLA:CPU (then 0/0 = NaN): the least normal scale instead,
  # under which those values still land on the fp8 grid (a backward's tiny gradient rows).
  scale = jnp.where(amax > 0, jnp.maximum(amax / largest(dtype), jnp.finfo(jnp.float32).tiny),
                    1.0)
  if power_of_two:  # the least power of two >= scale, exactly (exp2 of a float may not be)
    mantissa, exponent = jnp.frexp(scale)
    scale = jnp.ldexp(jnp.float32(1), exponent - (mantissa == 0.5))
  return scale.astype(jnp.float32)


def _cast(scaled, dtype):
  top = largest(dtype)
  if dtype == jnp.int8:
    scaled = jnp.round(scaled)
  return jnp.clip(scaled, -top, top).astype(dtype)
