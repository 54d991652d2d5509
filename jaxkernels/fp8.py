"""fp8_matmul: a training product in fp8, forward and backward, by DeepSeek-V3's recipe.

    y = jk.fp8_matmul(x, w)          # x (..., M, K) bfloat16, w (K, N); y in x's dtype

Every operand of the three products is float8_e4m3fn with block scales, each block's largest
magnitude mapped to e4m3's largest (448), and every product accumulates in float32
(``matmul``'s block-scaled path: on Hopper the Mosaic GPU kernel promotes each 128-deep
partial sum into float32 with its scales; elsewhere the reference):

==========  ====================  =====================  ==========================
product     A                     B                      scales (A, B)
==========  ====================  =====================  ==========================
y = x w     x, 1 x 128 along K    w, 128 x 128           (M, K/128), (K/128, N/128)
dx = dy wᵀ  dy, 1 x 128 along N   wᵀ: w's, transposed    (M, N/128), (N/128, K/128)
dw = xᵀ dy  xᵀ, 1 x 128 along M   dy, 128 x 128          (K, M/128), (M/128, N/128)
==========  ====================  =====================  ==========================

Fine blocks keep an outlier from flushing its neighbours to zero (a per-tensor scale loses
rows 1e5x smaller than the largest entirely: notes/report.md fp8-blocks). The forward keeps
for the backward the fp8 copies it needs (xᵀ and w quantized, 1 byte an element where the
bfloat16 product keeps x at 2), and w's quantization serves both the forward and dx.

K and N must be multiples of 128 (the blocks); M is padded to one with zero rows where it is
not (they add nothing to dw). The gradients come out in x's and w's dtypes.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxkernels import _checks, backend, partitioning
from jaxkernels.ops.matmul.api import matmul
from jaxkernels.quantize import quantize

OP = "fp8_matmul"
BLOCK = 128
E4M3 = jnp.float8_e4m3fn


def fp8_matmul(x, w, *, implementation: str | None = None):
  """x @ w with x, w and the gradients quantized to fp8 e4m3 in blocks (module docstring).

  Args:
    x: (..., M, K), bfloat16, float16 or float32. Leading dimensions fold into M.
    w: (K, N), floating; K and N multiples of 128.
    implementation: ``matmul``'s, for the three products (None: the device's best).

  Returns (..., M, N) in x's dtype. Differentiable in x and w (reverse mode).
  """
  x = _checks.array(OP, "x", x, min_rank=2)
  w = _checks.array(OP, "w", w, min_rank=2)
  if w.ndim != 2:
    raise ValueError(f"{OP}: w must be (K, N), got shape {tuple(w.shape)}")
  k, n = w.shape
  if x.shape[-1] != k:
    raise ValueError(f"{OP}: x's last dimension {x.shape[-1]} must equal w's first (K), got "
                     f"x {tuple(x.shape)} and w {tuple(w.shape)}")
  for name, size in (("K", k), ("N", n)):
    if size % BLOCK:
      raise ValueError(f"{OP}: {name}={size} must be a multiple of {BLOCK} (the scales' "
                       f"blocks); w has shape {tuple(w.shape)}")
  if backend.forward_mode():
    raise ValueError(
        f"{OP}: forward-mode differentiation (jax.jvp, jax.jacfwd, jax.hessian) is not defined: "
        "its gradient is a training rule on quantized operands (a custom_vjp, on every "
        "backend), not the derivative of its forward; differentiate it with jax.grad, or use "
        "jk.matmul where forward mode is needed")
  x, w = _whole("x", x), _whole("w", w)
  lead = x.shape[:-1]
  m = math.prod(lead)
  x2 = x.reshape(m, k)
  pad = -m % BLOCK
  if pad:
    x2 = jnp.pad(x2, ((0, pad), (0, 0)))
  y = _product(implementation, x2, w)
  return (y[:m] if pad else y).reshape(*lead, n)


def _whole(name, a):
  """``a`` unsplit where its type lays it out on a mesh of Explicit axes (the blocks'
  reshapes cannot say how a split would carry over). Free on a mesh of size-1 axes (the train
  CLI's on one device); where an axis of more than one device splits it, a gather, warned."""
  placed = partitioning.layout(a)
  if placed is None or all(e is None for e in placed[1]):
    return a
  mesh, spec = placed
  sizes = dict(mesh.shape)
  split = [axis for e in spec for axis in partitioning.axes(e) if sizes[axis] > 1]
  if split:
    warnings.warn(partitioning.ShardingWarning(
        f"{OP}: {name} {tuple(a.shape)} is split over mesh axes {split}; fp8_matmul runs "
        "unsplit, so it is gathered whole on every device"), stacklevel=3)
  return jax.sharding.reshard(a, P())


def _quantized(x, block):
  """(q, scale) of ``x`` in blocks, computed in x's own layout and materialized there: where a
  transpose follows (the copies for dw), XLA otherwise fuses it into the blocks' reductions and
  reads x across its rows (350 GB/s on an H200, notes/model.md train-step-1); transposing the
  fp8 result and the small scale after costs a byte an element."""
  return jax.lax.optimization_barrier(quantize(x, dtype=E4M3, block=block))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _product(implementation, x, w):
  return _forward(implementation, x, w)[0]


def _forward(implementation, x, w):
  qx, sx = _quantized(x, (1, BLOCK))
  qw, sw = _quantized(w, (BLOCK, BLOCK))
  y = matmul(qx, qw, a_scale=sx, b_scale=sw, out_dtype=x.dtype, implementation=implementation)
  qxc, sxc = _quantized(x, (BLOCK, 1))  # for dw: x in blocks along M, then transposed
  qxt, sxt = qxc.T, sxc.T
  # Kept as their bits: under jax.checkpoint, JAX rounds every floating residual with
  # reduce_precision(exponent_bits=4, mantissa_bits=3) for e4m3fn, which XLA reads as the IEEE
  # format (largest 240, with infinities): entries in (240, 448] come back NaN (jax 0.10.2).
  bits = lambda q: jax.lax.bitcast_convert_type(q, jnp.uint8)
  return y, (bits(qxt), sxt, bits(qw), sw, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _backward(implementation, saved, dy):
  qxt, sxt, qw, sw, x_like, w_like = saved
  qxt, qw = (jax.lax.bitcast_convert_type(q, E4M3) for q in (qxt, qw))
  qdy, sdy = _quantized(dy, (1, BLOCK))
  dx = matmul(qdy, qw.T, a_scale=sdy, b_scale=sw.T, out_dtype=x_like.dtype,
              implementation=implementation)
  qdy_blocks, sdy_blocks = _quantized(dy, (BLOCK, BLOCK))  # (matmul transposes an fp8 B)
  dw = matmul(qxt, qdy_blocks, a_scale=sxt, b_scale=sdy_blocks, out_dtype=w_like.dtype,
              implementation=implementation)
  return dx, dw


_product.defvjp(_forward, _backward)
