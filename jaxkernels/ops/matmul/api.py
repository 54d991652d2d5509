"""matmul: validation, dispatch, the custom_vjp boundary, and the backward on transposed operands."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxkernels import _activations, backend, dispatch, partitioning, remat
from jaxkernels.ops.elementwise import api as elementwise
from jaxkernels.ops.matmul import mosaic_gpu, mosaic_tpu, reference
from jaxkernels.ops.matmul.arguments import Args, validate
from jaxkernels.ops.matmul.common import NEEDS_PREACTIVATION, Problem, is_quantized
from jaxkernels.partitioning import Free

OP = "matmul"


def _run(plan: dispatch.Plan, problem: Problem, *operands, forward: bool = False,
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
  # glu's backward on a GPU kernel beside the product's (only Mosaic GPU fuses the gate): the
  # product's own backend's; else Triton's; else dispatch's choice, the XLA reference. At
  # the model steps' [gate | up] (silu, H200) Mosaic GPU's is at Triton's time for 350m
  # (16384 x 2 x 2816) and 1.07x faster for 1b (8192 x 2 x 5632): notes/mgpurows.md mgpu-rows-4.
  serving = [implementation for implementation in (plan.implementation, "triton")
             if backend.supports(elementwise.GLU.name, implementation, z,
                                 activation=p.activation)]
  dz = elementwise.packed_glu_grad(z, dy, activation=p.activation,
                                   implementation=serving[0] if serving else None)
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


def _problem(args: Args) -> Problem:
  """The product as its kernels see it: under glu the gated product (its kernel writes y from
  the gate's and up's accumulators), b stacked (K, 2, N) taken as (K, 2N) in place."""
  a, b, b_scale = args.a, args.b, args.b_scale
  k, n = b.shape[0], math.prod(b.shape[1:])
  blocked = reference.is_blocked(None, b_scale)
  return Problem(m=math.prod(a.shape[:-1]), n=n, k=k, dtype=jnp.dtype(a.dtype),
                 out_dtype=args.out_dtype, activation=args.activation,
                 has_bias=args.bias is not None, has_residual=args.residual is not None,
                 has_scales=is_quantized(a.dtype) and not blocked,
                 block_k=k // b_scale.shape[0] if blocked else 0,
                 block_n=n // b_scale.shape[1] if blocked else 0, precision=args.precision,
                 glu=args.glu)


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


def _kernel(plan: dispatch.Plan, args: Args):
  """The validated product on one device (or one shard), on the plan's kernels."""
  a, b, a_scale, b_scale = args.a, args.b, args.a_scale, args.b_scale
  problem = _problem(args)
  out_shape = (*a.shape[:-1], problem.out_n)
  a2 = a.reshape(problem.m, problem.k)
  if problem.glu:  # the gated product, whole on one kernel (_compose)
    return _gated(plan, problem, a2, b.reshape(problem.k, problem.n)).reshape(out_shape)
  b_wide, b = b, (b if args.b_dtype is None else b.astype(args.b_dtype))
  r2 = None if args.residual is None else args.residual.reshape(problem.m, problem.n)
  if problem.block_k:  # block scales: a_scale (..., M, K/bk) -> (M, K/bk)
    return _quantized(plan, problem, a2, b, a_scale.reshape(problem.m, -1), b_scale, args.bias,
                      r2).reshape(out_shape)
  if not problem.has_scales:
    return _differentiable(plan, problem, a2, b_wide, args.bias, r2).reshape(out_shape)
  as2 = jnp.broadcast_to(jnp.float32(1) if a_scale is None else a_scale.astype(jnp.float32),
                         a.shape[:-1]).reshape(problem.m)
  bs2 = jnp.broadcast_to(jnp.float32(1) if b_scale is None else b_scale.astype(jnp.float32),
                         (problem.n,))
  return _quantized(plan, problem, a2, b, as2, bs2, args.bias, r2).reshape(out_shape)


