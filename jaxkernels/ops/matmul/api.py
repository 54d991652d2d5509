"""matmul: validation, dispatch, the custom_vjp boundary, and the backward on transposed operands."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxkernels import _activations, _checks, backend, partitioning, remat
from jaxkernels.ops.elementwise import api as elementwise
from jaxkernels.ops.matmul import mosaic_gpu, mosaic_tpu, reference, triton
from jaxkernels.ops.matmul.common import (FLOAT8, FLOATS, INT8, NEEDS_PREACTIVATION, Problem,
                                          is_quantized)
from jaxkernels.partitioning import Free

OP = "matmul"
OPERAND_DTYPES = (*FLOATS, *FLOAT8, INT8)




def _run(plan: backend.Plan, problem: Problem, *operands, forward: bool = False,
         **epilogue_operands):
  """The product ``problem`` on the plan's kernel, with its own config: the caller's for the
  forward (whether it saves the pre-activation or not), else the tuned table's or the
  heuristic's for this very problem (the backward's two products are problems of their own,
  and saving z takes shared memory that the plain forward's config may have spent)."""
  config = plan.config if forward and plan.explicit else plan.config_for(problem)
  return plan.run(plan.kernels.forward, *operands, problem=problem, config=config,
                  **epilogue_operands)


def _saves_preactivation(p: Problem) -> bool:
  """The backward needs z unless there is no activation, or relu's mask can be read off y."""
  if p.activation is None:
    return False
  return p.activation in NEEDS_PREACTIVATION or p.has_residual


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _differentiable(plan, p, a, b, bias, residual):
  return _run(plan, p, a, b.astype(p.dtype), bias=bias, residual=residual, forward=True)


def _differentiable_fwd(plan, p, a, b, bias, residual):
  # b may come wider than the product (float32 for a bfloat16 product, from the data-parallel
  # rule in _across): the product reads it rounded, and dB comes back in b's own dtype (an
  # empty array carries that dtype to the backward, whose residuals are arrays).
  grad_b_dtype = jnp.dtype(b.dtype)
  b = b.astype(p.dtype)
  y, saved = _forward_saving(plan, p, a, b, bias, residual)
  return y, (saved, jnp.zeros((0,), grad_b_dtype))


def _forward_saving(plan, p, a, b, bias, residual):
  if _saves_preactivation(p):
    y, z = _run(plan, dataclasses.replace(p, save_preactivation=True), a, b, bias=bias,
                residual=residual, forward=True)
    return checkpoint_name(y, remat.MATMUL_OUT), (a, b, bias, residual, z)
  # Named, as XLA's dot_general is by its primitive, for the "dots" policies to keep.
  y = checkpoint_name(_run(plan, p, a, b, bias=bias, residual=residual, forward=True),
                      remat.MATMUL_OUT)
  return y, (a, b, bias, residual, y if p.activation == "relu" else None)


def _grad_products(plan, p, a, b, dz, db_dtype=None):
  """(dA, dB) of the product ``p`` for dZ, on the plan's kernels; dB in ``db_dtype`` (default
  b's)."""
  base = dict(activation=None, has_bias=False, has_residual=False, has_scales=False,
              save_preactivation=False, precision=p.precision, glu=False)
  # dA (m, k) = dZ (m, n) @ B^T, B stored (k, n): the kernel reads it transposed in place.
  da = _run(plan, dataclasses.replace(p, m=p.m, n=p.k, k=p.n, trans_a=False, trans_b=True,
                                      out_dtype=a.dtype, **base), dz, b)
  # dB (k, n) = A^T @ dZ, A stored (m, k).
  db = _run(plan, dataclasses.replace(p, m=p.k, n=p.n, k=p.m, trans_a=True, trans_b=False,
                                      out_dtype=db_dtype or b.dtype, **base), a, dz)
  return da, db


