"""Softmax cross-entropy's rows, shared by the loss on logits (``api``) and the loss fused
with the output projection (``linear``): the problem the row kernels see, the options every
row takes, the checks of labels and options, the reductions, and the rows on the kernels or the
reference (forward, backward, both in one launch)."""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jaxkernels import _checks, dispatch
from jaxkernels._tiling import bucket
from jaxkernels.ops.cross_entropy import mosaic_gpu, mosaic_tpu, reference

# The public names: warnings, errors, supports() and the tuning tables say these.
OP = "softmax_cross_entropy"
LINEAR_OP = "linear_softmax_cross_entropy"
REDUCTIONS = ("mean", "sum", "none")


@dataclasses.dataclass(frozen=True)
class Problem:
  """One call as the row kernels see it: the logits as (M, V) rows."""

  logits: jax.ShapeDtypeStruct
  class_mask: bool = False  # optax's where shaped like the logits: XLA's path alone

  @classmethod
  def of(cls, logits, class_mask: bool = False) -> Problem:
    rows = math.prod(logits.shape[:-1])
    return cls(jax.ShapeDtypeStruct((rows, logits.shape[-1]), logits.dtype), class_mask)

  def key(self) -> str:
    rows, cols = self.logits.shape
    return f"{self.logits.dtype}|{bucket(rows)}x{cols}"

  def reason(self) -> str | None:
    if self.class_mask:
      return ("a where shaped like logits (a mask of classes) runs on XLA's path alone: the "
              "kernels read whole rows")
    return _checks.kernel_dtype_reason(logits=self.logits)

  def __str__(self) -> str:
    return f"cross-entropy of {self.logits.shape} {self.logits.dtype} logits"


@dataclasses.dataclass(frozen=True)
class Options:
  """What every row of a call takes, static: the row kernels' keyword options."""

  label_smoothing: float
  z_loss: float
  ignore_index: int | None

  def kwargs(self) -> dict:
    return dataclasses.asdict(self)


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #


def check_labels(op, labels, shape, against):
  if not (hasattr(labels, "shape") and hasattr(labels, "dtype")):
    labels = jnp.asarray(labels)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"{op}: labels must have an integer dtype, got {labels.dtype}")
  if tuple(labels.shape) != tuple(shape):
    raise ValueError(f"{op}: labels must have the shape of {against}, {tuple(shape)}, got "
                     f"{tuple(labels.shape)}")
  return labels.astype(jnp.int32)


def check_options(op, label_smoothing, z_loss, ignore_index, reduction) -> Options:
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
  return Options(float(label_smoothing), float(z_loss),
                 None if ignore_index is None else int(ignore_index))


def reduce_loss(loss, labels, options: Options, reduction: str, valid=None):
  """The per-token ``loss`` reduced: a mean over the tokens not ignored (and ``valid`` where
  given; 0 where there are none), a sum, or as it is."""
  if reduction == "none":
    return loss
  if reduction == "sum":
    return jnp.sum(loss)
  return jnp.sum(loss) / jnp.maximum(count(labels, options, valid), 1.0)


def kept_tokens(labels, options: Options):
  """Where a token counts: its label is not ``ignore_index``."""
  return jnp.ones(labels.shape, bool) if options.ignore_index is None else (
      labels != options.ignore_index)


def count(labels, options: Options, valid=None):
  kept = kept_tokens(labels, options)
  if valid is not None:
    kept = kept & valid
  return jnp.sum(kept, dtype=jnp.float32)


# --------------------------------------------------------------------------- #
# The rows: kernels or the reference
# --------------------------------------------------------------------------- #


def forward(plan, options: Options, logits, labels):
  """(loss, lse) of (M, V) rows."""
  if plan is None:
    return reference.softmax_cross_entropy(logits, labels, **options.kwargs())
  return plan.run(plan.kernels.forward, logits, labels)


def backward(plan, options: Options, logits, labels, lse, g, dtype):
  """d loss / d logits of (M, V) rows for the per-row cotangent ``g``, in ``dtype``."""
  if plan is None:
    loss = lambda z: reference.softmax_cross_entropy(z, labels, **options.kwargs())[0]
    return jax.vjp(loss, logits.astype(jnp.float32))[1](g)[0].astype(dtype)
  return plan.run(plan.kernels.backward, logits, labels, lse, g, dtype=dtype)


def loss_and_backward(plan, options: Options, logits, labels, g, dtype):
  """(loss, lse, dlogits) of (M, V) rows: one launch where the backend fuses them
  (:data:`FUSED`), else the forward and then the backward."""
  if plan is None or plan.implementation not in FUSED:
    loss, lse = forward(plan, options, logits, labels)
    return loss, lse, backward(plan, options, logits, labels, lse, g, dtype)
  return plan.run(plan.kernels.backward, logits, labels, None, g, dtype=dtype)


def check_range(op, labels, vocab, ignore_index):
  """labels_checked: a ValueError naming the first label outside [0, vocab) that is not
  ``ignore_index``: at once for concrete labels; for traced ones a checkify check
  (:func:`_checks.traced_check`: ``checkify.checkify`` the function to run it)."""
  if not (hasattr(labels, "shape") and hasattr(labels, "dtype")):
    labels = jnp.asarray(labels)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    return  # check_labels names the dtype
  ignored = "" if ignore_index is None else f", or ignore_index {ignore_index}"
  said = f"{op}: labels must be in [0, {vocab}) (the classes{ignored}); "
  if isinstance(labels, jax.core.Tracer):
    bad = (labels < 0) | (labels >= vocab)
    if ignore_index is not None:
      bad &= labels != ignore_index
    _checks.traced_check(~bad.any(), said + "labels[{where}] is {value} ({count} such)",
                         at=bad, value=labels, count=bad.sum())
    return
  values = np.asarray(labels)
  bad = (values < 0) | (values >= vocab)
  if ignore_index is not None:
    bad &= values != ignore_index
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(said + f"labels{list(where)} is {int(values[where])} ({int(bad.sum())} "
                     "such)")


# The kernels whose backward, given no lse, computes the loss too in the same launch (Triton's
# writes dlogits over the logits, which are spent; Mosaic GPU's into an array of its own).
FUSED = ("triton", "mosaic_gpu")

# Both ops' kernels: the fused loss runs the row kernels on a chunk's logits (supports() asks
# them so).
KERNELS = {
    "mosaic_gpu": dispatch.Kernels.of(OP, "mosaic_gpu", mosaic_gpu, forward=mosaic_gpu.forward,
                                      backward=mosaic_gpu.backward),
    **dispatch.triton_kernels(OP, "jaxkernels.ops.cross_entropy.triton", forward="forward",
                              backward="backward"),
    "mosaic_tpu": dispatch.Kernels.of(OP, "mosaic_tpu", mosaic_tpu, forward=mosaic_tpu.forward,
                                      backward=mosaic_tpu.backward),
}
