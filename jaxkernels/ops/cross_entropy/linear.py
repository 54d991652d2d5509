"""linear_softmax_cross_entropy: ``softmax_cross_entropy(x @ w, labels)`` without the
(tokens, vocab) logits in memory. Validation, dispatch, sharding (vocabulary parallel too) and
the custom_vjp boundaries.

It walks the tokens in chunks, each chunk's logits a matmul (float32 accumulation, stored in
x's dtype as an unfused model's are) that the row kernels (``rows``) read and that dies with
the chunk. Reduced to a mean or a sum, the loss's cotangent is one number, so the forward
computes the gradients as it goes (the chunk's logits gradient, then dx and dW from it: three
matmuls a chunk, as an unfused forward and backward take) and the backward only scales them.
Unreduced, the backward recomputes each chunk's logits (a fourth matmul) for the per-token
cotangents.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxkernels import _checks, backend, dispatch, partitioning
from jaxkernels._tiling import round_up
from jaxkernels.ops.cross_entropy import reference, rows
from jaxkernels.ops.cross_entropy.rows import LINEAR_OP, Options
from jaxkernels.partitioning import Free, Whole

# A chunk's logits: 512 MiB of bfloat16. Fewer, larger chunks read and write dW's float32
# accumulator fewer times (2 GiB a chunk at D=2048, V=128K).
CHUNK_ELEMENTS = 1 << 28


@dataclasses.dataclass(frozen=True)
class _Linear:
  """What a linear cross-entropy call fixes: the row kernels' plan (None: the reference's
  math), its options, the chunk of tokens."""

  plan: dispatch.Plan | None
  options: Options
  chunk: int
  grad_dtypes: tuple[Any, Any]  # x's and w's: the dtypes of their gradients
  # The dtype w's products run in (None: w's own). The sharded path hands a 16-bit w in as
  # float32, so that each shard's dw stays float32 until the sum across shards.
  w_compute: Any = None

  def weight(self, w):
    return w if self.w_compute is None else w.astype(self.w_compute)


def _chunks(spec: _Linear, *arrays):
  """Each array's tokens (the leading axis) as (chunks, chunk, ...)."""
  return [a.reshape(-1, spec.chunk, *a.shape[1:]) for a in arrays]


def _logits(x, w):
  """A chunk's logits, stored in x's dtype (half the bytes the row kernels read in bfloat16;
  the statistics are float32 again inside them). Asked for in x's dtype, the GEMM still
  accumulates in float32 (cuBLAS's compute type, the MXU's accumulator) and rounds once as it
  writes; asked for in float32 and cast, XLA wrote the float32 logits and converted them in a
  pass of their own (4.2 of 46 ms at 16384 x 2048 x 131072 on an H100, cross-entropy-2)."""
  return jnp.dot(x, w, preferred_element_type=x.dtype)


def _linear_loss(spec: _Linear, x, w, labels):
  w = spec.weight(w)

  def step(_, chunk):
    x_c, labels_c = chunk
    return None, rows.forward(spec.plan, spec.options, _logits(x_c, w), labels_c)
  _, (loss, lse) = lax.scan(step, None, _chunks(spec, x, labels))
  return loss.reshape(-1), lse.reshape(-1)


