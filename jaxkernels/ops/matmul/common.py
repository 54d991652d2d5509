"""What every matmul kernel shares: the problem's shape, its fused epilogue, and dtype rules."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxkernels import _activations, roofline
from jaxkernels._tiling import bucket

FLOAT8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
INT8 = jnp.dtype(jnp.int8)
FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# Activations whose derivative needs the pre-activation z (relu's comes from y itself).
NEEDS_PREACTIVATION = ("gelu", "gelu_tanh", "silu")


def is_quantized(dtype) -> bool:
  return jnp.dtype(dtype) in FLOAT8 or jnp.dtype(dtype) == INT8


@dataclasses.dataclass(frozen=True)
class Problem:
  """C (m, n) = op(A) (m, k) @ op(B) (k, n); op transposes what is stored transposed.

  A is stored (m, k), or (k, m) when ``trans_a``; B (k, n), or (n, k) when ``trans_b``.

  ``glu``: B holds a gate's and an up projection's weights side by side, [gate | up], n/2
  columns each; the output is y = activation(gate) * up, (m, n/2), and z (with
  ``save_preactivation``) the whole (m, n) product.
  """

  m: int
  n: int
  k: int
  dtype: Any  # operands'
  out_dtype: Any
  trans_a: bool = False
  trans_b: bool = False
  activation: str | None = None
  has_bias: bool = False
  has_residual: bool = False
  has_scales: bool = False  # a_scale (m,) and b_scale (n,), float32, in the epilogue
  # Block scales along K (``block_k`` deep): each block's partial product is scaled as it is
  # added to the accumulator, by a_scale (m, k / block_k) and b_scale (k / block_k, n / bn).
  # 0: none (has_scales is then the per-row / per-column form, or no scales).
  block_k: int = 0
  block_n: int = 0  # with block_k: the columns of b each b_scale entry covers (bn)
  save_preactivation: bool = False  # also return z = scale * (a @ b) + bias
  precision: Any = None
  glu: bool = False

  @property
  def outputs(self) -> int:
    return 2 if self.save_preactivation else 1

  @property
  def out_n(self) -> int:
    """y's columns: n, or n/2 where the epilogue gates one half with the other."""
    return self.n // 2 if self.glu else self.n

  def key(self) -> str:
    """The tuning tables' key: dtypes, layout, epilogue and shape bucket. Problems with an
    activation are tuned apart from plain and bias/residual-only ones: the epilogue's
    arithmetic is part of what a config is timed on."""
    layout = ("t" if self.trans_a else "n") + ("t" if self.trans_b else "n")
    epilogue = "glu" if self.glu else "act" if self.activation else "plain"
    dims = "x".join(str(bucket(d)) for d in (self.m, self.n, self.k))
    blocks = [f"bk{self.block_k}bn{self.block_n}"] if self.block_k else []
    return "|".join([f"{jnp.dtype(self.dtype)}->{jnp.dtype(self.out_dtype)}", layout, epilogue,
                     *blocks, dims])

  def reason(self) -> str | None:
    """Why no kernel can take the problem: every kernel says for itself (``unsupported``)."""
    return None

  def __str__(self) -> str:
    return f"{self.m}x{self.k} @ {self.k}x{self.n} {jnp.dtype(self.dtype).name}"


def epilogue(acc, *, problem: Problem, bias=None, residual=None, a_scale=None, b_scale=None,
             math: _activations.Math = _activations.EXACT):
  """(y, z) from a float32 tile: z = scale * acc + bias; y = act(z) + residual.

  The operands are float32 tiles already broadcastable to acc (bias (1, n), scales (m, 1) and
  (1, n), residual (m, n)). ``math`` is the kernel's arithmetic for the activation.
  """
  z = acc
  if problem.has_scales:
    z = z * a_scale * b_scale
  if problem.has_bias:
    z = z + bias
  y = z if problem.activation is None else _activations.apply(problem.activation, z, math)
  if problem.has_residual:
    y = y + residual
  return y, z


def split_refs(problem: Problem, refs):
  """A kernel's refs as (a, b, bias, residual, a_scale, b_scale, y, z).

  Every wrapper passes its operands in this order, each optional one only when the problem
  has it: a, b, [bias], [residual], [a_scale, b_scale]; then the outputs y, [z]. The scales
  are the epilogue's (``has_scales``) or the main loop's block scales (``block_k``).
  """
  a, b, *refs = refs
  bias = refs.pop(0) if problem.has_bias else None
  residual = refs.pop(0) if problem.has_residual else None
  scaled = problem.has_scales or problem.block_k
  a_scale, b_scale = (refs.pop(0), refs.pop(0)) if scaled else (None, None)
  y, *z = refs
  return a, b, bias, residual, a_scale, b_scale, y, (z[0] if z else None)


def cost(problem: Problem, *epilogue_operands) -> roofline.Cost:
  """FLOPs and fewest bytes of the product, its epilogue's reads and its outputs."""
  p = problem
  return roofline.matmul(p.m, p.n, p.k, in_itemsize=jnp.dtype(p.dtype).itemsize,
                         out_itemsize=jnp.dtype(p.out_dtype).itemsize,
                         epilogue_reads=roofline.nbytes(*epilogue_operands),
                         activation=p.activation, extra_outputs=p.outputs - 1)
