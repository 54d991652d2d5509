"""flash_attention: validation, dispatch, sharding and the custom_vjp boundary."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxkernels import _checks, backend, remat
from jaxkernels._tiling import bucket
from jaxkernels.ops.attention import (mosaic_gpu, mosaic_tpu, mosaic_tpu_decode, reference,
                                      ring, triton, triton_decode)
from jaxkernels.ops.attention.common import Window
from jaxkernels.partitioning import Free, Whole

OP = "flash_attention"
MAX_HEAD_DIM = 256
# Names under which the forward's residuals are saved, for remat policies
# (jax.checkpoint_policies.save_only_these_names and friends).
OUTPUT_NAME = remat.ATTENTION_OUT  # the checkpoint names of the saved output and LSE
LSE_NAME = remat.ATTENTION_LSE


def _dtype_reason(dtype) -> str | None:
  if dtype not in _checks.KERNEL_DTYPES:
    return f"q has dtype {dtype}; kernels take bfloat16, float16, float32"
  return None


@dataclasses.dataclass(frozen=True)
class Problem:
  """One attention call as its kernels see it: q (B, T, N, H), k and v (B, S, K, H), the mask's
  kind and the logits' extras."""

  batch: int
  q_len: int
  kv_len: int
  heads: int
  kv_heads: int
  head_dim: int
  dtype: jnp.dtype
  window: Window
  soft_cap: bool
  bias: tuple[int, int] | None  # (Bb, Nb): the bias's batch and heads (1: broadcast)
  segments: bool

  def key(self) -> str:
    mask = ("causal" if self.window.plain_causal else
            "window" if self.window.bounded else "full")
    extras = "".join(f"|{name}" for name, on in (("cap", self.soft_cap),
                                                  ("bias", self.bias is not None),
                                                  ("segments", self.segments)) if on)
    return (f"{self.dtype}|h{self.head_dim}|g{self.heads // self.kv_heads}|{mask}{extras}|"
            f"{bucket(self.q_len)}x{bucket(self.kv_len)}")

  def reason(self) -> str | None:
    return _dtype_reason(self.dtype)

  def __str__(self) -> str:
    return (f"attention of q ({self.batch}, {self.q_len}, {self.heads}, {self.head_dim}) against "
            f"k/v ({self.batch}, {self.kv_len}, {self.kv_heads}, {self.head_dim}) {self.dtype}")


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #


def _shape(a) -> tuple[int, ...]:
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
  if _shape(value) != want:
    raise ValueError(f"{op}: {name} must have shape {want} ({against}), got {_shape(value)}")
  return value


def _validate(q, k, v, *, causal, scale, bias, segment_ids, kv_segment_ids, local_window_size,
              logits_soft_cap, sequence_layout="contiguous", return_lse=False, op=OP,
              names=("q", "k", "v")) -> dict:
  """The arguments checked, each error naming ``op`` (flash_attention, or decode_attention,
  which checks its q and caches here: ``names`` are the arguments as the caller calls them)."""
  del return_lse  # the public op's to act on
  qn, kn, vn = names
  # Rank 3 (T, N, H) is a batch of one, made rank 4 before this (_unbatched).
  q = _checks.array(op, qn, q, min_rank=3)
  k = _checks.array(op, kn, k, min_rank=3)
  v = _checks.array(op, vn, v, min_rank=3)
  if not (q.ndim == k.ndim == v.ndim):
    raise ValueError(f"{op}: {qn}, {kn} and {vn} must have the same rank ((..., T, N, H) and "
                     f"(..., S, K, H)), got shapes {_shape(q)}, {_shape(k)}, {_shape(v)}")
  if _shape(k) != _shape(v):
    raise ValueError(f"{op}: {kn} and {vn} must have the same shape, got {_shape(k)} and "
                     f"{_shape(v)}")
  batch = _shape(q)[:-3]
  if _shape(k)[:-3] != batch:
    raise ValueError(f"{op}: {qn} and {kn} must have the same batch dimensions, got "
                     f"{_shape(q)} and {_shape(k)}")
  t, n, h = _shape(q)[-3:]
  s, kv_heads, hk = _shape(k)[-3:]
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
                                    zip(_shape(bias)[::-1], want[::-1])):
      raise ValueError(f"{op}: bias of shape {_shape(bias)} does not broadcast to "
                       f"(*batch, N, T, S) = {want}")
    bias = bias.reshape((1,) * (len(want) - bias.ndim) + _shape(bias))
    if _shape(bias)[-2:] != (t, s):  # the kernels read whole (T, S) planes
      bias = jnp.broadcast_to(bias, (*_shape(bias)[:-2], t, s))
  layout = _checks.choice(op, "sequence_layout", sequence_layout, ring.LAYOUTS)
  if layout == "zigzag" and not _ringable(q, k, bias, segment_ids, window, soft_cap):
    raise ValueError(f"{op}: sequence_layout='zigzag' orders the positions for ring attention, "
                     "which takes plain or causal attention of q and k of one length (no bias, "
                     "segment ids, window or soft cap); got "
                     f"T={t}, S={s}, window={tuple(window)}, bias "
                     f"{'given' if bias is not None else 'None'}, segment_ids "
                     f"{'given' if segment_ids is not None else 'None'}, logits_soft_cap "
                     f"{soft_cap}")
  return dict(q=q, k=k, v=v, bias=bias, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
              window=window, scale=scale, soft_cap=soft_cap, layout=layout)


