"""flash_attention: validation, dispatch, sharding and the custom_vjp boundary."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxkernels import _checks, backend, dispatch, partitioning, remat
from jaxkernels.ops.attention import mosaic_gpu, mosaic_tpu, reference, ring
from jaxkernels.ops.attention.common import MAX_HEAD_DIM, Problem, Window
from jaxkernels.partitioning import Free, Whole

OP = "flash_attention"
# Names under which the forward's residuals are saved, for remat policies
# (jax.checkpoint_policies.save_only_these_names and friends).
OUTPUT_NAME = remat.ATTENTION_OUT  # the checkpoint names of the saved output and LSE
LSE_NAME = remat.ATTENTION_LSE


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #


def shape_of(a) -> tuple[int, ...]:
  return tuple(a.shape)


def _window(value, op=OP):
  if value is None:
    return None
  if isinstance(value, numbers.Integral) and not isinstance(value, bool):
    value = (value, value)
  if (not isinstance(value, (tuple, list)) or len(value) != 2 or
      not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in value)):
    raise TypeError(f"{op}: local_window_size must be an int or a (left, right) tuple of ints, "
                    f"got {value!r}")
  left, right = (int(w) for w in value)
  if left < 0 or right < 0:
    raise ValueError(f"{op}: local_window_size must be >= 0 on each side, got {(left, right)}")
  return left, right


def _segments(name, value, want, against, op=OP):
  if value is None:
    return None
  if not (hasattr(value, "shape") and hasattr(value, "dtype")):
    value = jnp.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.integer):
    raise TypeError(f"{op}: {name} must have an integer dtype, got {jnp.dtype(value.dtype)}")
  if shape_of(value) != want:
    raise ValueError(f"{op}: {name} must have shape {want} ({against}), got {shape_of(value)}")
  return value


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Args(backend.Args):
  """A flash_attention call's validated arguments: q (..., T, N, H), k and v (..., S, K, H);
  the bias as (..., Nb, T, S) with its leading dimensions 1 or the batch's; the segments
  (kv_segment_ids filled in from segment_ids where T == S); the mask as a Window; the scale a
  float; the soft cap None or a float; the sequence layout."""

  q: jax.Array
  k: jax.Array
  v: jax.Array
  bias: jax.Array | None
  segment_ids: jax.Array | None
  kv_segment_ids: jax.Array | None
  window: Window
  scale: float
  soft_cap: float | None
  layout: str


def validate(q, k, v, *, causal, scale, bias, segment_ids, kv_segment_ids, local_window_size,
              logits_soft_cap, sequence_layout="contiguous", return_lse=False, op=OP,
              names=("q", "k", "v")) -> Args:
  """The arguments checked, each error naming ``op`` (flash_attention, or decode_attention,
  which checks its q and caches here: ``names`` are the arguments as the caller calls them)."""
  del return_lse  # the public op's to act on
  qn, kn, vn = names
  # Rank 3 (T, N, H) is a batch of one, made rank 4 before this (is_unbatched).
  q = _checks.array(op, qn, q, min_rank=3)
  k = _checks.array(op, kn, k, min_rank=3)
  v = _checks.array(op, vn, v, min_rank=3)
  if not (q.ndim == k.ndim == v.ndim):
    raise ValueError(f"{op}: {qn}, {kn} and {vn} must have the same rank ((..., T, N, H) and "
                     f"(..., S, K, H)), got shapes {shape_of(q)}, {shape_of(k)}, {shape_of(v)}")
  if shape_of(k) != shape_of(v):
    raise ValueError(f"{op}: {kn} and {vn} must have the same shape, got {shape_of(k)} and "
                     f"{shape_of(v)}")
  batch = shape_of(q)[:-3]
  if shape_of(k)[:-3] != batch:
    raise ValueError(f"{op}: {qn} and {kn} must have the same batch dimensions, got "
                     f"{shape_of(q)} and {shape_of(k)}")
  t, n, h = shape_of(q)[-3:]
  s, kv_heads, hk = shape_of(k)[-3:]
  if hk != h:
    raise ValueError(f"{op}: {qn} and {kn} must have the same head dim, got {h} and {hk}")
  if h > MAX_HEAD_DIM or h < 1:
    raise ValueError(f"{op}: head dim {h} is not supported: 1 to {MAX_HEAD_DIM}")
  if kv_heads < 1 or n % kv_heads:
    raise ValueError(f"{op}: {qn}'s heads ({n}) must be a multiple of {kn}'s heads ({kv_heads}) "
                     "(grouped-query attention)")
  dtypes = {jnp.dtype(a.dtype) for a in (q, k, v)}
  if len(dtypes) != 1:
    raise TypeError(f"{op}: {qn}, {kn} and {vn} must have one dtype, got {q.dtype}, {k.dtype}, "
                    f"{v.dtype}")
  if not isinstance(causal, bool):
    raise TypeError(f"{op}: causal must be a bool, got {type(causal).__name__}")
  scale = 1.0 / math.sqrt(h) if scale is None else _finite_float("scale", scale, op)
  soft_cap = None if logits_soft_cap is None else _checks.positive_float(
      op, "logits_soft_cap", logits_soft_cap)
  window = Window.of(causal, _window(local_window_size, op))
  if kv_segment_ids is not None and segment_ids is None:
    raise ValueError(f"{op}: kv_segment_ids needs segment_ids (the queries' segments)")
  segment_ids = _segments("segment_ids", segment_ids, (*batch, t), "q's batch and length", op)
  if segment_ids is not None and kv_segment_ids is None:
    if s != t:
      raise ValueError(f"{op}: segment_ids alone serve q and k of one length; T={t} and S={s} "
                       "differ: pass kv_segment_ids too")
    kv_segment_ids = segment_ids
  kv_segment_ids = _segments("kv_segment_ids", kv_segment_ids, (*batch, s),
                             "k's batch and length", op)
  if bias is not None:
    bias = _checks.array(op, "bias", bias)
    want = (*batch, n, t, s)
    if bias.ndim > len(want) or any(d not in (1, w) for d, w in
                                    zip(shape_of(bias)[::-1], want[::-1])):
      raise ValueError(f"{op}: bias of shape {shape_of(bias)} does not broadcast to "
                       f"(*batch, N, T, S) = {want}")
    bias = bias.reshape((1,) * (len(want) - bias.ndim) + shape_of(bias))
    if shape_of(bias)[-2:] != (t, s):  # the kernels read whole (T, S) planes
      bias = jnp.broadcast_to(bias, (*shape_of(bias)[:-2], t, s))
  layout = _checks.choice(op, "sequence_layout", sequence_layout, ring.LAYOUTS)
  if layout == "zigzag" and not _ringable(q, k, bias, segment_ids, window, soft_cap):
    raise ValueError(f"{op}: sequence_layout='zigzag' orders the positions for ring attention, "
                     "which takes plain or causal attention of q and k of one length (no bias, "
                     "segment ids, window or soft cap); got "
                     f"T={t}, S={s}, window={tuple(window)}, bias "
                     f"{'given' if bias is not None else 'None'}, segment_ids "
                     f"{'given' if segment_ids is not None else 'None'}, logits_soft_cap "
                     f"{soft_cap}")
  return Args(q=q, k=k, v=v, bias=bias, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
              window=window, scale=scale, soft_cap=soft_cap, layout=layout)


def _ringable(q, k, bias, segment_ids, window, soft_cap) -> bool:
  """Whether a split sequence runs as ring attention (else it is gathered): plain or causal
  attention of q and k of one length, nothing else."""
  return (bias is None and segment_ids is None and soft_cap is None
          and window in (Window(None, None), Window(None, 0))
          and shape_of(q)[-3] == shape_of(k)[-3])


def _finite_float(name, value, op=OP) -> float:
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{op}: {name} must be a Python float, not a traced array")
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{op}: {name} must be a float, got {type(value).__name__}")
  if not math.isfinite(float(value)):
    raise ValueError(f"{op}: {name} must be finite, got {value}")
  return float(value)


# --------------------------------------------------------------------------- #
# Sharding
# --------------------------------------------------------------------------- #


def split_rule(args: Args, ring: bool = True) -> partitioning.Rule:
  """The split rule: the batch dimensions and the heads split freely, q's N with k's K (each
  shard holds whole GQA groups; heads whose kv heads the axes do not divide stay whole); the
  sequence, q's T with k's and v's S, splits too where the call is ring attention's
  (:func:`_ringable`), else a split sequence is gathered, as is a split head dim. The bias
  broadcasts where its batch or head dimension is 1. On a mesh of Auto axes, the dimensions'
  logical names are Flax's: q's and k's heads both "heads", their sequences "length".
  ``ring``: False for decode_attention, whose cache is never a ring's."""
  nb = args.q.ndim - 3
  batch = tuple(Free(f"batch{i}", "batch" if i == 0 else None, label="batch")
                for i in range(nb))
  heads = Free("heads", "heads", label="heads")
  whole = lambda name, why: Whole(name, why=f"the kernels {why} it whole",
                                  instead="split the batch or the heads")
  broadcast = lambda d: dataclasses.replace(d, broadcast=True)
  if ring and _ringable(args.q, args.k, args.bias, args.segment_ids, args.window,
                        args.soft_cap):
    length = kv_length = Free("sequence", "length", label="sequence")
  else:
    length, kv_length = whole("length", "walk"), whole(None, "walk")
  return dict(q=(*batch, length, heads, whole("kv", "contract")),
              k=(*batch, length, heads, whole("kv", "contract")),
              v=(*batch, kv_length, heads, whole(None, "read")),
              bias=(*map(broadcast, batch), broadcast(heads), Whole(), Whole()),
              segment_ids=(*batch, Whole()), kv_segment_ids=(*batch, Whole()),
              lengths=batch)


