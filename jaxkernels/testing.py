"""The numerics rule, for our tests and yours: how close a kernel must come to the exact answer.

FlashAttention's rule, made every op's here: a kernel's error against the exact answer (the
reference run in float64, the oracle) may be at most twice the error of the naive computation
in the low-precision dtype (the same reference run in the input dtype), leaf by leaf, forward
and every gradient. Errors are max |got - want| / max |want| over a leaf.

Why this rule and not a fixed tolerance: a kernel computes the same sums as the reference in
another order and with other intermediate roundings (tiles, online softmax, fused epilogues),
so it cannot match any one low-precision computation bit for bit; what a user can ask is that
it lose no more than the plain computation in the same dtype already does. The naive
computation's own error is the measure of what that dtype costs at that shape, so the bar
scales with the reduction length and the dtype by itself (a fixed atol of 1e-1 passes wrong
kernels on small outputs and fails right ones on long reductions). Twice, not once: the
kernel's roundings are as many as the naive ones but fall elsewhere, and a factor of two
leaves room for that without admitting a kernel that drops a term (which is off by far more).
Float32 work has a floor: a reduction of length n in float32 carries a random walk of rounding
errors, ~sqrt(n) ulps; four times that is allowed whatever the baseline happened to get.
A leaf that the exact answer makes zero everywhere (the loss and gradient of a softmax over one
class) has no magnitude to be relative to: what a computation leaves there is the rounding of
terms that cancelled, which are on the scale of the inputs, so its error is relative to the
largest magnitude among the primals and the cotangent.

    import jaxkernels as jk
    from jaxkernels import testing

    reference = lambda dtype: functools.partial(my_reference, compute_dtype=dtype)
    got = jax.vjp(my_model_piece, *primals)  ... # (outputs, grads)
    testing.assert_matches(got, reference, primals, cotangent, dtype=jnp.bfloat16,
                           reduction=hidden)

``reference(dtype)`` must return a function of the primals computing every step in ``dtype``.
The check is a ``chex.assert_trees_all_close`` per leaf with ``atol`` = the derived tolerance
times the leaf's largest magnitude.

A kernel's test must also know that the kernel ran, not the XLA reference it falls back to
(which passes the rule by construction): :func:`served` records what served each op call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxkernels.backend import Served as Served, served as served

F32_EPS = float(np.finfo(np.float32).eps)


def _f64(tree):
  """float64 copies, made where the arrays live (under x64)."""
  return jax.tree.map(lambda a: None if a is None else jnp.asarray(a, jnp.float64),
                      tree, is_leaf=lambda a: a is None)


def evaluate(reference: Callable[[Any], Callable[..., Any]], compute_dtype, primals,
             cotangent=None, *, host: bool = True):
  """reference(compute_dtype)(*primals), and its vjp on ``cotangent`` if given: (outputs,
  grads). float64 runs under x64 on float64 copies of the floating inputs (the oracle);
  integer inputs (segment ids, say) keep their dtype. The float64 answer comes back as NumPy
  arrays, or with ``host=False`` stays on the device (for :func:`errors` there: a benchmark's
  gigabyte of logits is not copied to the host)."""
  def run(args, ct):
    fn = reference(compute_dtype)
    if ct is None:
      return fn(*args)
    out, vjp = jax.vjp(fn, *args)
    # Each cotangent in its output's dtype (a float32 log-sum-exp's comes back in the
    # baseline's bfloat16, say).
    ct = jax.tree.map(lambda c, o: jnp.asarray(c, o.dtype), ct, out)
    return out, vjp(ct)

  if compute_dtype == jnp.float64:
    with jax.enable_x64(True):
      floating = lambda a: a is not None and jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating)
      args = tuple(_f64(a) if floating(a) else a for a in primals)
      out = jax.jit(run)(args, _f64(cotangent))  # one program, not one per op
      if not host:
        return out
      return jax.tree.map(lambda a: np.asarray(a, np.float64)
                          if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating) else a, out)
  # The naive computation, each step rounded to its dtype: one program, without the excess
  # precision XLA otherwise allows itself (a fusion's intermediates kept in float32, on the
  # CPU too: 6% of a bfloat16 chain's elements, tests/test_testing.py), which would make the
  # baseline better than naive and the bar tighter than the rule.
  return jax.jit(run, compiler_options=_ROUNDED)(primals, cotangent)


# XLA's option for a program that rounds every step to its dtype, as evaluation op by op does.
_ROUNDED = {"xla_allow_excess_precision": False}


def _floating_leaves(tree):
  return [a for a in jax.tree.leaves(tree)
          if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating)]


def _on_host(*arrays) -> bool:
  """Whether the arrays are NumPy's or live on the CPU: there the error measure is NumPy's (no
  program to compile per shape, the suite's time); on an accelerator it is one program on the
  device (a benchmark's gigabyte of logits is not copied to the host)."""
  return all(not isinstance(a, jax.Array) or all(d.platform == "cpu" for d in a.devices())
             for a in arrays)


def _stats(g, w, xp):
  """(any non-finite value of g where it is wrong, max |g - w| over the rest, max finite |w|),
  float64 in the namespace ``xp`` (NumPy, or jax.numpy inside a jit); ``g`` None: the last
  alone."""
  w = xp.asarray(w, xp.float64)
  largest = xp.max(xp.abs(xp.where(xp.isfinite(w), w, 0.0)), initial=0.0)
  if g is None:
    return False, 0.0, largest
  g = xp.asarray(g, xp.float64)
  same = (g == w) | ~xp.isfinite(w)
  wrong = xp.any(~xp.isfinite(g) & ~same) | xp.any(~xp.isfinite(w) & (g != w))
  return wrong, xp.max(xp.abs(xp.where(same, 0.0, g - w)), initial=0.0), largest


_device_stats = jax.jit(lambda g, w: _stats(g, w, jnp))


def _measure(g, w) -> tuple[bool, float, float]:
  """:func:`_stats` where the arrays are: NumPy on the host, one jitted program on a device."""
  if _on_host(g, w):
    to_host = lambda a: None if a is None else np.asarray(a).astype(np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf where both are inf: masked by `same`
      return tuple(map(_to_python, _stats(to_host(g), to_host(w), np)))
  with jax.enable_x64(True):  # in float64, on the device that holds the arrays
    return tuple(map(_to_python, _device_stats(g, w)))


def _to_python(value):
  return bool(value) if np.asarray(value).dtype == bool else float(value)


def _largest(a) -> float:
  return _measure(None, a)[2]


def input_scale(*trees) -> float:
  """The largest finite magnitude among the floating leaves of ``trees`` (the primals and the
  cotangent): what an all-zero leaf's error is relative to."""
  return max((_largest(a) for tree in trees if tree is not None
              for a in _floating_leaves(tree)), default=0.0)


def _magnitude(want, zero_scale: float) -> float:
  """What a leaf's error is relative to: its largest finite magnitude, or ``zero_scale`` where
  the exact leaf is zero everywhere."""
  return max(_largest(want) or zero_scale, 1e-30)


def errors(got, want, zero_scale: float = 0.0) -> list[float]:
  """max |got - want| / max |want|, leaf by leaf over the floating leaves; a non-finite value
  in ``got`` where ``want`` is finite is an infinite error (-inf where -inf is wanted, a fully
  masked row's log-sum-exp, is right). A ``want`` leaf that is zero everywhere: relative to
  ``zero_scale`` (:func:`input_scale`)."""
  out = []
  for g, w in zip(_floating_leaves(got), _floating_leaves(want), strict=True):
    chex.assert_equal_shape([g, w])
    wrong, difference, largest = _measure(g, w)
    if wrong:
      out.append(math.inf)
      continue
    out.append(difference / max(largest or zero_scale, 1e-30))
  return out


def tolerances(reference, primals, cotangent=None, *, dtype, reduction: int,
               pointwise_rtol: float | Sequence[float] = 0.0):
  """(oracle, per-leaf tolerances): the float64 answer, and for each of its floating leaves
  the largest error the rule allows (relative to the leaf's largest magnitude)."""
  return _tolerances(reference, primals, cotangent, dtype, reduction, pointwise_rtol,
                     input_scale(primals, cotangent))


def _per_leaf(pointwise_rtol: float | Sequence[float], leaves: int) -> list[float]:
  """``pointwise_rtol`` for each of ``leaves`` floating leaves: one number for them all, or one
  a leaf (a loosening derived for some leaves is theirs alone)."""
  if isinstance(pointwise_rtol, (int, float)):
    return [float(pointwise_rtol)] * leaves
  values = [float(v) for v in pointwise_rtol]
  if len(values) != leaves:
    raise ValueError(f"pointwise_rtol: {len(values)} values for {leaves} floating leaves; give "
                     "one number, or one a leaf in the tree's order")
  return values


def allowed(baseline, oracle, *, reduction: int,
            pointwise_rtol: float | Sequence[float] = 0.0,
            zero_scale: float = 0.0) -> list[float]:
  """The rule itself: each floating leaf's largest allowed error (relative to the leaf's largest
  magnitude), given the naive low-precision computation's result ``baseline`` and the float64
  ``oracle``: twice the baseline's error, plus the float32 floor (or the leaf's
  ``pointwise_rtol``, where larger). ``baseline=None``: no naive computation to measure (a
  format whose accuracy is documented instead, fp8 on tensor cores say): the floor alone."""
  base = 4 * F32_EPS * math.sqrt(max(reduction, 1))
  floors = [max(base, p) for p in _per_leaf(pointwise_rtol, len(_floating_leaves(oracle)))]
  if baseline is None:
    return floors
  return [2 * b + floor for b, floor in zip(errors(baseline, oracle, zero_scale), floors,
                                            strict=True)]


def _tolerances(reference, primals, cotangent, dtype, reduction, pointwise_rtol, zero_scale):
  oracle = evaluate(reference, jnp.float64, primals, cotangent)
  baseline = evaluate(reference, dtype, primals, cotangent)
  return oracle, allowed(baseline, oracle, reduction=reduction, pointwise_rtol=pointwise_rtol,
                         zero_scale=zero_scale)


def assert_matches(got, reference, primals, cotangent=None, *, dtype, reduction: int,
                   pointwise_rtol: float | Sequence[float] = 0.0, note: str = "") -> None:
  """``got`` (outputs, or (outputs, grads) where ``cotangent`` is given) is within the rule's
  tolerance of the oracle, leaf by leaf.

  Args:
    reference: ``dtype -> function of the primals`` computing every step in ``dtype``.
    dtype: the inputs' low-precision dtype (the naive baseline's).
    reduction: the longest reduction in the computation (the float32 floor's n).
    pointwise_rtol: the documented accuracy of transcendental work done per element (an
      approximate exp, say): on a tiny array the max-norm error is one element's, and one
      rounding of the naive baseline is no bound on it. One number for every leaf, or one a
      floating leaf (outputs, then gradients, in the tree's order) where it was derived for
      some leaves alone.
    note: appended to a failure's message (the seed that drew the inputs, say).
  """
  zero_scale = input_scale(primals, cotangent)
  oracle, allowed = _tolerances(reference, primals, cotangent, dtype, reduction, pointwise_rtol,
                                zero_scale)
  got_errors = errors(got, oracle, zero_scale)
  leaves = zip(_floating_leaves(got), _floating_leaves(oracle), got_errors, allowed, strict=True)
  for i, (g, w, e, tol) in enumerate(leaves):
    w = np.asarray(w, np.float64)
    finite = np.isfinite(w)
    scale = _magnitude(w, zero_scale)
    message = (f"leaf {i}: error {e:.3e} > tolerance {tol:.3e}; all leaves' errors "
               f"{['%.2e' % x for x in got_errors]}, tolerances {['%.2e' % x for x in allowed]} {note}")
    assert e != math.inf, message + " (a non-finite value where the oracle is finite)"
    chex.assert_trees_all_close(np.where(finite, np.asarray(jnp.asarray(g, jnp.float32),
                                                            np.float64), 0.0),
                                np.where(finite, w, 0.0), atol=tol * scale, rtol=0,
                                custom_message=message)