def _ringable(q, k, bias, segment_ids, window, soft_cap, **unused) -> bool:
  """Whether a split sequence runs as ring attention (else it is gathered): plain or causal
  attention of q and k of one length, nothing else."""
  return (bias is None and segment_ids is None and soft_cap is None
          and window in (Window(None, None), Window(None, 0)) and _shape(q)[-3] == _shape(k)[-3])


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


def _rule(q, ring=True, **args):
  """The split rule: the batch dimensions and the heads split freely, q's N with k's K (each
  shard holds whole GQA groups; heads whose kv heads the axes do not divide stay whole); the
  sequence, q's T with k's and v's S, splits too where the call is ring attention's
  (:func:`_ringable`), else a split sequence is gathered, as is a split head dim. The bias
  broadcasts where its batch or head dimension is 1. On a mesh of Auto axes, the dimensions'
  logical names are Flax's: q's and k's heads both "heads", their sequences "length".
  ``ring``: False for decode_attention, whose cache is never a ring's."""
  nb = q.ndim - 3
  batch = tuple(Free(f"batch{i}", "batch" if i == 0 else None, label="batch")
                for i in range(nb))
  heads = Free("heads", "heads", label="heads")
  whole = lambda name, why: Whole(name, why=f"the kernels {why} it whole",
                                  instead="split the batch or the heads")
  broadcast = lambda d: dataclasses.replace(d, broadcast=True)
  if ring and _ringable(q, **args):
    length = kv_length = Free("sequence", "length", label="sequence")
  else:
    length, kv_length = whole("length", "walk"), whole(None, "walk")
  return dict(q=(*batch, length, heads, whole("kv", "contract")),
              k=(*batch, length, heads, whole("kv", "contract")),
              v=(*batch, kv_length, heads, whole(None, "read")),
              bias=(*map(broadcast, batch), broadcast(heads), Whole(), Whole()),
              segment_ids=(*batch, Whole()), kv_segment_ids=(*batch, Whole()),
              lengths=batch)


def _out(rule, **unused):
  """The output (..., T, N, H) and the log-sum-exp (..., T, N): split as q's batch, sequence
  and heads."""
  rows, length, heads = rule["q"][:-3], rule["q"][-3], rule["q"][-2]
  return (*rows, length, heads, None), (*rows, length, heads)