def _differentiable_bwd(plan, p, saved, dy):
  (a, b, bias, residual, z), grad_b = saved
  # dz = dy * act'(z): one elementwise pass (XLA fuses it with d(bias)'s row sum). The Mosaic GPU
  # kernel feeds the tensor cores from shared memory, so there is no register stage to apply it
  # on the way in; one pass over M x N costs ~3% of the two products at 8192^2.
  dz = dy.astype(jnp.float32)
  if p.activation is not None:
    dz = dz * _activations.value_and_grad(p.activation, z.astype(jnp.float32))[1]
  dbias = None if bias is None else jnp.sum(dz, axis=0).astype(bias.dtype)
  dres = None if residual is None else dy.astype(residual.dtype)
  return (*_grad_products(plan, p, a, b, dz.astype(a.dtype), grad_b.dtype), dbias, dres)


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gated(plan, p, a, b):
  return _run(plan, p, a, b, forward=True)


def _gated_fwd(plan, p, a, b):
  y, z = _run(plan, dataclasses.replace(p, save_preactivation=True), a, b, forward=True)
  # Both are the product's outputs: the "dots" policies keep y (the next matmul's input) and
  # z (glu's backward reads it), so that neither recomputes the product.
  return checkpoint_name(y, remat.MATMUL_OUT), (a, b, checkpoint_name(z, remat.MATMUL_OUT))


def _gated_bwd(plan, p, saved, dy):
  a, b, z = saved
  # glu's GPU kernel (the Mosaic GPU matmul's companion, as in the composed path on a GPU).
  dz = elementwise.packed_glu_grad(z, dy, activation=p.activation, implementation="triton")
  return _grad_products(plan, p, a, b, dz)