def out_dims(rule: partitioning.Rule):
  """The output (..., T, N, H) and the log-sum-exp (..., T, N): split as q's batch, sequence
  and heads."""
  rows, length, heads = rule["q"][:-3], rule["q"][-3], rule["q"][-2]
  return (*rows, length, heads, None), (*rows, length, heads)


def _across(where: partitioning.Split, rule: partitioning.Rule, local: backend.Local,
            args: Args):
  """Per shard: the kernels on each shard's batch and heads; where the sequence is split,
  ring attention over its mesh axes (``ring``), each step on the kernels the unsplit call's
  plan would take for that block (or the reference): the op's own forward (:func:`_kernel`,
  :func:`_reference`) and :func:`_block_grads`."""
  q = args.q
  arrays = dict(q=q, k=args.k, v=args.v, bias=args.bias, segment_ids=args.segment_ids,
                kv_segment_ids=args.kv_segment_ids)
  out = out_dims(rule)
  axes = where.axes("sequence")
  if not axes:
    return where.run(local, arrays, rule, out)
  n = where.size("sequence")
  if backend.forward_mode():
    raise ValueError(
        f"{OP}: forward-mode differentiation (jax.jvp, jax.jacfwd, jax.hessian) of ring "
        f"attention (the sequence split over mesh axes {axes}): its passes around the ring are "
        "a custom_vjp; differentiate it in reverse mode (jax.grad), or keep the sequence "
        "whole (split the batch or the heads instead)")
  if args.layout == "zigzag" and (q.shape[-3] // n) % 2:
    raise ValueError(f"{OP}: sequence_layout='zigzag' needs each of the {n} sequence shards to "
                     f"hold two equal chunks: T={q.shape[-3]} is not a multiple of {2 * n}")

  def block(qb, kb, vb, causal):
    """A query block against a k/v block: its arguments, and the plan (None: the reference)
    the unsplit call takes for them."""
    changed = dict(q=qb, k=kb, v=vb, window=Window.of(causal, None))
    return local.args.replace(**changed), local.plan(**changed)

  def forward(qb, kb, vb, causal):
    block_args, plan = block(qb, kb, vb, causal)
    return _reference(block_args) if plan is None else _kernel(plan, block_args)

  def backward(qb, kb, vb, out, lse, dout, dlse, causal):
    return _block_grads(*block(qb, kb, vb, causal), out, lse, dout, dlse)[:3]

  blocks = ring.Blocks(forward, backward)

  def per_shard(q, k, v):  # ring attention takes no bias or segments (_ringable)
    lead = q.shape[:-3]
    o, l = ring.attention(blocks, axes, n, args.window == Window(None, 0), args.layout,
                          flat(q, 3), flat(k, 3), flat(v, 3))
    return o.reshape(q.shape), l.reshape((*lead, *l.shape[1:]))

  return where.run(per_shard, dict(q=q, k=args.k, v=args.v), rule, out)


# --------------------------------------------------------------------------- #
# The custom_vjp boundary
# --------------------------------------------------------------------------- #


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(plan, q, k, v, bias, q_seg, kv_seg):
  return plan.run(plan.kernels.forward, q, k, v, bias, q_seg, kv_seg)


def _attention_fwd(plan, q, k, v, bias, q_seg, kv_seg):
  out, lse = plan.run(plan.kernels.forward, q, k, v, bias, q_seg, kv_seg)
  if plan.implementation != "mosaic_tpu":
    # The barrier keeps XLA's GPU dynamic-slice fusion from taking the kernel into the fusion
    # that writes the saved output into a scan's stacked residuals: it cloned the kernel
    # there, so that each layer ran its attention forward twice (notes/model.md model-2). On
    # a TPU it would pin the saved output to a layout of XLA's choosing: (B, T, N, 64) laid
    # out T-minor, a copy of the output each way around the in-place kernels (tpu-step-1).
    out, lse = lax.optimization_barrier((out, lse))
  saved_out, saved_lse = checkpoint_name(out, OUTPUT_NAME), checkpoint_name(lse, LSE_NAME)
  return (out, lse), (q, k, v, bias, q_seg, kv_seg, saved_out, saved_lse)


def _attention_bwd(plan, saved, cotangents):
  q, k, v, bias, q_seg, kv_seg, out, lse = saved
  dout, dlse = cotangents
  dq, dk, dv, dbias = plan.run(plan.kernels.backward, q, k, v, bias, q_seg, kv_seg, out, lse,
                               dout, dlse)
  return dq, dk, dv, dbias, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def flat(a, keep: int):
  """a with its leading dims merged into one, keeping the last ``keep``."""
  return None if a is None else a.reshape((-1, *a.shape[a.ndim - keep:]))


def _bias_lead(bias, batch):
  """The bias's leading dimensions as the kernels take them: 1 (broadcast) or the batch."""
  return 1 if all(d == 1 for d in bias.shape[:-3]) else math.prod(batch)


def _problem(args: Args) -> Problem:
  q, k, bias = args.q, args.k, args.bias
  t, n, h = q.shape[-3:]
  return Problem(math.prod(q.shape[:-3]), t, k.shape[-3], n, k.shape[-2], h, jnp.dtype(q.dtype),
                 args.window, args.soft_cap is not None,
                 None if bias is None else (_bias_lead(bias, q.shape[:-3]), bias.shape[-3]),
                 args.segment_ids is not None)


def _operands(args: Args):
  """(q, k, v, bias, segment_ids, kv_segment_ids) as the kernels and the reference take them:
  one batch dimension."""
  q, bias = args.q, args.bias
  if bias is not None:  # (*batch or 1s, Nb, T, S) -> (1 or B, Nb, T, S)
    batch = q.shape[:-3]
    if _bias_lead(bias, batch) > 1 and bias.shape[:-3] != batch:
      bias = jnp.broadcast_to(bias, (*batch, *bias.shape[-3:]))
    bias = bias.reshape((_bias_lead(bias, batch), *bias.shape[-3:]))
  return (flat(q, 3), flat(args.k, 3), flat(args.v, 3), bias, flat(args.segment_ids, 1),
          flat(args.kv_segment_ids, 1))


def _kernel(plan: dispatch.Plan, args: Args):
  """(out, lse) of the call on ``plan``'s kernels."""
  q = args.q
  out, lse = _attention(plan, *_operands(args))
  return out.reshape(q.shape), lse.reshape(q.shape[:-1])


def _reference(args: Args):
  """(out, lse) by the reference. No key at all: every query sees nothing. No query (T = 0,
  or an empty batch or head axis): nothing to compute, and no gradient for k and v (T = 0 once
  reached a reshape's ZeroDivisionError). The layout: unsplit, the zig-zag order is the
  identity (one shard)."""
  q = args.q
  if args.k.shape[-3] == 0 or q.size == 0:
    return jnp.zeros(q.shape, q.dtype), jnp.full(q.shape[:-1], -jnp.inf, jnp.float32)
  q2, k2, v2, bias, q_seg, kv_seg = _operands(args)
  out, lse = reference.attention(q2, k2, v2, bias=bias, q_segments=q_seg, kv_segments=kv_seg,
                                 window=args.window, scale=args.scale, soft_cap=args.soft_cap,
                                 return_lse=True)
  return out.reshape(q.shape), lse.reshape(q.shape[:-1])


def _block_grads(args: Args, plan: dispatch.Plan | None, out, lse, dout, dlse):
  """(dq, dk, dv, dbias) of the call from a given output and log-sum-exp (ring attention's
  blocks: the whole row's, so that each block's share is exact), on the plan's kernels'
  backward or (None) the reference's; one batch dimension, no bias or segments where the
  reference serves."""
  operands = _operands(args)
  if plan is None:
    q, k, v = operands[:3]
    return (*reference.block_grads(q, k, v, out, lse, dout, dlse, window=args.window,
                                   scale=args.scale), None)
  return plan.run(plan.kernels.backward, *operands, out, lse, dout, dlse)


def is_unbatched(q) -> bool:
  return getattr(q, "ndim", None) == 3


def batch_of_one(*arrays):
  """Each array (None passes) with a leading batch dimension of one."""
  return [None if a is None else jnp.expand_dims(jnp.asarray(a), 0) for a in arrays]


def flash_attention(q, k, v, *, causal: bool = False, scale: float | None = None, bias=None,
                    segment_ids=None, kv_segment_ids=None, local_window_size=None,
                    logits_soft_cap: float | None = None, sequence_layout: str = "contiguous",
                    return_lse: bool = False, implementation=None, config=None):
  """Softmax attention, computed block by block without the (T, S) matrix in memory.

  The layout and mask semantics of ``jax.nn.dot_product_attention``: query i sits at position
  i and key j at position j (top-left aligned where T != S).

  Args:
    q: (..., T, N, H): bfloat16, float16 or float32; any leading batch dims, or none.
    k, v: (..., S, K, H), q's dtype and batch dims; N a multiple of K (grouped-query and
      multi-query attention read each kv head once per group, never repeated in memory).
      H up to 256.
    causal: query i sees keys j <= i.
    scale: multiplies q k^T; default 1/sqrt(H).
    bias: added to the logits, broadcastable to (..., N, T, S); differentiable.
    segment_ids: (..., T) integers: query i sees key j only where its segment equals the key's
      (packed sequences). kv_segment_ids: (..., S), the keys' (default: segment_ids, T == S).
    local_window_size: int w (query i sees i - w <= j <= i + w) or (left, right).
    logits_soft_cap: c > 0: logits become c * tanh(logits / c) (after the scale, before the
      bias, so that a bias can still mask).
    sequence_layout: where T and S are split over mesh axes (ring attention, below): how the
      positions lie over the shards. "contiguous" (default): shard i holds positions
      [i T/n, (i + 1) T/n). "zigzag": T in 2n chunks, shard i holding chunks i and 2n - 1 - i
      (``jaxkernels.zigzag(T, n)`` is that order; lay the tokens out by it, positions and
      labels with them), so that causal attention is the same work on every shard. Unsplit,
      either is the identity.
    return_lse: also return the (..., T, N) float32 log-sum-exp of each query's logits
      (natural log; -inf for a query that sees no key), with its gradient.
    implementation: None (best available), "xla", "mosaic_gpu" (Hopper), "triton",
      "mosaic_tpu".
    config: the chosen kernel's Config; None picks one for the shape and device.

  Returns:
    (..., T, N, H) in q's dtype, and the log-sum-exp with ``return_lse``. A query that sees no
    key (every key masked) gets 0 and zero gradients, not NaN (``jax.nn.dot_product_attention``
    gives such a query the mean of v).

  Sharded arrays (a mesh of Explicit axes, or Auto axes with the rules): the batch dims and
  the heads split freely. T split with S over the same mesh axes runs ring attention
  (sequence parallelism): k and v blocks passed around the shards, each step on the same
  kernels, forward and backward, the memory a device holds 1 / shards of the whole; for plain
  or causal attention with T == S (no bias, segment ids, window or soft cap). Otherwise a split
  T or S, and a split H, is gathered with a ``ShardingWarning``.
  """
  unbatched = is_unbatched(q)  # (T, N, H), as jax.nn.dot_product_attention takes it
  if unbatched:  # a batch of one; a bias broadcasts over it
    q, k, v, segment_ids, kv_segment_ids = batch_of_one(q, k, v, segment_ids, kv_segment_ids)
  out, lse = backend.call(_OP, implementation, config, q=q, k=k, v=v, causal=causal, scale=scale,
                          bias=bias, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                          local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
                          sequence_layout=sequence_layout)
  if unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_lse else out


_OP = backend.register(backend.Op(
    name=OP,
    kernels={
        "mosaic_gpu": dispatch.Kernels.of(OP, "mosaic_gpu", mosaic_gpu,
                                         forward=mosaic_gpu.forward,
                                         backward=mosaic_gpu.backward,
                                         auto=mosaic_gpu.on_auto),
        **dispatch.triton_kernels(OP, "jaxkernels.ops.attention.triton", forward="forward",
                                  backward="backward"),
        "mosaic_tpu": dispatch.Kernels.of(OP, "mosaic_tpu", mosaic_tpu,
                                         forward=mosaic_tpu.forward,
                                         backward=mosaic_tpu.backward),
    },
    validate=validate, problem=_problem, reference=_reference, kernel=_kernel,
    options=lambda args: dict(window=args.window, scale=args.scale, soft_cap=args.soft_cap),
    rule=split_rule, out=lambda rule, args: out_dims(rule), across=_across,
), flash_attention)