def _linear_grads(spec: _Linear, x, w, labels, lse, g, grads_dtype=None):
  """(dx, dw) for the per-token cotangent ``g``, chunk by chunk (the logits recomputed when
  ``lse`` is given, else computed with the loss: then (loss, dx, dw)); in x's and w's dtypes,
  or both in ``grads_dtype``."""
  dtype, w_dtype = x.dtype, w.dtype
  w = spec.weight(w)

  def step(dw, chunk):
    x_c, labels_c, g_c, lse_c = chunk
    logits = _logits(x_c, w)
    loss = None
    if lse_c is None:
      loss, _, dlogits = rows.loss_and_backward(spec.plan, spec.options, logits, labels_c, g_c,
                                            dtype)
    else:
      dlogits = rows.backward(spec.plan, spec.options, logits, labels_c, lse_c, g_c, dtype)
    dx = jnp.dot(dlogits, w.T, preferred_element_type=grads_dtype or dtype)
    dw = dw + jnp.dot(x_c.T, dlogits, preferred_element_type=jnp.float32)
    return dw, (loss, dx)

  chunks = _chunks(spec, x, labels, g) + ([None] if lse is None else _chunks(spec, lse))
  dw, (loss, dx) = lax.scan(step, jnp.zeros(w.shape, jnp.float32), tuple(chunks))
  dx, dw = dx.reshape(x.shape), dw.astype(grads_dtype or w_dtype)
  return (dx, dw) if lse is not None else (loss.reshape(-1), dx, dw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _linear_rows(spec, x, w, labels):
  return _linear_loss(spec, x, w, labels)[0]


def _linear_rows_fwd(spec, x, w, labels):
  loss, lse = _linear_loss(spec, x, w, labels)
  return loss, (x, w, labels, lse)


def _linear_rows_bwd(spec, saved, g):
  x, w, labels, lse = saved
  return (*_linear_grads(spec, x, w, labels, lse, g), None)


_linear_rows.defvjp(_linear_rows_fwd, _linear_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _linear_total(spec, x, w, labels, weights):
  """sum(weights * loss): the loss's reductions, whose cotangent is one number."""
  return jnp.sum(weights * _linear_loss(spec, x, w, labels)[0])


def _linear_total_fwd(spec, x, w, labels, weights):
  # The gradients for a cotangent of 1, kept in float32 until the backward scales them by the
  # real one: rounded to x's dtype here and again after the scaling, dW's error at bfloat16 came
  # out up to 1.5x what one rounding gives (past the numerics rule at some draws).
  loss, dx, dw = _linear_grads(spec, x, w, labels, None, weights, jnp.float32)
  return jnp.sum(weights * loss), (dx, dw)


def _linear_total_bwd(spec, saved, g):
  dx, dw = saved
  x_dtype, w_dtype = spec.grad_dtypes
  return (g * dx).astype(x_dtype), (g * dw).astype(w_dtype), None, None


_linear_total.defvjp(_linear_total_fwd, _linear_total_bwd)


@dataclasses.dataclass(frozen=True)
class _VocabSplit:
  """This shard holds w's columns [index * V_local, (index + 1) * V_local) of ``vocab``, the
  mesh axes ``axes`` (linearized in their order) indexing the slices."""

  axes: tuple[str, ...]
  vocab: int


def _in_slice(split: _VocabSplit, spec: _Linear, labels, v_local: int):
  """(the labels as this slice's columns, where the label lies in it, where the row counts):
  a label elsewhere becomes column 0 (the row kernels give NaN for a label outside their
  columns), an ignored row keeps ``ignore_index``."""
  local = labels - lax.axis_index(split.axes) * v_local
  inside = (local >= 0) & (local < v_local)
  kept = rows.kept_tokens(labels, spec.options)
  return jnp.where(inside | ~kept, jnp.where(kept, local, labels), 0), inside & kept, kept


def _vocab_forward(spec: _Linear, split: _VocabSplit, x, w, labels):
  """(loss, lse) per token with w's vocabulary split over ``split.axes``. The log-sum-exp from
  each slice's row kernels, combined by a max and a sum across the slices; z[y] and sum(z)
  from x against w's label columns and column sum: collectives of one number a token, never
  the logits."""
  options, axes = spec.options, split.axes
  wc = spec.weight(w)
  v_local = w.shape[1]
  local, inside, kept = _in_slice(split, spec, labels, v_local)
  _, lse_local = _linear_loss(spec, x, w, local)  # each slice's own log-sum-exp
  peak = lax.stop_gradient(lax.pmax(lse_local, axes))
  peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
  lse = jnp.log(lax.psum(jnp.exp(lse_local - peak), axes)) + peak
  f32 = lambda a: a.astype(jnp.float32)
  columns = jnp.take(wc, jnp.clip(local, 0, v_local - 1), axis=1)  # (D, tokens)
  picked = lax.psum(jnp.where(inside, jnp.einsum("td,dt->t", f32(x), f32(columns)), 0.0), axes)
  loss = lse - picked
  if options.label_smoothing:
    total = lax.psum(jnp.dot(f32(x), jnp.sum(f32(wc), axis=1)), axes)
    loss = loss + options.label_smoothing * (picked - total / split.vocab)
  if options.z_loss:
    loss = loss + options.z_loss * lse * lse
  loss = reference.nan_where(kept & ((labels < 0) | (labels >= split.vocab)), loss)
  return jnp.where(kept, loss, 0.0), lse


def _vocab_grads(spec: _Linear, split: _VocabSplit, x, w, labels, lse, g):
  """(dx's part from this slice, dw's slice) for the per-token cotangent ``g``, the slice's
  logits recomputed chunk by chunk: d loss / d z = g (softmax(z) (1 + 2 z_loss lse) -
  (1 - e) onehot(y) - e / V), the softmax against the whole vocabulary's ``lse``. On the row
  kernels (their vocabulary the slice's), two corrections: a row whose label lies in another
  slice gets back the (1 - e) g the kernel took at its stand-in column 0, and smoothing's
  share is e / V, not e / V_local. shard_map's transpose sums dx over the slices."""
  options, dtype, w_dtype = spec.options, x.dtype, w.dtype
  wc = spec.weight(w)
  v_local = w.shape[1]
  local, inside, kept = _in_slice(split, spec, labels, v_local)
  e = options.label_smoothing

  def dlogits_of(logits, local_c, inside_c, kept_c, lse_c, g_c):
    if spec.plan is None:
      z = logits.astype(jnp.float32)
      p = jnp.exp(z - lse_c[:, None]) * (1 + 2 * options.z_loss * lse_c)[:, None]
      onehot = (jnp.arange(v_local)[None, :] == local_c[:, None]) & inside_c[:, None]
      d = g_c[:, None] * (p - (1 - e) * onehot - e / split.vocab)
      return jnp.where(kept_c[:, None], d, 0.0).astype(dtype)
    d = rows.backward(spec.plan, options, logits, local_c, lse_c, g_c, jnp.float32)
    elsewhere = kept_c & ~inside_c
    d = d.at[:, 0].add(jnp.where(elsewhere, (1 - e) * g_c, 0.0))
    if e:
      d = d + jnp.where(kept_c, g_c * e * (1 / v_local - 1 / split.vocab), 0.0)[:, None]
    return d.astype(dtype)

  def step(dw, chunk):
    x_c, local_c, inside_c, kept_c, lse_c, g_c = chunk
    dlogits = dlogits_of(_logits(x_c, wc), local_c, inside_c, kept_c, lse_c, g_c)
    dx = jnp.dot(dlogits, wc.T, preferred_element_type=dtype)
    dw = dw + jnp.dot(x_c.T, dlogits, preferred_element_type=jnp.float32)
    return dw, dx

  chunks = _chunks(spec, x, local, inside, kept, lse, g)
  dw, dx = lax.scan(step, jnp.zeros(w.shape, jnp.float32), tuple(chunks))
  return dx.reshape(x.shape), dw.astype(w_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _vocab_rows(spec, split, x, w, labels):
  return _vocab_forward(spec, split, x, w, labels)[0]


def _vocab_rows_fwd(spec, split, x, w, labels):
  loss, lse = _vocab_forward(spec, split, x, w, labels)
  return loss, (x, w, labels, lse)


def _vocab_rows_bwd(spec, split, saved, g):
  x, w, labels, lse = saved
  g = lax.psum(g, split.axes)  # each slice's share of the cotangent (_across)
  return (*_vocab_grads(spec, split, x, w, labels, lse, g), None)


_vocab_rows.defvjp(_vocab_rows_fwd, _vocab_rows_bwd)


def _chunk(tokens: int, vocab: int, chunk_size) -> int:
  if chunk_size is not None:
    if (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)
        or chunk_size < 1):
      raise ValueError(f"{LINEAR_OP}: chunk_size must be None or an int >= 1, got "
                       f"{chunk_size!r}")
    return min(int(chunk_size), max(tokens, 1))
  # A power of two of tokens whose float32 logits take about CHUNK_ELEMENTS, 16 at least.
  chunk = max(16, 1 << max(0, (CHUNK_ELEMENTS // max(vocab, 1)).bit_length() - 1))
  return min(chunk, round_up(max(tokens, 1), 16))


def linear_softmax_cross_entropy(x, w, labels, *, label_smoothing: float = 0.0,
                                 z_loss: float = 0.0, ignore_index: int | None = None,
                                 reduction: str = "mean", chunk_size: int | None = None,
                                 labels_checked: bool = False, implementation=None, config=None):
  """``softmax_cross_entropy(x @ w, labels, ...)`` without the (tokens, V) logits in memory.

  The tokens go through in chunks of ``chunk_size`` (default: about 2**28 logits a chunk); a
  chunk's logits are a matmul accumulated in float32 and stored in x's dtype, read by the row
  kernels and gone with the chunk. The matmuls are XLA's (cuBLAS, the TPU's MXU); the gradients
  are x's dtype for x and w's for w, accumulated in float32.

  Args:
    x: (..., D) the final hidden states, bfloat16, float16 or float32.
    w: (D, V) the output projection (a tied embedding's transpose).
    labels: (...) integers, shaped like x without its last axis.
    label_smoothing, z_loss, ignore_index, reduction, labels_checked: as for
      :func:`softmax_cross_entropy`.
    chunk_size: tokens a chunk, or None.
    implementation: None (best available), "xla", "mosaic_gpu" (Hopper), "triton" or
      "mosaic_tpu": the row kernels'.
    config: their Config (for a (chunk, V) problem of x's dtype); None picks one.

  On a mesh, x's tokens and w's vocabulary split (the logical axes "batch", ..., and "vocab"
  on Auto axes): a vocabulary split over some axes is vocabulary parallel, each device's row
  kernels running on its slice of the vocabulary, the slices' statistics combined by
  collectives of one number a token.
  """
  if labels_checked and hasattr(w, "shape") and len(w.shape) == 2:
    rows.check_range(LINEAR_OP, labels, w.shape[-1], ignore_index)
  return backend.call(_LINEAR_OP, implementation, config, x=x, w=w, labels=labels,
                      label_smoothing=label_smoothing, z_loss=z_loss, ignore_index=ignore_index,
                      reduction=reduction, chunk_size=chunk_size)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Args(backend.Args):
  """A call's validated arguments: x (..., D), w (D, V), int32 labels (...); and two knobs
  only the split sets (:func:`_across`): ``w_compute``, the dtype w's products run in where w
  comes wider (float32, for dw summed over the shards in float32); ``vocab_split``, this
  shard holds a slice of w's vocabulary (:class:`_VocabSplit`)."""

  x: jax.Array
  w: jax.Array
  labels: jax.Array
  options: Options
  reduction: str
  chunk_size: int | None
  w_compute: Any = None
  vocab_split: _VocabSplit | None = None


def _validate(x, w, labels, *, label_smoothing, z_loss, ignore_index, reduction, chunk_size,
              labels_checked=False) -> Args:
  del labels_checked  # the public op's to act on
  op = LINEAR_OP
  x = _checks.array(op, "x", x)
  w = _checks.array(op, "w", w, min_rank=2)
  if w.ndim != 2 or w.shape[0] != x.shape[-1] or w.shape[1] == 0:
    raise ValueError(f"{op}: w must be (D, V) with D = x's last dimension {x.shape[-1]} and "
                     f"V > 0, got {tuple(w.shape)}")
  labels = rows.check_labels(op, labels, x.shape[:-1], "x without its last axis")
  _chunk(1, w.shape[1], chunk_size)  # checks it
  return Args(x=x, w=w, labels=labels,
              options=rows.check_options(op, label_smoothing, z_loss, ignore_index, reduction),
              reduction=reduction, chunk_size=chunk_size)


def _problem(args: Args) -> rows.Problem:
  """The fused loss's problem: its row kernels' on a chunk's (chunk, V) logits in x's dtype."""
  x, w = args.x, args.w
  chunk = _chunk(math.prod(x.shape[:-1]), w.shape[1], args.chunk_size)
  return rows.Problem.of(jax.ShapeDtypeStruct((chunk, w.shape[1]), x.dtype))


def _loss(plan: dispatch.Plan | None, args: Args):
  """The fused loss on one device (or shard), on ``plan``'s row kernels (None: the
  reference's math, chunk by chunk the same)."""
  x, w, labels, options, split = args.x, args.w, args.labels, args.options, args.vocab_split
  tokens, vocab = math.prod(x.shape[:-1]), w.shape[1]
  chunk = _chunk(tokens, vocab, args.chunk_size)
  padded = round_up(max(tokens, 1), chunk)
  flat_x = jnp.pad(x.reshape(tokens, -1), ((0, padded - tokens), (0, 0)))
  flat_labels = jnp.pad(labels.reshape(tokens), (0, padded - tokens))
  valid = jnp.arange(padded) < tokens
  spec = _Linear(plan, options, chunk, (jnp.dtype(x.dtype), jnp.dtype(w.dtype)),
                 args.w_compute)
  if args.reduction == "none":
    loss = (_linear_rows(spec, flat_x, w, flat_labels) if split is None else
            _vocab_rows(spec, split, flat_x, w, flat_labels))
    return loss[:tokens].reshape(labels.shape)
  # The padding's weight is 0; an ignored token's loss and gradient are 0 in the row kernels.
  weights = valid.astype(jnp.float32)
  if args.reduction == "mean":
    weights = weights / jnp.maximum(rows.count(flat_labels, options, valid), 1.0)
  weights = lax.stop_gradient(weights)
  if split is not None:
    return jnp.sum(weights * _vocab_rows(spec, split, flat_x, w, flat_labels))
  return _linear_total(spec, flat_x, w, flat_labels, weights)


def _whole(args: Args):
  """The fused loss as plain jnp on the whole logits, x @ w in float32 (the reference's
  math): what forward-mode differentiation runs, since the chunked loss (kernels or not) is
  a custom_vjp. It holds the (tokens, V) logits that the chunks never do."""
  if args.vocab_split is not None:
    raise NotImplementedError(
        f"{LINEAR_OP}: forward-mode differentiation (jax.jvp, jax.jacfwd, jax.hessian) of the "
        "loss with w's vocabulary split over devices; gather w (or use a mesh that does not "
        "split the vocabulary), or differentiate in reverse mode (jax.grad)")
  loss, _ = reference.linear_softmax_cross_entropy(args.x, args.w, args.labels,
                                                   **args.options.kwargs())
  if args.reduction == "none":
    return loss
  if args.reduction == "mean":
    return jnp.sum(loss) / jnp.maximum(rows.count(args.labels, args.options), 1.0)
  return jnp.sum(loss)


def _rule(args: Args) -> partitioning.Rule:
  """The fused loss's split rule: x's tokens (its leading dimensions; the labels' with them)
  split freely, and so does w's vocabulary (vocabulary parallel: each slice's statistics are
  combined by collectives of one number a token); D is contracted over, so x's D and w's stay
  whole. On a mesh of Auto axes: x's tokens as "batch", "length", ..., D as "embed"; w as
  ("embed", "vocab"). w is a weight: split over data-like axes (fully sharded data
  parallelism) it is gathered in the map, dw reduce-scattered."""
  tokens = partitioning.row_dims(args.x.ndim, "embed", label="tokens")
  return {"x": (*tokens, Whole("embed")),
          "w": (Whole("embed", why="each token's logits contract over it", weight=True),
                Free("vocab", "vocab", label="vocabulary", weight=True)),
          "labels": tokens}


def _across(where: partitioning.Split, rule: partitioning.Rule, local: backend.Local,
            args: Args):
  """The fused loss on a mesh (Explicit axes, or Auto axes in context, split by the rules):
  each shard of tokens runs it with its slice of w's vocabulary (all of it where the
  vocabulary is whole); the shards' sums and token counts are added after. dw sums over the
  token shards (shard_map's transpose of w's replication), in float32, rounded to a 16-bit
  w's dtype once after the sum (w enters the shards as float32, its products still run in its
  dtype); dx over the vocabulary's slices likewise."""
  x, w, labels, options, reduction = args.x, args.w, args.labels, args.options, args.reduction
  tokens = rule["labels"]
  token_groups = [d.group for d in tokens]
  vocab_axes = where.axes("vocab")
  split = _VocabSplit(vocab_axes, w.shape[1]) if vocab_axes else None
  wire, w_compute = {}, None
  if where.size(*token_groups) > 1 and jnp.dtype(w.dtype).itemsize < 4:
    w_compute, w = w.dtype, w.astype(jnp.float32)
    wire = {"w": w_compute}  # gathered over data-like axes (fsdp) in its own dtype

  # Under a split vocabulary every slice holds the same losses: each returns its copy along a
  # leading axis over the slices, and their mean is taken outside. Returned as one copy (an
  # output that does not vary over those axes), shard_map's transpose hands each slice a
  # share of the cotangent; as copies, each gets its own, and _vocab_rows_bwd sums them.
  copies = where.size("vocab")

  def call(x, w, labels):
    if reduction == "none":
      loss = local(x=x, w=w, labels=labels, w_compute=w_compute, vocab_split=split)
      return loss if split is None else loss[None]
    total = local(x=x, w=w, labels=labels, reduction="sum", w_compute=w_compute,
                  vocab_split=split)
    return jnp.stack([total, rows.count(labels, options)])[None]

  if reduction == "none":
    out_dims = tokens if split is None else P(partitioning.entry(vocab_axes),
                                              *where.spec(tokens))
  else:
    out_dims = P(partitioning.entry(where.axes(*token_groups) + vocab_axes), None)
  out = where.run(call, {"x": x, "w": w, "labels": labels}, rule, out_dims, wire=wire)
  if reduction == "none":
    return out if split is None else jnp.sum(out, axis=0) / copies
  # Summed over the shards first, then indexed: the sum's transpose keeps the cotangent split
  # as ``out`` is. Sliced first (out[:, 0]), jax 0.11's transpose of the slice pads an
  # unsplit cotangent, and the train step's grad failed ("Expected cotangent type
  # float32[1@(data,fsdp),2] but got float32[1,2]"); jax 0.10 did not check the type.
  sums = jnp.sum(out, axis=0) / copies
  total, count = sums[0], lax.stop_gradient(sums[1])
  return total if reduction == "sum" else total / jnp.maximum(count, 1.0)


_LINEAR_OP = backend.register(backend.Op(
    name=LINEAR_OP, kernels=rows.KERNELS, validate=_validate, problem=_problem,
    reference=lambda args: _loss(None, args), kernel=_loss,
    options=lambda args: args.options.kwargs(),
    empty=lambda args: math.prod(args.x.shape[:-1]) == 0,
    rule=_rule, across=_across, xla_too=True, forward=_whole,
), linear_softmax_cross_entropy)