def _reference(args: Args):
  """XLA's product; under glu, then glu's reference on its [gate | up] and the residual."""
  b = args.b if args.b_dtype is None else args.b.astype(args.b_dtype)
  if not args.glu:
    return reference.matmul(args.a, b, bias=args.bias, activation=args.activation,
                            residual=args.residual, a_scale=args.a_scale, b_scale=args.b_scale,
                            out_dtype=args.out_dtype, precision=args.precision)
  bias = None if args.bias is None else args.bias.reshape(-1)
  z = reference.matmul(args.a, b.reshape(b.shape[0], -1), bias=bias, a_scale=args.a_scale,
                       b_scale=args.b_scale, out_dtype=args.out_dtype,
                       precision=args.precision)
  return _gate(z, args, "xla")


def _gate(z, args: Args, implementation):
  """glu of the product z = [gate | up] (a call of glu, on ``implementation``), plus the
  residual."""
  y = backend.call(elementwise.GLU, implementation, None, gate=z, up=None,
                   activation=args.activation)
  return y if args.residual is None else _add(y, args.residual)


def _glu_implementation(implementation):
  """The implementation glu takes after a product on ``implementation``: the same, but for
  mosaic_gpu, whose glu kernels dispatch prefers only where measured at Triton's time
  (``elementwise.mosaic_gpu.AT_PARITY``): dispatch picks glu's."""
  return None if implementation == "mosaic_gpu" else implementation


def _compose(local: backend.Local, args: Args):
  """matmul(glu=True): None (the call runs as any other, on the gated product's kernel: the
  Mosaic GPU kernel's, ``mosaic_gpu.unsupported``) where nothing is split and a kernel takes
  the gated product whole; else the product (any kernel, any sharding) and then glu on its
  [gate | up]. None too without glu. Stacked, see :func:`_stacked`."""
  if not args.glu:
    return None
  if args.b.ndim == 3:
    return _stacked(local, args)
  if local.unsplit() and local.kernel() is not None:
    return None
  z = backend.call(_OP, local.implementation, local.config, **_product(args).public())
  return _gate(z, args, _glu_implementation(local.implementation))


def _product(args: Args) -> Args:
  """matmul(glu=True)'s product alone, before the gate: what its composition calls first."""
  return args.replace(activation=None, residual=None, glu=False)


def _stacked(local: backend.Local, args: Args):
  """glu=True with b stacked (K, 2, N): on implementation="xla", plain JAX's products of the
  gate and up halves (its partitioner splits them); where split, None (the rule splits it,
  :func:`_across`); else the side-by-side call on b reshaped in place to (K, 2N)."""
  a, b, bias = args.a, args.b, args.bias
  if local.implementation == "xla":
    z = reference.stacked(a, b, bias=bias, out_dtype=args.out_dtype, precision=args.precision)
    y = backend.call(elementwise.GLU, "xla", None, gate=z[..., 0, :], up=z[..., 1, :],
                     activation=args.activation)
    return y if args.residual is None else _add(y, args.residual)
  if not local.unsplit():
    return None
  return backend.call(_OP, local.implementation, local.config,
                      **args.public(b=b.reshape(b.shape[0], -1),
                                    bias=None if bias is None else bias.reshape(-1)))


def _add(y, residual):
  """glu's output plus the residual, added in float32 (y is in out_dtype already)."""
  return (y.astype(jnp.float32) + residual.astype(jnp.float32)).astype(y.dtype)


