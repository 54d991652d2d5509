"""Softmax cross-entropy, on logits and fused with the output projection: validation, dispatch
and the custom_vjp boundaries.

``softmax_cross_entropy`` runs the row kernels (loss and log-sum-exp in one read of the logits;
their gradient in one more read and one write). ``linear_softmax_cross_entropy`` never holds
the (tokens, vocab) logits: it walks the tokens in chunks, each chunk's logits a matmul (float32
accumulation, stored in x's dtype as an unfused model's are) that the row kernels read and that
dies with the chunk. Reduced to a mean or a sum, the loss's
cotangent is one number, so the forward computes the gradients as it goes (the chunk's logits
gradient, then dx and dW from it: three matmuls a chunk, as an unfused forward and backward
take) and the backward only scales them. Unreduced, the backward recomputes each chunk's logits
(a fourth matmul) for the per-token cotangents.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxkernels import _checks, backend, partitioning
from jaxkernels._tiling import bucket, round_up
from jaxkernels.ops.cross_entropy import mosaic_tpu, reference, triton
from jaxkernels.partitioning import Free, Whole

# The public names: warnings, errors, supports() and the tuning tables say these.
OP = "softmax_cross_entropy"
LINEAR_OP = "linear_softmax_cross_entropy"
REDUCTIONS = ("mean", "sum", "none")
# A chunk's logits: 512 MiB of bfloat16. Fewer, larger chunks read and write dW's float32
# accumulator fewer times (2 GiB a chunk at D=2048, V=128K).
CHUNK_ELEMENTS = 1 << 28


@dataclasses.dataclass(frozen=True)
class Problem:
  """One call as the row kernels see it: the logits as (M, V) rows."""

  logits: jax.ShapeDtypeStruct

  @classmethod
  def of(cls, logits) -> Problem:
    rows = math.prod(logits.shape[:-1])
    return cls(jax.ShapeDtypeStruct((rows, logits.shape[-1]), logits.dtype))

  def key(self) -> str:
    rows, cols = self.logits.shape
    return f"{self.logits.dtype}|{bucket(rows)}x{cols}"

  def reason(self) -> str | None:
    return _checks.kernel_dtype_reason(logits=self.logits)

  def __str__(self) -> str:
    return f"cross-entropy of {self.logits.shape} {self.logits.dtype} logits"


@dataclasses.dataclass(frozen=True)
class _Options:
  label_smoothing: float
  z_loss: float
  ignore_index: int | None

  def kwargs(self) -> dict:
    return dataclasses.asdict(self)


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #


def _labels(op, labels, shape, against):
  if not (hasattr(labels, "shape") and hasattr(labels, "dtype")):
    labels = jnp.asarray(labels)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"{op}: labels must have an integer dtype, got {labels.dtype}")
  if tuple(labels.shape) != tuple(shape):
    raise ValueError(f"{op}: labels must have the shape of {against}, {tuple(shape)}, got "
                     f"{tuple(labels.shape)}")
  return labels.astype(jnp.int32)


def _options(op, label_smoothing, z_loss, ignore_index, reduction) -> _Options:
  for name, value, ok, accepted in (
      ("label_smoothing", label_smoothing, lambda v: 0 <= v < 1, "a float in [0, 1)"),
      ("z_loss", z_loss, lambda v: 0 <= v < math.inf, "a finite float >= 0")):
    if (isinstance(value, (bool, jax.core.Tracer)) or not isinstance(value, numbers.Real)
        or not ok(float(value))):
      raise ValueError(f"{op}: {name} must be {accepted} (a Python number), got {value!r}")
  if ignore_index is not None and (isinstance(ignore_index, bool)
                                   or not isinstance(ignore_index, numbers.Integral)
                                   or not -2**31 <= ignore_index < 2**31):
    raise ValueError(f"{op}: ignore_index must be None or a Python int (int32), got "
                     f"{ignore_index!r}")
  _checks.choice(op, "reduction", reduction, REDUCTIONS)
  return _Options(float(label_smoothing), float(z_loss),
                  None if ignore_index is None else int(ignore_index))


def _reduce(loss, labels, options: _Options, reduction: str, valid=None):
  """The per-token ``loss`` reduced: a mean over the tokens not ignored (and ``valid`` where
  given; 0 where there are none), a sum, or as it is."""
  if reduction == "none":
    return loss
  if reduction == "sum":
    return jnp.sum(loss)
  return jnp.sum(loss) / jnp.maximum(_count(labels, options, valid), 1.0)


def _kept(labels, options: _Options):
  """Where a token counts: its label is not ``ignore_index``."""
  return jnp.ones(labels.shape, bool) if options.ignore_index is None else (
      labels != options.ignore_index)


def _count(labels, options: _Options, valid=None):
  kept = _kept(labels, options)
  if valid is not None:
    kept = kept & valid
  return jnp.sum(kept, dtype=jnp.float32)


# --------------------------------------------------------------------------- #
# The rows: kernels or the reference
# --------------------------------------------------------------------------- #


def _forward(plan, options: _Options, logits, labels):
  """(loss, lse) of (M, V) rows."""
  if plan is None:
    return reference.softmax_cross_entropy(logits, labels, **options.kwargs())
  return plan.run(plan.kernels.forward, logits, labels)


def _backward(plan, options: _Options, logits, labels, lse, g, dtype):
  """d loss / d logits of (M, V) rows for the per-row cotangent ``g``, in ``dtype``."""
  if plan is None:
    loss = lambda z: reference.softmax_cross_entropy(z, labels, **options.kwargs())[0]
    return jax.vjp(loss, logits.astype(jnp.float32))[1](g)[0].astype(dtype)
  return plan.run(plan.kernels.backward, logits, labels, lse, g, dtype=dtype)


def _loss_and_backward(plan, options: _Options, logits, labels, g, dtype):
  """(loss, lse, dlogits) of (M, V) rows: on the kernels, one launch where the backend fuses
  them (Triton: dlogits written over the logits, which are spent)."""
  if plan is None:
    loss, lse = _forward(plan, options, logits, labels)
    return loss, lse, _backward(plan, options, logits, labels, lse, g, dtype)
  return plan.run(plan.kernels.backward, logits, labels, None, g, dtype=dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rows(plan, options, logits, labels):
  return _forward(plan, options, logits, labels)[0]


def _rows_fwd(plan, options, logits, labels):
  loss, lse = _forward(plan, options, logits, labels)
  return loss, (logits, labels, lse)


def _rows_bwd(plan, options, saved, g):
  logits, labels, lse = saved
  return _backward(plan, options, logits, labels, lse, g, logits.dtype), None


_rows.defvjp(_rows_fwd, _rows_bwd)


def _validate(logits, labels, *, label_smoothing, z_loss, ignore_index, reduction, axis=-1,
              where=None, labels_checked=False):
  """The arguments checked. The public op puts optax's ``axis`` and a token-wise ``where`` in
  the kernels' form before it calls here (``_optax_form``); ``supports`` calls here with them
  as given."""
  del labels_checked  # the public op's to act on
  logits, labels, where, ignore_index = _optax_form(logits, labels, axis, where, ignore_index)
  if where is not None:
    raise ValueError(f"{OP}: a where shaped like logits (a mask of classes) runs on XLA's path "
                     "alone: the kernels read whole rows")
  if logits.shape[-1] == 0:
    raise ValueError(f"{OP}: logits must have at least one class (a last axis > 0), got shape "
                     f"{tuple(logits.shape)}")
  return dict(logits=logits,
              labels=_labels(OP, labels, logits.shape[:-1], "logits without its last axis"),
              options=_options(OP, label_smoothing, z_loss, ignore_index, reduction),
              reduction=reduction)


def _kernel(plan, logits, labels, options: _Options, reduction):
  vocab = logits.shape[-1]
  loss = _rows(plan, options, logits.reshape(-1, vocab), labels.reshape(-1))
  return _reduce(loss.reshape(labels.shape), labels, options, reduction)


def _reference(logits, labels, options: _Options, reduction):
  loss = reference.softmax_cross_entropy(logits, labels, **options.kwargs())[0]
  return _reduce(loss, labels, options, reduction)


def _rule(logits, **unused):
  """The tokens split freely (the labels' with the logits'); the classes are reduced over."""
  tokens = partitioning.row_dims(logits.ndim, "vocab")
  return {"logits": (*tokens, Whole("vocab")), "labels": tokens}


def _across(where, rule, local, *, logits, labels, options: _Options, reduction):
  """Each shard's per-token loss, then reduced over them all (XLA's sum across shards)."""
  loss = where.run(lambda **shards: local(**shards, reduction="none"),
                   {"logits": logits, "labels": labels}, rule, rule["labels"])
  return _reduce(loss, labels, options, reduction)


def softmax_cross_entropy(logits, labels, *, label_smoothing: float = 0.0, z_loss: float = 0.0,
                          ignore_index: int | None = None, reduction: str = "mean",
                          axis: int | tuple[int, ...] = -1, where=None,
                          labels_checked: bool = False, implementation=None, config=None):
  """Softmax cross-entropy of integer labels, statistics in float32.

  Per token, with V classes: ``logsumexp(z) - z[label] + e (z[label] - sum(z) / V)`` (label
  smoothing e: the cross-entropy against (1 - e) onehot + e / V) ``+ z_loss *
  logsumexp(z)**2`` (PaLM's z-loss). A token whose label is ``ignore_index`` gives 0 and no
  gradient, and is left out of the mean; a label outside [0, V) otherwise gives NaN.

  Args:
    logits: (..., V) bfloat16, float16 or float32.
    labels: (...) integers.
    label_smoothing, z_loss: Python floats, in [0, 1) and >= 0.
    ignore_index: None, or the label that marks padding (e.g. -100).
    reduction: "mean" (over the tokens not ignored; 0 if none is), "sum" or "none" (float32,
      shaped like ``labels``).
    axis: the classes' axis, or axes (as optax's: a label is then a flat index into their
      slice of ``logits``); moved last (a transpose where it is not already).
    where: as optax's: None, a boolean mask shaped like ``labels`` (the tokens that count: one
      that does not gives 0 and no gradient and is left out of the mean, as an ignored one),
      or shaped like ``logits`` (the classes each token's softmax takes in; a token with none
      gives 0 and is left out of the mean). The class-wise mask runs XLA's path (the
      kernels read whole rows) and takes no ``label_smoothing``.
    labels_checked: raise a ValueError naming the first label outside [0, V) (other than
      ``ignore_index``) instead of giving it NaN: at once for labels known now, and for traced
      ones (under jit) when the computation runs (a host callback: its error reaches the
      caller as the runtime's, at the next read of a result).
    implementation: None (best available), "xla", "triton" or "mosaic_tpu".
    config: the chosen kernel's Config; None picks one for the shape and device.

  Where it differs from optax's ``softmax_cross_entropy_with_integer_labels`` on purpose: it
  reduces to the mean by default (``reduction="none"`` gives optax's per-token losses), and a
  label outside [0, V) gives NaN rather than a loss read off a clipped index.
  """
  logits, labels, where, ignore_index = _optax_form(logits, labels, axis, where, ignore_index)
  if labels_checked:
    _check_range(OP, labels, logits.shape[-1], ignore_index)
  if where is not None:  # class-wise: XLA's path
    return _class_masked(logits, labels, where, label_smoothing=label_smoothing,
                         z_loss=z_loss, ignore_index=ignore_index, reduction=reduction)
  return backend.call(_OP, implementation, config, logits=logits, labels=labels,
                      label_smoothing=label_smoothing, z_loss=z_loss, ignore_index=ignore_index,
                      reduction=reduction)


def _check_range(op, labels, vocab, ignore_index):
  """labels_checked: a ValueError naming the first label outside [0, vocab) that is not
  ``ignore_index``, now for concrete labels, when the computation runs for traced ones."""
  if not (hasattr(labels, "shape") and hasattr(labels, "dtype")):
    labels = jnp.asarray(labels)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    return  # _labels names the dtype

  def check(values):
    values = np.asarray(values)
    bad = (values < 0) | (values >= vocab)
    if ignore_index is not None:
      bad &= values != ignore_index
    if bad.any():
      where = tuple(int(i) for i in np.argwhere(bad)[0])
      ignored = "" if ignore_index is None else f", or ignore_index {ignore_index}"
      raise ValueError(f"{op}: labels must be in [0, {vocab}) (the classes{ignored}); "
                       f"labels{list(where)} is {int(values[where])} ({int(bad.sum())} such)")

  if isinstance(labels, jax.core.Tracer):
    jax.debug.callback(check, labels)
  else:
    check(labels)


# Where a token-shaped ``where`` marks tokens out and no ignore_index is given, their labels
# become this one (no class is negative), ignored.
_MASKED = -(2 ** 31)


def _optax_form(logits, labels, axis, where, ignore_index):
  """(logits with the classes last (flattened where ``axis`` is a tuple), labels, a
  class-wise ``where`` or None, ignore_index): optax's ``axis`` and ``where`` in the form the
  kernels take; a token-wise ``where`` becomes ignored labels."""
  logits = _checks.array(OP, "logits", logits)
  if isinstance(axis, bool) or not isinstance(axis, (numbers.Integral, tuple)) or (
      isinstance(axis, tuple) and not all(isinstance(a, numbers.Integral)
                                          and not isinstance(a, bool) for a in axis)):
    raise TypeError(f"{OP}: axis must be an int or a tuple of ints, got {axis!r}")
  axes = (axis,) if isinstance(axis, numbers.Integral) else axis
  rank = logits.ndim
  if not axes or any(not -rank <= a < rank for a in axes):
    raise ValueError(f"{OP}: axis {axis!r} is out of range for logits of rank {rank}")
  axes = tuple(int(a) % rank for a in axes)
  if len(set(axes)) != len(axes):
    raise ValueError(f"{OP}: axis {axis!r} repeats an axis")
  shape = tuple(logits.shape)
  tokens = tuple(d for d in range(rank) if d not in axes)
  token_shape = tuple(shape[d] for d in tokens)
  if where is not None:
    if not (hasattr(where, "shape") and hasattr(where, "dtype")):
      where = jnp.asarray(where)
    if where.dtype != jnp.bool_:
      raise TypeError(f"{OP}: where must be a boolean array, got {where.dtype}")
    if tuple(where.shape) not in (token_shape, shape):
      raise ValueError(f"{OP}: where must be shaped like labels {token_shape} or like logits "
                       f"{shape}, got {tuple(where.shape)}")
  if axes != (rank - 1,):
    logits = jnp.transpose(logits, tokens + axes).reshape(*token_shape, -1)
    if where is not None and tuple(where.shape) == shape:
      where = jnp.transpose(where, tokens + axes).reshape(*token_shape, -1)
  if where is not None and tuple(where.shape) == token_shape:  # tokens that count
    labels = _labels(OP, labels, token_shape, "logits without its class axes")
    ignore_index = _MASKED if ignore_index is None else ignore_index
    labels = jnp.where(where, labels, jnp.int32(ignore_index))
    where = None
  return logits, labels, where, ignore_index


def _class_masked(logits, labels, where, *, label_smoothing, z_loss, ignore_index, reduction):
  """optax's class-wise ``where``: each token's log-sum-exp over the classes it takes in, its
  label's logit subtracted; 0 (and left out of the mean) for a token that takes in none."""
  labels = _labels(OP, labels, logits.shape[:-1], "logits without its class axes")
  options = _options(OP, label_smoothing, z_loss, ignore_index, reduction)
  if options.label_smoothing:
    raise ValueError(f"{OP}: a where shaped like logits (a mask of classes) takes no "
                     f"label_smoothing (the smoothed target's classes would be ambiguous), got "
                     f"{label_smoothing}")
  z = logits.astype(jnp.float32)
  vocab = z.shape[-1]
  lse = jax.nn.logsumexp(z, axis=-1, where=where)
  picked = jnp.take_along_axis(z, jnp.clip(labels, 0, vocab - 1)[..., None], axis=-1)[..., 0]
  loss = lse - picked + options.z_loss * lse * lse
  takes_in = jnp.any(where, axis=-1)
  kept = takes_in & _kept(labels, options)
  loss = reference.nan_where(kept & ((labels < 0) | (labels >= vocab)), loss)
  loss = jnp.where(kept, loss, 0.0)
  return _reduce(loss, labels, options, reduction, valid=takes_in)


# --------------------------------------------------------------------------- #
# Fused with the output projection
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class _Linear:
  """What a linear cross-entropy call fixes: the row kernels' plan (None: the reference's
  math), its options, the chunk of tokens."""

  plan: backend.Plan | None
  options: _Options
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
    return None, _forward(spec.plan, spec.options, _logits(x_c, w), labels_c)
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
      loss, _, dlogits = _loss_and_backward(spec.plan, spec.options, logits, labels_c, g_c,
                                            dtype)
    else:
      dlogits = _backward(spec.plan, spec.options, logits, labels_c, lse_c, g_c, dtype)
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
  kept = _kept(labels, spec.options)
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
    d = _backward(spec.plan, options, logits, local_c, lse_c, g_c, jnp.float32)
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
  g = lax.psum(g, split.axes)  # each slice's share of the cotangent (_linear_across)
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
    implementation: None (best available), "xla", "triton" or "mosaic_tpu": the row kernels'.
    config: their Config (for a (chunk, V) problem of x's dtype); None picks one.

  On a mesh, x's tokens and w's vocabulary split (the logical axes "batch", ..., and "vocab"
  on Auto axes): a vocabulary split over some axes is vocabulary parallel, each device's row
  kernels running on its slice of the vocabulary, the slices' statistics combined by
  collectives of one number a token.
  """
  if labels_checked and hasattr(w, "shape") and len(w.shape) == 2:
    _check_range(LINEAR_OP, labels, w.shape[-1], ignore_index)
  return backend.call(_LINEAR_OP, implementation, config, x=x, w=w, labels=labels,
                      label_smoothing=label_smoothing, z_loss=z_loss, ignore_index=ignore_index,
                      reduction=reduction, chunk_size=chunk_size)


def _validate_linear(x, w, labels, *, label_smoothing, z_loss, ignore_index, reduction,
                     chunk_size, labels_checked=False):
  del labels_checked  # the public op's to act on
  op = LINEAR_OP
  x = _checks.array(op, "x", x)
  w = _checks.array(op, "w", w, min_rank=2)
  if w.ndim != 2 or w.shape[0] != x.shape[-1] or w.shape[1] == 0:
    raise ValueError(f"{op}: w must be (D, V) with D = x's last dimension {x.shape[-1]} and "
                     f"V > 0, got {tuple(w.shape)}")
  labels = _labels(op, labels, x.shape[:-1], "x without its last axis")
  _chunk(1, w.shape[1], chunk_size)  # checks it
  # w_compute: the dtype w's products run in where w comes wider; vocab_split: the mesh axes
  # w's vocabulary is split over and the whole vocabulary's size (both set only by
  # _linear_across).
  return dict(x=x, w=w, labels=labels,
              options=_options(op, label_smoothing, z_loss, ignore_index, reduction),
              reduction=reduction, chunk_size=chunk_size, w_compute=None, vocab_split=None)


def _linear_problem(x, w, chunk_size, **unused):
  """The fused loss's problem: its row kernels' on a chunk's (chunk, V) logits in x's dtype."""
  chunk = _chunk(math.prod(x.shape[:-1]), w.shape[1], chunk_size)
  return Problem.of(jax.ShapeDtypeStruct((chunk, w.shape[1]), x.dtype))


def _linear(plan, x, w, labels, options: _Options, reduction, chunk_size, w_compute,
            vocab_split=None):
  """The fused loss on one device (or shard), on ``plan``'s row kernels (None: the
  reference's math, chunk by chunk the same); ``vocab_split``: this shard holds a slice of w's
  vocabulary (:class:`_VocabSplit`)."""
  tokens, vocab = math.prod(x.shape[:-1]), w.shape[1]
  chunk = _chunk(tokens, vocab, chunk_size)
  padded = round_up(max(tokens, 1), chunk)
  flat_x = jnp.pad(x.reshape(tokens, -1), ((0, padded - tokens), (0, 0)))
  flat_labels = jnp.pad(labels.reshape(tokens), (0, padded - tokens))
  valid = jnp.arange(padded) < tokens
  spec = _Linear(plan, options, chunk, (jnp.dtype(x.dtype), jnp.dtype(w.dtype)), w_compute)
  if reduction == "none":
    loss = (_linear_rows(spec, flat_x, w, flat_labels) if vocab_split is None else
            _vocab_rows(spec, vocab_split, flat_x, w, flat_labels))
    return loss[:tokens].reshape(labels.shape)
  # The padding's weight is 0; an ignored token's loss and gradient are 0 in the row kernels.
  weights = valid.astype(jnp.float32)
  if reduction == "mean":
    weights = weights / jnp.maximum(_count(flat_labels, options, valid), 1.0)
  weights = lax.stop_gradient(weights)
  if vocab_split is not None:
    return jnp.sum(weights * _vocab_rows(spec, vocab_split, flat_x, w, flat_labels))
  return _linear_total(spec, flat_x, w, flat_labels, weights)


def _linear_whole(x, w, labels, options: _Options, reduction, chunk_size, w_compute,
                  vocab_split=None):
  """The fused loss as plain jnp on the whole logits, x @ w in float32 (the reference's
  math): what forward-mode differentiation runs, since the chunked loss (kernels or not) is
  a custom_vjp. It holds the (tokens, V) logits that the chunks never do."""
  del chunk_size, w_compute
  if vocab_split is not None:
    raise NotImplementedError(
        f"{LINEAR_OP}: forward-mode differentiation (jax.jvp, jax.jacfwd, jax.hessian) of the "
        "loss with w's vocabulary split over devices; gather w (or use a mesh that does not "
        "split the vocabulary), or differentiate in reverse mode (jax.grad)")
  loss, _ = reference.linear_softmax_cross_entropy(x, w, labels, **options.kwargs())
  if reduction == "none":
    return loss
  if reduction == "mean":
    return jnp.sum(loss) / jnp.maximum(_count(labels, options), 1.0)
  return jnp.sum(loss)


def _linear_rule(x, **unused):
  """The fused loss's split rule: x's tokens (its leading dimensions; the labels' with them)
  split freely, and so does w's vocabulary (vocabulary parallel: each slice's statistics are
  combined by collectives of one number a token); D is contracted over, so x's D and w's stay
  whole. On a mesh of Auto axes: x's tokens as "batch", "length", ..., D as "embed"; w as
  ("embed", "vocab"). w is a weight: split over data-like axes (fully sharded data
  parallelism) it is gathered in the map, dw reduce-scattered."""
  rows = partitioning.row_dims(x.ndim, "embed", label="tokens")
  return {"x": (*rows, Whole("embed")),
          "w": (Whole("embed", why="each token's logits contract over it", weight=True),
                Free("vocab", "vocab", label="vocabulary", weight=True)),
          "labels": rows}


def _linear_across(where, rule, local, *, x, w, labels, options: _Options, reduction,
                   chunk_size, w_compute, vocab_split):
  """The fused loss on a mesh (Explicit axes, or Auto axes in context, split by the rules):
  each shard of tokens runs it with its slice of w's vocabulary (all of it where the
  vocabulary is whole); the shards' sums and token counts are added after. dw sums over the
  token shards (shard_map's transpose of w's replication), in float32, rounded to a 16-bit
  w's dtype once after the sum (w enters the shards as float32, its products still run in its
  dtype); dx over the vocabulary's slices likewise."""
  del vocab_split
  rows = rule["labels"]
  row_groups = [d.group for d in rows]
  vocab_axes = where.axes("vocab")
  split = _VocabSplit(vocab_axes, w.shape[1]) if vocab_axes else None
  wire = {}
  if where.size(*row_groups) > 1 and jnp.dtype(w.dtype).itemsize < 4:
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
    return jnp.stack([total, _count(labels, options)])[None]

  if reduction == "none":
    out_dims = rows if split is None else P(partitioning.entry(vocab_axes), *where.spec(rows))
  else:
    out_dims = P(partitioning.entry(where.axes(*row_groups) + vocab_axes), None)
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


_KERNELS = {
    "triton": backend.Kernels.of(OP, "triton", triton, forward=triton.forward,
                                 backward=triton.backward),
    "mosaic_tpu": backend.Kernels.of(OP, "mosaic_tpu", mosaic_tpu, forward=mosaic_tpu.forward,
                                     backward=mosaic_tpu.backward),
}
_OP = backend.register(backend.Op(
    name=OP, kernels=_KERNELS, validate=_validate,
    problem=lambda logits, **unused: Problem.of(logits),
    reference=_reference, kernel=_kernel,
    options=lambda options, **unused: options.kwargs(),
    rule=_rule, across=_across,
), softmax_cross_entropy)
# The fused loss runs the same row kernels, on a chunk's logits (supports() asks them so).
_LINEAR_OP = backend.register(backend.Op(
    name=LINEAR_OP, kernels=_KERNELS, validate=_validate_linear, problem=_linear_problem,
    reference=functools.partial(_linear, None), kernel=_linear,
    options=lambda options, **unused: options.kwargs(),
    empty=lambda x, **unused: math.prod(x.shape[:-1]) == 0,
    rule=_linear_rule, across=_linear_across, xla_too=True, forward=_linear_whole,
), linear_softmax_cross_entropy)
