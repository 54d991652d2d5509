"""matmul's arguments: checked (each error names the argument, what it got and what is
accepted) and normalized into its ``Args``: the operands' dtypes and shapes, the epilogue,
glu's two layouts, the precision in context, and the fp8/int8 scales."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxkernels import _activations, _checks, backend
from jaxkernels.ops.matmul.common import FLOAT8, FLOATS, INT8, is_quantized

OP = "matmul"
OPERAND_DTYPES = (*FLOATS, *FLOAT8, INT8)




def _operand(name, value, min_rank):
  if not (hasattr(value, "shape") and hasattr(value, "dtype")):
    value = jnp.asarray(value)
  if jnp.dtype(value.dtype) not in OPERAND_DTYPES:
    raise TypeError(f"{OP}: {name} has dtype {jnp.dtype(value.dtype)}; accepted: "
                    f"{', '.join(str(d) for d in OPERAND_DTYPES)}")
  if len(value.shape) < min_rank:
    raise ValueError(f"{OP}: {name} must have rank >= {min_rank}, got shape {tuple(value.shape)}")
  return value


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Args(backend.Args):
  """A product's validated arguments: a (..., K), b (K, N), or under glu (K, 2N) side by side
  or (K, 2, N) stacked; the scales as :func:`_scales` leaves them; and ``b_dtype``, which only
  the split sets (:func:`_across`): the product's operand dtype where b comes wider (float32,
  for dB summed over the row shards in float32)."""

  a: jax.Array
  b: jax.Array
  bias: jax.Array | None
  activation: str | None
  residual: jax.Array | None
  glu: bool
  out_dtype: jnp.dtype
  precision: lax.Precision | None
  a_scale: jax.Array | None
  b_scale: jax.Array | None
  b_dtype: jnp.dtype | None = None

  def public(self, **changed) -> dict:
    """The public op's arguments (every field but the split's knob), some changed: a call of
    the product again, on other operands or options."""
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
              if f.name != "b_dtype"}
    return {**fields, **changed}


def validate(a, b, *, bias, activation, residual, glu, out_dtype, precision, a_scale,
              b_scale) -> Args:
  a = _operand("a", a, 2)
  b = _operand("b", b, 2)
  if glu and b.ndim == 3:
    return _validate_stacked(a, b, bias=bias, activation=activation, residual=residual,
                             out_dtype=out_dtype, precision=precision, a_scale=a_scale,
                             b_scale=b_scale)
  if b.ndim != 2:
    raise ValueError(f"{OP}: b must be (K, N), rank 2, got shape {tuple(b.shape)}")
  if a.shape[-1] != b.shape[0]:
    raise ValueError(f"{OP}: a {tuple(a.shape)} and b {tuple(b.shape)} disagree on K: "
                     f"a's last dimension is {a.shape[-1]}, b's first is {b.shape[0]}")
  if a.dtype != b.dtype:
    raise TypeError(f"{OP}: a and b must share a dtype, got a {a.dtype} and b {b.dtype}")
  n = b.shape[1]
  if glu and n % 2:
    raise ValueError(f"{OP}: glu=True takes b as [gate | up] side by side, (K, 2N): its last "
                     f"dimension must be even, got b shape {tuple(b.shape)}")
  out_shape = (*a.shape[:-1], n // 2 if glu else n)
  if bias is not None:
    bias = _checks.vector(OP, "bias", bias, n, "b")
  if residual is not None:
    residual = _checks.same_shape(OP, "residual", residual, out_shape,
                                  "the gated output" if glu else "the output a @ b")
  if activation is not None:
    _checks.choice(OP, "activation", activation, _activations.ACTIVATIONS)
  elif glu:
    raise ValueError(f"{OP}: glu=True gates the up half with activation(gate): pass "
                     f"activation, one of {', '.join(_activations.ACTIVATIONS)} ('silu': SwiGLU)")
  quantized = is_quantized(a.dtype)
  if out_dtype is None:
    out_dtype = jnp.bfloat16 if quantized else a.dtype
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype not in FLOATS:
    raise TypeError(f"{OP}: out_dtype must be one of bfloat16, float16, float32, got {out_dtype}")
  if precision is not None and not isinstance(precision, lax.Precision):
    raise TypeError(f"{OP}: precision must be None or a jax.lax.Precision, got {precision!r}")
  scales = _scales(a, b, a_scale, b_scale, quantized)
  return Args(a=a, b=b, bias=bias, activation=activation, residual=residual, glu=glu,
              out_dtype=out_dtype, precision=_in_context(precision), **scales)


def _validate_stacked(a, b, *, bias, activation, residual, out_dtype, precision, a_scale,
                      b_scale) -> Args:
  """glu=True with b stacked (K, 2, N), bias (2, N): the side-by-side call's checks on a
  (K, 2N) b of its shape (a, K, dtypes, the residual, the activation, out_dtype), b and the
  bias as given."""
  if b.shape[1] != 2:
    raise ValueError(f"{OP}: glu=True with a rank-3 b takes it stacked, (K, 2, N): b[:, 0] the "
                     f"gate's weights, b[:, 1] up's; got b shape {tuple(b.shape)}")
  if a_scale is not None or b_scale is not None:
    raise ValueError(f"{OP}: a stacked glu b (K, 2, N) takes no a_scale or b_scale; pass b "
                     "side by side, (K, 2N), to scale fp8/int8 operands")
  k, _, n = b.shape
  if bias is not None:
    bias = _checks.array(OP, "bias", bias)
    if tuple(bias.shape) != (2, n):
      raise ValueError(f"{OP}: with a stacked glu b {tuple(b.shape)}, bias must be (2, {n}) "
                       f"(the gate's and up's), got shape {tuple(bias.shape)}")
  args = validate(a, jax.ShapeDtypeStruct((k, 2 * n), b.dtype), bias=None,
                   activation=activation, residual=residual, glu=True, out_dtype=out_dtype,
                   precision=precision, a_scale=None, b_scale=None)
  return args.replace(b=b, bias=bias)


def _scales(a, b, a_scale, b_scale, quantized) -> dict:
  """a_scale and b_scale checked: per tensor (), per row of a (a's leading shape) and per column
  of b (N,), or block scales along K: a_scale (..., M, K / bk) and b_scale (K / bk, N / bn).
  Where either is a block scale both are returned so (the other's value repeated over the
  blocks), as float32."""
  k, n = b.shape
  lead = tuple(a.shape[:-1])
  shapes = dict(a_scale=f"(), {lead} (per row) or {(*lead, 'K/bk')} (blocks of K)",
                b_scale=f"(), ({n},) (per column) or ('K/bk', 'N/bn') (blocks of b)")
  checked = {}
  for name, scale in (("a_scale", a_scale), ("b_scale", b_scale)):
    if scale is None:
      continue
    if not quantized:
      raise ValueError(f"{OP}: {name} dequantizes fp8/int8 operands; a and b are {a.dtype}")
    scale = _checks.array(OP, name, scale, min_rank=0)
    shape = tuple(scale.shape)
    if name == "a_scale":
      ok = shape in ((), lead) or (len(shape) == a.ndim and shape[:-1] == lead)
    else:
      ok = shape in ((), (n,)) or len(shape) == 2
    if not ok:
      raise ValueError(f"{OP}: {name} must have shape {shapes[name]}, got {shape}")
    checked[name] = scale
  a_blocks = "a_scale" in checked and checked["a_scale"].ndim == a.ndim
  b_blocks = "b_scale" in checked and checked["b_scale"].ndim == 2
  if not (a_blocks or b_blocks):
    return dict(a_scale=checked.get("a_scale"), b_scale=checked.get("b_scale"))
  # Block scales: K / bk blocks along K, from whichever is blocked; both must agree.
  kb = checked["a_scale"].shape[-1] if a_blocks else checked["b_scale"].shape[0]
  if a_blocks and b_blocks and checked["b_scale"].shape[0] != kb:
    raise ValueError(f"{OP}: a_scale {tuple(checked['a_scale'].shape)} and b_scale "
                     f"{tuple(checked['b_scale'].shape)} disagree on K's blocks: {kb} in "
                     f"a_scale's last dimension, {checked['b_scale'].shape[0]} in b_scale's first")
  if kb == 0 or k % kb:
    raise ValueError(f"{OP}: K={k} is not a whole number of the scales' {kb} blocks along K; "
                     "pad K with zeros to a multiple of the block (zeros add nothing)")
  nb = checked["b_scale"].shape[1] if b_blocks else 1
  if b_blocks and (nb == 0 or n % nb):
    raise ValueError(f"{OP}: N={n} is not a whole number of b_scale's {nb} blocks along N "
                     f"(b_scale {tuple(checked['b_scale'].shape)}); pad N to a multiple of the "
                     "block")
  f32 = lambda v: jnp.asarray(1 if v is None else v, jnp.float32)
  a_s = f32(checked.get("a_scale"))
  if not a_blocks:  # per tensor or per row: the same value in every block of the row
    a_s = jnp.broadcast_to(a_s[..., None] if a_s.ndim else a_s, (*lead, kb))
  b_s = f32(checked.get("b_scale"))
  if not b_blocks:  # per tensor (K / bk, 1) or per column (K / bk, N)
    b_s = jnp.broadcast_to(b_s, (kb, b_s.shape[0] if b_s.ndim else 1))
  return dict(a_scale=a_s, b_scale=b_s)


# jax.default_matmul_precision's names (the context manager, or the jax_default_matmul_precision
# flag) for the precisions that differ from DEFAULT on float32 operands.
_CONTEXT_PRECISION = {"highest": lax.Precision.HIGHEST, "float32": lax.Precision.HIGHEST,
                      "high": lax.Precision.HIGH, "tensorfloat32": lax.Precision.HIGH,
                      "bfloat16_3x": lax.Precision.HIGH}


def _in_context(precision):
  """``precision``, or where None what ``jax.default_matmul_precision`` asks at trace time, as
  XLA's own products read it (under "highest" a float32 product is float32, not tf32)."""
  if precision is not None:
    return precision
  return _CONTEXT_PRECISION.get(jax.config.jax_default_matmul_precision)