def _across(where, rule, local, *, q, k, v, bias, segment_ids, kv_segment_ids, window, scale,
            soft_cap, layout):
  """Per shard: the kernels on each shard's batch and heads; where the sequence is split,
  ring attention over its mesh axes (``ring``), each step on the kernels the unsplit call's
  plan would take for that block (or the reference)."""
  arrays = dict(q=q, k=k, v=v, bias=bias, segment_ids=segment_ids,
                kv_segment_ids=kv_segment_ids)
  out = _out(rule)
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
  if layout == "zigzag" and (q.shape[-3] // n) % 2:
    raise ValueError(f"{OP}: sequence_layout='zigzag' needs each of the {n} sequence shards to "
                     f"hold two equal chunks: T={q.shape[-3]} is not a multiple of {2 * n}")

  def plan(qb, kb, causal):
    return local.plan(q=qb, k=kb, v=kb, window=Window.of(causal, None))

  def forward(qb, kb, vb, causal):
    chosen = plan(qb, kb, causal)
    if chosen is None:
      return reference.attention(qb, kb, vb, window=Window.of(causal, None), scale=scale,
                                 return_lse=True)
    return chosen.run(chosen.kernels.forward, qb, kb, vb, None, None, None)

  def backward(qb, kb, vb, out, lse, dout, dlse, causal):
    chosen = plan(qb, kb, causal)
    if chosen is None:
      return reference.block_grads(qb, kb, vb, out, lse, dout, dlse,
                                   window=Window.of(causal, None), scale=scale)
    return chosen.run(chosen.kernels.backward, qb, kb, vb, None, None, None, out, lse, dout,
                      dlse)[:3]
  blocks = ring.Blocks(forward, backward)

  def per_shard(q, k, v, **unused):
    lead = q.shape[:-3]
    o, l = ring.attention(blocks, axes, n, window == Window(None, 0), layout,
                          _flat(q, 3), _flat(k, 3), _flat(v, 3))
    return o.reshape(q.shape), l.reshape((*lead, *l.shape[1:]))

  return where.run(per_shard, arrays, rule, out)


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
    # there, so that each layer ran its attention forward twice (bench/NOTES.md model-2). On
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


def _flat(a, keep: int):
  """a with its leading dims merged into one, keeping the last ``keep``."""
  return None if a is None else a.reshape((-1, *a.shape[a.ndim - keep:]))


def _bias_lead(bias, batch):
  """The bias's leading dimensions as the kernels take them: 1 (broadcast) or the batch."""
  return 1 if all(d == 1 for d in bias.shape[:-3]) else math.prod(batch)


def _problem(q, k, bias, segment_ids, window, soft_cap, **unused):
  t, n, h = q.shape[-3:]
  return Problem(math.prod(q.shape[:-3]), t, k.shape[-3], n, k.shape[-2], h, jnp.dtype(q.dtype),
                 window, soft_cap is not None,
                 None if bias is None else (_bias_lead(bias, q.shape[:-3]), bias.shape[-3]),
                 segment_ids is not None)


def _flat_args(q, k, v, bias, segment_ids, kv_segment_ids):
  """The operands as the kernels and the reference take them: one batch dimension."""
  if bias is not None:  # (*batch or 1s, Nb, T, S) -> (1 or B, Nb, T, S)
    batch = q.shape[:-3]
    if _bias_lead(bias, batch) > 1 and bias.shape[:-3] != batch:
      bias = jnp.broadcast_to(bias, (*batch, *bias.shape[-3:]))
    bias = bias.reshape((_bias_lead(bias, batch), *bias.shape[-3:]))
  return (_flat(q, 3), _flat(k, 3), _flat(v, 3), bias, _flat(segment_ids, 1),
          _flat(kv_segment_ids, 1))


def _kernel(plan, q, k, v, bias, segment_ids, kv_segment_ids, **unused):
  """(out, lse) of the call on ``plan``'s kernels."""
  out, lse = _attention(plan, *_flat_args(q, k, v, bias, segment_ids, kv_segment_ids))
  return out.reshape(q.shape), lse.reshape(q.shape[:-1])


def _reference(q, k, v, bias, segment_ids, kv_segment_ids, window, scale, soft_cap, layout):
  """(out, lse) by the reference. No key at all: every query sees nothing. No query (T = 0,
  or an empty batch or head axis): nothing to compute, and no gradient for k and v (T = 0 once
  reached a reshape's ZeroDivisionError). ``layout``: unsplit, the zig-zag order is the
  identity (one shard)."""
  del layout
  if k.shape[-3] == 0 or q.size == 0:
    return jnp.zeros(q.shape, q.dtype), jnp.full(q.shape[:-1], -jnp.inf, jnp.float32)
  q2, k2, v2, bias, q_seg, kv_seg = _flat_args(q, k, v, bias, segment_ids, kv_segment_ids)
  out, lse = reference.attention(q2, k2, v2, bias=bias, q_segments=q_seg, kv_segments=kv_seg,
                                 window=window, scale=scale, soft_cap=soft_cap, return_lse=True)
  return out.reshape(q.shape), lse.reshape(q.shape[:-1])


def _unbatched(q) -> bool:
  return getattr(q, "ndim", None) == 3


def _batch_of_one(*arrays):
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
  if _unbatched(q):  # (T, N, H), as jax.nn.dot_product_attention takes it: a batch of one
    q, k, v, segment_ids, kv_segment_ids = _batch_of_one(q, k, v, segment_ids, kv_segment_ids)
    out = flash_attention(q, k, v, causal=causal, scale=scale, bias=bias,  # bias broadcasts
                          segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                          local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
                          sequence_layout=sequence_layout, return_lse=return_lse,
                          implementation=implementation, config=config)
    return jax.tree.map(lambda a: a[0], out)
  out, lse = backend.call(_OP, implementation, config, q=q, k=k, v=v, causal=causal, scale=scale,
                          bias=bias, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                          local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
                          sequence_layout=sequence_layout)
  return (out, lse) if return_lse else out


_OP = backend.register(backend.Op(
    name=OP,
    kernels={
        "mosaic_gpu": backend.Kernels.of(OP, "mosaic_gpu", mosaic_gpu,
                                         forward=mosaic_gpu.forward,
                                         backward=mosaic_gpu.backward),
        "triton": backend.Kernels.of(OP, "triton", triton, forward=triton.forward,
                                     backward=triton.backward),
        "mosaic_tpu": backend.Kernels.of(OP, "mosaic_tpu", mosaic_tpu,
                                         forward=mosaic_tpu.forward,
                                         backward=mosaic_tpu.backward),
    },
    validate=_validate, problem=_problem, reference=_reference, kernel=_kernel,
    options=lambda window, scale, soft_cap, **unused: dict(window=window, scale=scale,
                                                           soft_cap=soft_cap),
    rule=_rule, out=_out, across=_across,
), flash_attention)


# --------------------------------------------------------------------------- #
# decode_attention
# --------------------------------------------------------------------------- #

DECODE_OP = "decode_attention"


@dataclasses.dataclass(frozen=True)
class DecodeProblem:
  """One decode call: q (B, Tq, N, H) new queries against caches (B, S, K, H)."""

  batch: int
  q_len: int
  kv_len: int
  heads: int
  kv_heads: int
  head_dim: int
  dtype: jnp.dtype
  soft_cap: bool
  window: bool

  def key(self) -> str:
    extras = "".join(f"|{name}" for name, on in (("cap", self.soft_cap), ("window", self.window))
                     if on)
    return (f"{self.dtype}|h{self.head_dim}|g{self.heads // self.kv_heads}|q{self.q_len}{extras}|"
            f"b{bucket(self.batch * self.kv_heads)}|{bucket(self.kv_len)}")

  def reason(self) -> str | None:
    return _dtype_reason(self.dtype)

  def __str__(self) -> str:
    return (f"decode of q ({self.batch}, {self.q_len}, {self.heads}, {self.head_dim}) against a "
            f"cache ({self.batch}, {self.kv_len}, {self.kv_heads}, {self.head_dim}) {self.dtype}")


def _validate_decode(q, k_cache, v_cache, *, lengths, scale, logits_soft_cap,
                     local_window_size):
  args = _validate(q, k_cache, v_cache, op=DECODE_OP, names=("q", "k_cache", "v_cache"),
                   causal=False, scale=scale, bias=None, segment_ids=None,
                   kv_segment_ids=None, local_window_size=None, logits_soft_cap=logits_soft_cap)
  batch = args["q"].shape[:-3]
  if lengths is None:
    raise ValueError(f"{DECODE_OP}: lengths is required: the number of valid cache entries of "
                     "each sequence, the new queries' own included")
  if not (hasattr(lengths, "shape") and hasattr(lengths, "dtype")):
    lengths = jnp.asarray(lengths)
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(f"{DECODE_OP}: lengths must have an integer dtype, got "
                    f"{jnp.dtype(lengths.dtype)}")
  if _shape(lengths) != batch:
    raise ValueError(f"{DECODE_OP}: lengths must have shape {batch} (q's batch), got "
                     f"{_shape(lengths)}")
  if not isinstance(lengths, jax.core.Tracer):  # known now (not under jit): checked
    cache = args["k"].shape[-3]
    known = np.asarray(lengths)
    if known.size and (known.max() > cache or known.min() < 0):
      bad = known.max() if known.max() > cache else known.min()
      raise ValueError(f"{DECODE_OP}: lengths must be in [0, {cache}] (the caches' length S), "
                       f"got {int(bad)}")
  window_left = None
  if local_window_size is not None:
    if isinstance(local_window_size, bool) or not isinstance(local_window_size, numbers.Integral):
      raise TypeError(f"{DECODE_OP}: local_window_size must be an int (keys behind each query), "
                      f"got {local_window_size!r}")
    if local_window_size < 0:
      raise ValueError(f"{DECODE_OP}: local_window_size must be >= 0, got {local_window_size}")
    window_left = int(local_window_size)
  return dict(q=args["q"], k=args["k"], v=args["v"], lengths=lengths, scale=args["scale"],
              soft_cap=args["soft_cap"], window_left=window_left)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5))