_gated.defvjp(_gated_fwd, _gated_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _quantized(plan, p, a, b, a_scale, b_scale, bias, residual):
  return _run(plan, p, a, b, a_scale=a_scale, b_scale=b_scale, bias=bias, residual=residual,
              forward=True)


def _quantized_fwd(plan, p, *operands):
  return _quantized(plan, p, *operands), None


def _quantized_bwd(plan, p, saved, dy):
  raise TypeError(
      f"{OP}: no gradient through a {jnp.dtype(p.dtype)} matmul; differentiate a "
      "bfloat16/float32 matmul and quantize its operands outside the differentiated function")


_quantized.defvjp(_quantized_fwd, _quantized_bwd)


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #


def _operand(name, value, min_rank):
  if not (hasattr(value, "shape") and hasattr(value, "dtype")):
    value = jnp.asarray(value)
  if jnp.dtype(value.dtype) not in OPERAND_DTYPES:
    raise TypeError(f"{OP}: {name} has dtype {jnp.dtype(value.dtype)}; accepted: "
                    f"{', '.join(str(d) for d in OPERAND_DTYPES)}")
  if len(value.shape) < min_rank:
    raise ValueError(f"{OP}: {name} must have rank >= {min_rank}, got shape {tuple(value.shape)}")
  return value


def _validate(a, b, *, bias, activation, residual, glu, out_dtype, precision, a_scale,
              b_scale):
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
  # b_dtype: the product's operand dtype where b comes wider (set only by _across).
  return dict(a=a, b=b, bias=bias, activation=activation, residual=residual, glu=glu,
              out_dtype=out_dtype, precision=_in_context(precision), **scales, b_dtype=None)


def _validate_stacked(a, b, *, bias, activation, residual, out_dtype, precision, a_scale,
                      b_scale):
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
  args = _validate(a, jax.ShapeDtypeStruct((k, 2 * n), b.dtype), bias=None,
                   activation=activation, residual=residual, glu=True, out_dtype=out_dtype,
                   precision=precision, a_scale=None, b_scale=None)
  return {**args, "b": b, "bias": bias}


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


def _problem(a, b, bias, activation, residual, out_dtype, precision, b_scale=None, **unused):
  """The product as its kernels see it (the plain product under glu: see _compose)."""
  blocked = reference.is_blocked(None, b_scale)
  return Problem(m=math.prod(a.shape[:-1]), n=b.shape[1], k=b.shape[0], dtype=jnp.dtype(a.dtype),
                 out_dtype=out_dtype, activation=activation, has_bias=bias is not None,
                 has_residual=residual is not None,
                 has_scales=is_quantized(a.dtype) and not blocked,
                 block_k=b.shape[0] // b_scale.shape[0] if blocked else 0,
                 block_n=b.shape[1] // b_scale.shape[1] if blocked else 0, precision=precision)


def matmul(a, b, *, bias=None, activation=None, residual=None, glu=False, out_dtype=None,
           precision=None, a_scale=None, b_scale=None, implementation=None, config=None):
  """y = activation(a @ b + bias) + residual, with the epilogue fused: C is written once.

  Args:
    a: (..., M, K). Leading dimensions fold into M.
    b: (K, N), a's dtype.
    bias: (N,) or None, added in float32 before the activation.
    activation: None, "gelu" (exact), "gelu_tanh", "silu" or "relu".
    residual: (..., M, N) or None, added after the activation (a residual stream).
    glu: b holds a gate's and an up projection's weights side by side, [gate | up] (K, 2N),
      or stacked, (K, 2, N) with b[:, 0] the gate's and b[:, 1] up's (bias then (2, N));
      y = activation(a @ gate + bias[:N]) * (a @ up + bias[N:]) + residual is (..., M, N):
      a gated MLP's first half (SwiGLU with "silu"), activation required. On mosaic_gpu, for
      a plain 16-bit product with N a multiple of 64 and nothing sharded, one kernel computes
      each tile's gate and up blocks side by side and writes y (and, for the gradient, z =
      a @ b) from its accumulators; otherwise the product and then ``glu``, on the same
      implementation where it has a glu kernel. Stacked, b splits over N (a column-parallel
      product, tensor parallelism): each shard's (K, 2, N / shards) is its own [gate | up],
      served whole by that shard's kernel, where side by side a split over 2N would part
      each gate column from its up column (so that split is gathered, warned).
    out_dtype: the result's dtype; default a's dtype, bfloat16 for fp8/int8 operands.
    precision: None or a jax.lax.Precision, for float32 operands: DEFAULT (and None) lets the
      GPU kernels use tf32 tensor cores as XLA does; HIGHEST asks for full float32.
    a_scale, b_scale: fp8/int8 only: dequantization scales, () per tensor, or a's leading
      shape (per row of a) and (N,) (per column of b); y = act(a_scale * b_scale * (a @ b) + ...).
      Or block scales along K, applied to each block's partial product in the main loop:
      a_scale (..., M, K/bk) and b_scale (K/bk, N/bn), the block sizes read off their shapes
      (K and N whole numbers of blocks): bk=32, bn=1 is MXFP8's 1x32; bk=128 with bn=128
      DeepSeek-V3's 1x128 activations and 128x128 weights. Where only one is blocked the
      other (per tensor, row or column) is repeated over the blocks. On mosaic_gpu (Hopper)
      for fp8 with bk a multiple of 32 (bk over 128: a multiple of 128); elsewhere the
      reference's float32 product of the dequantized operands.
    implementation: None (best available), "xla", "triton", "mosaic_gpu" or "mosaic_tpu".
    config: the chosen kernel's Config; None takes the tuned table, else a heuristic.

  Operand dtypes each backend serves (accumulation is float32; int32 for int8):

  ============  ===========================================================
  xla           bfloat16, float16, float32, float8 e4m3/e5m2, int8
  triton        bfloat16, float16, float32 (tf32 unless HIGHEST), fp8 (sm89+)
  mosaic_gpu    bfloat16, float16, fp8 e4m3/e5m2 (Hopper)
  mosaic_tpu    bfloat16, float32, int8 (v5e, v6e; not v4/v5p's int8 path)
  ============  ===========================================================

  Gradients (bfloat16/float16/float32 operands): dA = dZ B^T and dB = A^T dZ run on the same
  kernels reading B and A transposed in place, where dZ = dy * act'(z) comes from one fused pass
  over the saved pre-activation z (glu's backward under glu). fp8/int8 matmuls are not
  differentiable.
  """
  return backend.call(_OP, implementation, config, a=a, b=b, bias=bias, activation=activation,
                      residual=residual, glu=glu, out_dtype=out_dtype, precision=precision,
                      a_scale=a_scale, b_scale=b_scale)


def _kernel(plan, a, b, *, bias, activation, residual, glu, out_dtype, precision, a_scale,
            b_scale, b_dtype):
  """The validated product on one device (or one shard). ``b_dtype``: the product's operand
  dtype where b comes wider (float32, for dB in float32: see _across)."""
  b_wide, b = b, (b if b_dtype is None else b.astype(b_dtype))
  problem = _problem(a, b, bias, activation, residual, out_dtype, precision, b_scale=b_scale)
  out_shape = (*a.shape[:-1], problem.n)
  a2 = a.reshape(problem.m, problem.k)
  r2 = None if residual is None else residual.reshape(problem.m, problem.n)
  if problem.block_k:  # block scales: a_scale (..., M, K/bk) -> (M, K/bk)
    return _quantized(plan, problem, a2, b, a_scale.reshape(problem.m, -1), b_scale, bias,
                      r2).reshape(out_shape)
  if not problem.has_scales:
    return _differentiable(plan, problem, a2, b_wide, bias, r2).reshape(out_shape)
  as2 = jnp.broadcast_to(jnp.float32(1) if a_scale is None else a_scale.astype(jnp.float32),
                         a.shape[:-1]).reshape(problem.m)
  bs2 = jnp.broadcast_to(jnp.float32(1) if b_scale is None else b_scale.astype(jnp.float32),
                         (problem.n,))
  return _quantized(plan, problem, a2, b, as2, bs2, bias, r2).reshape(out_shape)


def _reference(a, b, *, bias, activation, residual, glu, out_dtype, precision, a_scale,
               b_scale, b_dtype):
  del glu  # composed before (_compose)
  return reference.matmul(a, b if b_dtype is None else b.astype(b_dtype), bias=bias,
                          activation=activation, residual=residual, a_scale=a_scale,
                          b_scale=b_scale, out_dtype=out_dtype, precision=precision)


def _compose(implementation, config, *, a, b, bias, activation, residual, glu, out_dtype,
             precision, a_scale, b_scale, b_dtype):
  """matmul(glu=True): the fused Mosaic GPU kernel where the plain product would run on
  mosaic_gpu and the kernel takes the gated one (``mosaic_gpu.unsupported``) with nothing
  split; else the product (any kernel, any sharding) and then ``glu`` on its [gate | up].
  None (not composed) without glu."""
  if not glu:
    return None
  if b.ndim == 3:
    return _stacked(implementation, config, a=a, b=b, bias=bias, activation=activation,
                    residual=residual, out_dtype=out_dtype, precision=precision)
  arrays = (a, b, bias, residual, a_scale, b_scale)
  target = backend.target_of(*arrays)
  plain = _problem(a, b, bias, activation, residual, out_dtype, precision, b_scale=b_scale)
  gated = dataclasses.replace(plain, glu=True)
  if (not any(partitioning.layout(x) for x in arrays if x is not None)
      and partitioning.auto_mesh() is None
      and backend.choice(implementation, target,
                         backend.kernel_reasons(plain, target, _OP.kernels)) == "mosaic_gpu"
      and backend.kernel_reasons(gated, target, _OP.kernels)["mosaic_gpu"] is None):
    plan = backend.plan(OP, "mosaic_gpu", target, gated, _OP.kernels, config,
                        empty=0 in (gated.m, gated.n, gated.k))
    if plan is not None:
      out = _gated(plan, gated, a.reshape(gated.m, gated.k), b)
      return out.reshape(*a.shape[:-1], gated.out_n)
  z = matmul(a, b, bias=bias, out_dtype=out_dtype, precision=precision, a_scale=a_scale,
             b_scale=b_scale, implementation=implementation, config=config)
  y = elementwise.glu(z, activation=activation,
                      implementation=None if implementation == "mosaic_gpu" else implementation)
  return y if residual is None else _add(y, residual)


def _stacked(implementation, config, *, a, b, bias, activation, residual, out_dtype,
             precision):
  """glu=True with b stacked (K, 2, N), where nothing is split (else None: the rule splits
  it, :func:`_across`): the side-by-side call on b reshaped in place to (K, 2N); on
  implementation="xla", plain JAX's products of the gate and up halves (its partitioner
  splits them)."""
  if implementation == "xla":
    z = reference.stacked(a, b, bias=bias, out_dtype=out_dtype, precision=precision)
    y = elementwise.glu(z[..., 0, :], z[..., 1, :], activation=activation, implementation="xla")
    return y if residual is None else _add(y, residual)
  if (any(partitioning.layout(x) for x in (a, b, bias, residual) if x is not None)
      or partitioning.auto_mesh() is not None):
    return None
  return matmul(a, b.reshape(b.shape[0], -1), bias=None if bias is None else bias.reshape(-1),
                activation=activation, residual=residual, glu=True, out_dtype=out_dtype,
                precision=precision, implementation=implementation, config=config)


def _add(y, residual):
  """glu's output plus the residual, added in float32 (y is in out_dtype already)."""
  return (y.astype(jnp.float32) + residual.astype(jnp.float32)).astype(y.dtype)


def _stacked_across(where, rule, *, a, b, bias, activation, residual, out_dtype, precision,
                    implementation, config):
  """glu=True with b stacked (K, 2, N), split: on each shard the side-by-side call on its own
  [gate | up], b reshaped in place to (K, 2N / shards). Rows split freely; N splits
  column-parallel, each shard gating its own columns (tensor parallelism's first MLP product:
  nothing gathered); K splits row-parallel, the partial products summed (float32) before the
  gate, which needs the whole sum."""
  arrays = dict(a=a, b=b, bias=bias, residual=residual)
  k_axes = where.axes("k")

  def local(a, b, bias, residual, b_dtype=None):
    b = b.reshape(b.shape[0], -1).astype(b_dtype or b.dtype)
    bias = None if bias is None else bias.reshape(-1)
    if not k_axes:
      return matmul(a, b, bias=bias, activation=activation, residual=residual, glu=True,
                    out_dtype=out_dtype, precision=precision, implementation=implementation,
                    config=config)
    z = partitioning.psum_out(matmul(a, b, out_dtype=jnp.float32, precision=precision,
                                     implementation=implementation, config=config), k_axes)
    z = reference.epilogue(z, bias=bias).astype(out_dtype)
    y = elementwise.glu(z, activation=activation,
                        implementation=None if implementation == "mosaic_gpu" else implementation)
    return y if residual is None else _add(y, residual)

  rows = [d.group for d in rule["a"][:-1]]
  if where.size(*rows) > 1 and jnp.dtype(b.dtype).itemsize < 4:
    # dB summed over the row shards in float32, rounded once (as the plain product's rule).
    arrays["b"] = b.astype(jnp.float32)
    return where.run(lambda **shards: local(**shards, b_dtype=b.dtype), arrays, rule,
                     rule["residual"], wire={"b": b.dtype})
  return where.run(local, arrays, rule, rule["residual"])


def _across(where, rule, local, *, a, b, bias, activation, residual, glu, out_dtype, precision,
            a_scale, b_scale, b_dtype):
  """The matmul on split operands (``partitioning``). The rule (:func:`_rule`):

  * A's rows split freely (data parallel): each shard multiplies its rows by all of B.
  * B split over N gives a column-parallel product: each shard writes its columns; the bias,
    b_scale and the residual split with them.
  * A and B split over K give a row-parallel product: each shard multiplies its K slice
    without the epilogue (float32 out), the partial sums are added across K's mesh axes
    (psum), and the epilogue (scales, bias, activation, residual) runs after the sum. A's K
    split decides; B, a weight, is sliced to match (a local slice, no gather), and so is A
    where only B's K is split.
  * A mesh axis cannot split both A's rows (or K) and B's N, nor both A's rows and B's K: B is
    gathered along it, with the one-time ShardingWarning (an error for an explicit kernel).
  The backward partitions with it: shard_map's transpose adds dB over the row shards and
  d(bias) over the rows, and the row-parallel product's psum transposes to a broadcast.
  """
  if glu and b.ndim == 3:
    return _stacked_across(where, rule, a=a, b=b, bias=bias, activation=activation,
                           residual=residual, out_dtype=out_dtype, precision=precision,
                           implementation=local.implementation, config=local.config)
  arrays = dict(a=a, b=b, bias=bias, residual=residual, a_scale=a_scale, b_scale=b_scale)
  rows = [d.group for d in rule["a"][:-1]]
  k = where.axes("k")
  out = rule["residual"]
  if not k:
    summed = where.size(*rows) > 1  # a 1x1 mesh sums nothing
    if not summed or is_quantized(a.dtype) or jnp.dtype(b.dtype).itemsize >= 4:
      return where.run(local, arrays, rule, out)
    # Data parallel: every row shard adds its dB into B's one gradient (shard_map's transpose
    # sums over the row axes). B enters float32, so each shard's dB is written in float32,
    # summed in float32 and rounded to B's dtype once, outside: summed in bfloat16, dB was
    # 6.1e-3 off on 2 GPUs (a rounding at each shard, another at the sum).
    arrays["b"] = b.astype(jnp.float32)
    return where.run(lambda **shards: local(**shards, b_dtype=b.dtype), arrays, rule, out,
                     wire={"b": b.dtype})

  blocked = reference.is_blocked(a_scale, b_scale)

  def row_parallel(a, b, bias, residual, a_scale, b_scale):
    # Block scales go with their K slice into the shard's product; the others after the sum.
    scales = (dict(a_scale=a_scale, b_scale=b_scale) if blocked
              else dict(a_scale=None, b_scale=None))
    partial = local(a=a, b=b, bias=None, activation=None, residual=None, out_dtype=jnp.float32,
                    **scales)
    z = partitioning.psum_out(partial, k)
    after = {} if blocked else dict(a_scale=a_scale, b_scale=b_scale)
    return reference.epilogue(z, bias=bias, activation=activation, residual=residual,
                              **after).astype(out_dtype)

  return where.run(row_parallel, arrays, rule, out)


def _rule(a, b, a_scale, b_scale, glu, **unused):
  """The split rule (see :func:`_across`). On a mesh of Auto axes: A's rows as "batch",
  "length", ..., K as "embed"; B's N has no name a matmul can know (heads? mlp?), so it stays
  whole unless B's type splits it; a stacked glu b's is the MLP's, "mlp". B and the bias are
  weights: split over data-like axes (fully sharded data parallelism), they are gathered in
  the map, their gradients reduce-scattered (``partitioning.gathers_inside``)."""
  rows = partitioning.row_dims(a.ndim, "embed")
  k, n = Free("k", "embed", label="K"), Free("n", label="N")
  weight = lambda d: dataclasses.replace(d, weight=True)
  if glu and b.ndim == 3:
    n, pair = Free("n", "mlp", label="N"), partitioning.Whole(quiet=True, weight=True)
    return dict(a=(*rows, k), b=(weight(k), pair, weight(n)), bias=(pair, weight(n)),
                residual=(*rows, n))
  rule = dict(a=(*rows, k), b=(weight(k), weight(n)), bias=(weight(n),), residual=(*rows, n),
              a_scale=rows if a_scale is not None and a_scale.ndim else (),
              b_scale=(n,) if b_scale is not None and b_scale.ndim else ())
  if reference.is_blocked(a_scale, b_scale):
    # Block scales split with the blocks they scale: K's blocks with K, N's with N (one block
    # along either, of size 1, is broadcast over the shards' slices).
    k_blocks = Free("k", "embed", label="K", broadcast=True)
    rule.update(a_scale=(*rows, k_blocks),
                b_scale=(k_blocks, Free("n", label="N", broadcast=True)))
  return rule


_OP = backend.register(backend.Op(
    name=OP,
    kernels={
        "triton": backend.Kernels.of(OP, "triton", triton, forward=triton.matmul),
        "mosaic_gpu": backend.Kernels.of(OP, "mosaic_gpu", mosaic_gpu,
                                         forward=mosaic_gpu.matmul),
        "mosaic_tpu": backend.Kernels.of(OP, "mosaic_tpu", mosaic_tpu,
                                         forward=mosaic_tpu.matmul),
    },
    validate=_validate,
    problem=_problem,
    reference=_reference,
    kernel=_kernel,
    compose=_compose,
    rule=_rule,
    across=_across,
    empty=lambda a, b, **unused: 0 in (*a.shape, *b.shape),
), matmul)
