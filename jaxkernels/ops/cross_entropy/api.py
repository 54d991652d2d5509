"""softmax_cross_entropy: validation, dispatch, sharding and the custom_vjp boundary.

The row kernels take the loss and log-sum-exp in one read of the logits, and their gradient in
one more read and one write (``rows``). optax's ``axis`` and ``where`` are put in the kernels'
form first; a class-wise ``where`` runs XLA's path (no kernel takes it: dispatch falls back,
or refuses a kernel named).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp

from jaxkernels import _checks, backend, dispatch, partitioning
from jaxkernels.ops.cross_entropy import reference, rows
from jaxkernels.ops.cross_entropy.rows import OP, REDUCTIONS, Options
from jaxkernels.partitioning import Whole

__all__ = ["REDUCTIONS", "softmax_cross_entropy"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rows(plan, options, logits, labels):
  return rows.forward(plan, options, logits, labels)[0]


def _rows_fwd(plan, options, logits, labels):
  loss, lse = rows.forward(plan, options, logits, labels)
  return loss, (logits, labels, lse)


def _rows_bwd(plan, options, saved, g):
  logits, labels, lse = saved
  return rows.backward(plan, options, logits, labels, lse, g, logits.dtype), None


_rows.defvjp(_rows_fwd, _rows_bwd)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Args(backend.Args):
  """A call's validated arguments: logits (..., V) with the classes last, int32 labels (...),
  and optax's class-wise ``where`` shaped like the logits (or None)."""

  logits: jax.Array
  labels: jax.Array
  options: Options
  reduction: str
  where: jax.Array | None = None


def _validate(logits, labels, *, label_smoothing, z_loss, ignore_index, reduction, axis=-1,
              where=None, labels_checked=False) -> Args:
  """The arguments checked. The public op puts optax's ``axis`` and a token-wise ``where`` in
  the kernels' form before it calls here (``_optax_form``); ``supports`` calls here with them
  as given."""
  del labels_checked  # the public op's to act on
  logits, labels, where, ignore_index = _optax_form(logits, labels, axis, where, ignore_index)
  if logits.shape[-1] == 0:
    raise ValueError(f"{OP}: logits must have at least one class (a last axis > 0), got shape "
                     f"{tuple(logits.shape)}")
  if where is not None and label_smoothing:
    raise ValueError(f"{OP}: a where shaped like logits (a mask of classes) takes no "
                     f"label_smoothing (the smoothed target's classes would be ambiguous), got "
                     f"{label_smoothing}")
  return Args(logits=logits,
              labels=rows.check_labels(OP, labels, logits.shape[:-1],
                                       "logits without its last axis"),
              options=rows.check_options(OP, label_smoothing, z_loss, ignore_index,
                                         reduction),
              reduction=reduction, where=where)