def _decode(plan, q, k, v, lengths, window_left):
  return plan.run(plan.kernels.forward, q, k, v, lengths, window_left=window_left)


def _decode_reference(plan, window_left):
  options = dict(plan.options)
  return lambda q, k, v, lengths: reference.decode(
      q, k, v, lengths, scale=options["scale"], soft_cap=options["soft_cap"],
      window_left=window_left)


def _decode_fwd(plan, q, k, v, lengths, window_left):
  return _decode(plan, q, k, v, lengths, window_left), (q, k, v, lengths)


def _decode_bwd(plan, window_left, saved, dout):
  # Decode is inference's op; its gradient, where asked for, is the reference's: with few
  # queries its (B, N, Tq, S) logits are small.
  q, k, v, lengths = saved
  _, vjp = jax.vjp(lambda q, k, v: _decode_reference(plan, window_left)(q, k, v, lengths),
                   q, k, v)
  return (*vjp(dout), None)


_decode.defvjp(_decode_fwd, _decode_bwd)


def decode_attention(q, k_cache, v_cache, *, lengths, scale: float | None = None,
                     logits_soft_cap: float | None = None, local_window_size: int | None = None,
                     implementation=None, config=None):
  """Attention of a few new queries (decoding) against a KV cache, split along the cache over
  the GPU's SMs (or a TPU's TensorCores) and combined by log-sum-exp (flash-decoding).

  Args:
    q: (..., Tq, N, H) new queries, Tq small (1-16; the kernel takes up to 64 rows a group);
      any leading batch dims, or none (then ``lengths`` is a scalar).
    k_cache, v_cache: (..., S, K, H), N a multiple of K; entries past a sequence's length are
      never read.
    lengths: (...) integers: the valid entries of each sequence's cache, the new queries' own
      keys and values included: query t sits at position lengths - Tq + t and sees the keys at
      positions up to its own.
    scale, logits_soft_cap: as for flash_attention.
    local_window_size: int: each query also sees no key more than this far behind it.
    implementation: None (best available), "xla", "triton", "mosaic_tpu".

  Returns (..., Tq, N, H) in q's dtype; 0 for a query that sees no key. Differentiable (the
  reference's gradient).
  """
  if _unbatched(q):  # (Tq, N, H) against (S, K, H) caches, lengths a scalar: a batch of one
    q, k_cache, v_cache, lengths = _batch_of_one(q, k_cache, v_cache, lengths)
    return decode_attention(q, k_cache, v_cache, lengths=lengths, scale=scale,
                            logits_soft_cap=logits_soft_cap,
                            local_window_size=local_window_size,
                            implementation=implementation, config=config)[0]
  return backend.call(_DECODE_OP, implementation, config, q=q, k_cache=k_cache,
                      v_cache=v_cache, lengths=lengths, scale=scale,
                      logits_soft_cap=logits_soft_cap, local_window_size=local_window_size)