def _stacked_across(where: partitioning.Split, rule: partitioning.Rule, local: backend.Local,
                    args: Args):
  """glu=True with b stacked (K, 2, N), split: on each shard the side-by-side call on its own
  [gate | up], b reshaped in place to (K, 2N / shards). Rows split freely; N splits
  column-parallel, each shard gating its own columns (tensor parallelism's first MLP product:
  nothing gathered); K splits row-parallel, the partial products summed (float32) before the
  gate, which needs the whole sum."""
  b = args.b
  arrays = dict(a=args.a, b=b, bias=args.bias, residual=args.residual)
  k_axes = where.axes("k")
  implementation, config = local.implementation, local.config

  def shard(a, b, bias, residual, b_dtype=None):
    b = b.reshape(b.shape[0], -1).astype(b_dtype or b.dtype)
    bias = None if bias is None else bias.reshape(-1)
    if not k_axes:
      return backend.call(_OP, implementation, config,
                          **args.public(a=a, b=b, bias=bias, residual=residual))
    product = backend.call(_OP, implementation, config,
                           **args.public(a=a, b=b, bias=None, residual=None, glu=False,
                                         activation=None, out_dtype=jnp.float32))
    z = reference.epilogue(partitioning.psum_out(product, k_axes), bias=bias)
    return _gate(z.astype(args.out_dtype), args.replace(residual=residual),
                 _glu_implementation(implementation))

  rows = [d.group for d in rule["a"][:-1]]
  if where.size(*rows) > 1 and jnp.dtype(b.dtype).itemsize < 4:
    # dB summed over the row shards in float32, rounded once (as the plain product's rule).
    arrays["b"] = b.astype(jnp.float32)
    return where.run(lambda **shards: shard(**shards, b_dtype=b.dtype), arrays, rule,
                     rule["residual"], wire={"b": b.dtype})
  return where.run(shard, arrays, rule, rule["residual"])


def _across(where: partitioning.Split, rule: partitioning.Rule, local: backend.Local,
            args: Args):
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
  a, b = args.a, args.b
  if args.glu and b.ndim == 3:
    return _stacked_across(where, rule, local, args)
  arrays = dict(a=a, b=b, bias=args.bias, residual=args.residual, a_scale=args.a_scale,
                b_scale=args.b_scale)
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

  blocked = reference.is_blocked(args.a_scale, args.b_scale)

  def row_parallel(a, b, bias, residual, a_scale, b_scale):
    # Block scales go with their K slice into the shard's product; the others after the sum.
    scales = (dict(a_scale=a_scale, b_scale=b_scale) if blocked
              else dict(a_scale=None, b_scale=None))
    partial = local(a=a, b=b, bias=None, activation=None, residual=None, out_dtype=jnp.float32,
                    **scales)
    z = partitioning.psum_out(partial, k)
    after = {} if blocked else dict(a_scale=a_scale, b_scale=b_scale)
    return reference.epilogue(z, bias=bias, activation=args.activation, residual=residual,
                              **after).astype(args.out_dtype)

  return where.run(row_parallel, arrays, rule, out)


def _rule(args: Args) -> partitioning.Rule:
  """The split rule (see :func:`_across`). On a mesh of Auto axes: A's rows as "batch",
  "length", ..., K as "embed"; B's N has no name a matmul can know (heads? mlp?), so it stays
  whole unless B's type splits it; a stacked glu b's is the MLP's, "mlp". B and the bias are
  weights: split over data-like axes (fully sharded data parallelism), they are gathered in
  the map, their gradients reduce-scattered (``partitioning.gathers_inside``)."""
  a_scale, b_scale = args.a_scale, args.b_scale
  rows = partitioning.row_dims(args.a.ndim, "embed")
  k, n = Free("k", "embed", label="K"), Free("n", label="N")
  weight = lambda d: dataclasses.replace(d, weight=True)
  if args.glu and args.b.ndim == 3:
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
        **dispatch.triton_kernels(OP, "jaxkernels.ops.matmul.triton", forward="matmul"),
        "mosaic_gpu": dispatch.Kernels.of(OP, "mosaic_gpu", mosaic_gpu,
                                          forward=mosaic_gpu.matmul),
        "mosaic_tpu": dispatch.Kernels.of(OP, "mosaic_tpu", mosaic_tpu,
                                          forward=mosaic_tpu.matmul),
    },
    validate=validate,
    problem=_problem,
    reference=_reference,
    kernel=_kernel,
    compose=_compose,
    composed=_product,
    rule=_rule,
    across=_across,
    empty=lambda args: 0 in (*args.a.shape, *args.b.shape),
), matmul)