def _kernel(plan: dispatch.Plan, args: Args):
  logits, labels = args.logits, args.labels
  loss = _rows(plan, args.options, logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
  return rows.reduce_loss(loss.reshape(labels.shape), labels, args.options, args.reduction)


def _reference(args: Args):
  if args.where is not None:
    return _class_masked(args)
  loss = reference.softmax_cross_entropy(args.logits, args.labels, **args.options.kwargs())[0]
  return rows.reduce_loss(loss, args.labels, args.options, args.reduction)


def _rule(args: Args) -> partitioning.Rule:
  """The tokens split freely (the labels' and a class-wise where's with the logits'); the
  classes are reduced over."""
  tokens = partitioning.row_dims(args.logits.ndim, "vocab")
  rule = {"logits": (*tokens, Whole("vocab")), "labels": tokens}
  return rule if args.where is None else {**rule, "where": rule["logits"]}


def _valid(args: Args):
  """The tokens a class-wise where lets take in some class (the others are left out of the
  mean), or None."""
  return None if args.where is None else jnp.any(args.where, axis=-1)


def _across(split: partitioning.Split, rule: partitioning.Rule, local: backend.Local,
            args: Args):
  """Each shard's per-token loss, then reduced over them all (XLA's sum across shards)."""
  arrays = {name: getattr(args, name) for name in rule}
  loss = split.run(lambda **shards: local(**shards, reduction="none"), arrays, rule,
                   rule["labels"])
  return rows.reduce_loss(loss, args.labels, args.options, args.reduction, valid=_valid(args))


def softmax_cross_entropy(logits, labels, axis: int | tuple[int, ...] = -1, where=None, *,
                          label_smoothing: float = 0.0, z_loss: float = 0.0,
                          ignore_index: int | None = None, reduction: str = "mean",
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
    axis: the classes' axis, or axes (as optax's, third, by name or position: a label is then
      a flat index into their slice of ``logits``); moved last (a transpose where it is not
      already).
    where: as optax's (fourth, by name or position): None, a boolean mask shaped like ``labels`` (the tokens that count: one
      that does not gives 0 and no gradient and is left out of the mean, as an ignored one),
      or shaped like ``logits`` (the classes each token's softmax takes in; a token with none
      gives 0 and is left out of the mean). The class-wise mask runs XLA's path (the
      kernels read whole rows) and takes no ``label_smoothing``.
    labels_checked: raise a ValueError naming the first label outside [0, V) (other than
      ``ignore_index``) instead of giving it NaN: at once for concrete labels (also under vmap
      or grad of concrete values); for labels traced under jit by
      ``jax.experimental.checkify``: run the function as ``err, out =
      checkify.checkify(f)(...)`` and ``err.throw()`` raises it (a ValueError). A jitted
      function that is not checkified does not compile with it (JAX: "a checkify.check which
      was not functionalized"): leave it off there, or checkify.
    implementation: None (best available), "xla", "mosaic_gpu" (Hopper), "triton" or
      "mosaic_tpu".
    config: the chosen kernel's Config; None picks one for the shape and device.

  Where it differs from optax's ``softmax_cross_entropy_with_integer_labels`` on purpose: it
  reduces to the mean by default (``reduction="none"`` gives optax's per-token losses), and a
  label outside [0, V) gives NaN rather than a loss read off a clipped index.
  """
  logits, labels, where, ignore_index = _optax_form(logits, labels, axis, where, ignore_index)
  if labels_checked:
    rows.check_range(OP, labels, logits.shape[-1], ignore_index)
  return backend.call(_OP, implementation, config, logits=logits, labels=labels,
                      label_smoothing=label_smoothing, z_loss=z_loss, ignore_index=ignore_index,
                      reduction=reduction, where=where)



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
    labels = rows.check_labels(OP, labels, token_shape, "logits without its class axes")
    ignore_index = _MASKED if ignore_index is None else ignore_index
    labels = jnp.where(where, labels, jnp.int32(ignore_index))
    where = None
  return logits, labels, where, ignore_index


def _class_masked(args: Args):
  """optax's class-wise ``where``: each token's log-sum-exp over the classes it takes in, its
  label's logit subtracted; 0 (and left out of the mean) for a token that takes in none."""
  logits, labels, where, options = args.logits, args.labels, args.where, args.options
  z = logits.astype(jnp.float32)
  vocab = z.shape[-1]
  lse = jax.nn.logsumexp(z, axis=-1, where=where)
  picked = jnp.take_along_axis(z, jnp.clip(labels, 0, vocab - 1)[..., None], axis=-1)[..., 0]
  loss = lse - picked + options.z_loss * lse * lse
  takes_in = _valid(args)
  kept = takes_in & rows.kept_tokens(labels, options)
  loss = reference.nan_where(kept & ((labels < 0) | (labels >= vocab)), loss)
  loss = jnp.where(kept, loss, 0.0)
  return rows.reduce_loss(loss, labels, options, args.reduction, valid=takes_in)



_OP = backend.register(backend.Op(
    name=OP, kernels=rows.KERNELS, validate=_validate,
    problem=lambda args: rows.Problem.of(args.logits, class_mask=args.where is not None),
    reference=_reference, kernel=_kernel,
    options=lambda args: args.options.kwargs(),
    rule=_rule, across=_across,
), softmax_cross_entropy)