def _decode_problem(q, k, soft_cap, window_left, **unused):
  t, n, h = q.shape[-3:]
  return DecodeProblem(math.prod(q.shape[:-3]), t, k.shape[-3], n, k.shape[-2], h,
                       jnp.dtype(q.dtype), soft_cap is not None, window_left is not None)


def _decode_kernel(plan, q, k, v, lengths, window_left, **unused):
  out = _decode(plan, _flat(q, 3), _flat(k, 3), _flat(v, 3), lengths.reshape(-1), window_left)
  return out.reshape(q.shape)


def _decode_reference_call(q, k, v, lengths, scale, soft_cap, window_left):
  if k.shape[-3] == 0 or q.size == 0:
    return jnp.zeros(q.shape, q.dtype)
  out = reference.decode(_flat(q, 3), _flat(k, 3), _flat(v, 3), lengths.reshape(-1),
                         scale=scale, soft_cap=soft_cap, window_left=window_left)
  return out.reshape(q.shape)


_DECODE_OP = backend.register(backend.Op(
    name=DECODE_OP,
    kernels={
        "triton": backend.Kernels.of(DECODE_OP, "triton", triton_decode,
                                     forward=triton_decode.forward),
        "mosaic_tpu": backend.Kernels.of(DECODE_OP, "mosaic_tpu", mosaic_tpu_decode,
                                         forward=mosaic_tpu_decode.forward),
    },
    validate=_validate_decode, problem=_decode_problem, reference=_decode_reference_call,
    kernel=_decode_kernel,
    options=lambda scale, soft_cap, **unused: dict(scale=scale, soft_cap=soft_cap),
    rule=functools.partial(_rule, ring=False), out=lambda rule, **unused: _out(rule)[0],
), decode_attention)
