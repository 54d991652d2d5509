"""How close is close enough: the float64 oracle and tolerances derived from the numerics.

DESIGN.md's rule: a kernel's error against the exact answer may be at most
twice the error of the naive computation in the low-precision dtype (the
reference run with ``compute_dtype`` equal to the input dtype), leaf by leaf.
Float32 work has a floor: reductions of length n in float32 carry a random
walk of rounding errors, ~sqrt(n) ulps; four times that is allowed whatever the
baseline happened to get.
"""

from __future__ import annotations

import contextlib
import math
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np

import jaxkernels as jk

F32_EPS = float(np.finfo(np.float32).eps)
# JAXKERNELS_TEST_COMPILED=1 (on the GPU machine): the test bases' kernels compile for the
# device the arrays live on instead of running interpreted on the CPU, under the same cases and
# the same derived tolerances; kernels for another platform (Mosaic TPU there) skip with the
# reason ``jk.supports`` gives.
COMPILED = os.environ.get("JAXKERNELS_TEST_COMPILED", "0") not in ("", "0")


def kernel_mode():
  """Where a test runs the kernels it checks: interpreted on the CPU (CI), or compiled
  (``COMPILED``)."""
  return contextlib.nullcontext() if COMPILED else jk.interpret_mode()

SEED = int(os.environ.get("JAXKERNELS_TEST_SEED", np.random.SeedSequence().entropy % 2**31))


def rng(*labels) -> np.random.Generator:
  """A generator fresh for every session (SEED) and distinct for every test case (labels)."""
  return np.random.default_rng([SEED, zlib.crc32(repr(labels).encode())])


def normal(gen, shape, dtype, scale=1.0, shift=0.0, bound=None):
  values = gen.standard_normal(shape) * scale + shift
  if bound is not None:
    values = np.clip(values, -bound, bound)
  return jnp.asarray(values, dtype)


def _f64(tree):
  return jax.tree.map(lambda a: None if a is None else jnp.asarray(np.asarray(a, np.float64)),
                      tree, is_leaf=lambda a: a is None)


def evaluate(reference, compute_dtype, primals, cotangent=None):
  """reference(compute_dtype)(*primals), and its vjp on ``cotangent`` if given.

  float64 runs under x64 on float64 copies of the inputs: the oracle.
  """
  def run(args, ct):
    fn = reference(compute_dtype)
    if ct is None:
      return fn(*args)
    out, vjp = jax.vjp(fn, *args)
    return out, vjp(ct)

  if compute_dtype == jnp.float64:
    with jax.enable_x64(True):
      out = run(_f64(primals), _f64(cotangent))
      return jax.tree.map(lambda a: np.asarray(a, np.float64), out)
  return run(primals, cotangent)


def errors(got, want) -> list[float]:
  """max |got - want| / max |want|, leaf by leaf (NaN anywhere is an infinite error)."""
  out = []
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g = np.asarray(jnp.asarray(g, jnp.float32), np.float64)
    w = np.asarray(w, np.float64)
    assert g.shape == w.shape, (g.shape, w.shape)
    if not np.all(np.isfinite(g)):
      out.append(math.inf)
      continue
    out.append(float(np.max(np.abs(g - w), initial=0.0) / max(np.max(np.abs(w), initial=0.0),
                                                              1e-30)))
  return out


def assert_matches(got, reference, primals, cotangent=None, *, dtype, reduction: int,
                   pointwise_rtol: float = 0.0):
  """got (outputs, or (outputs, grads)) is within the numerics-derived tolerance of the oracle.

  ``pointwise_rtol`` is the documented accuracy of transcendental work done per
  element (e.g. ``_activations.RTOL``): on a tiny array the max-norm error is
  one element's, and one rounding of the naive baseline is no bound on it.
  """
  oracle = evaluate(reference, jnp.float64, primals, cotangent)
  baseline = evaluate(reference, dtype, primals, cotangent)
  floor = max(4 * F32_EPS * math.sqrt(max(reduction, 1)), pointwise_rtol)
  got_errors, base_errors = errors(got, oracle), errors(baseline, oracle)
  for i, (e, b) in enumerate(zip(got_errors, base_errors)):
    tolerance = 2 * b + floor
    assert e <= tolerance, (
        f"leaf {i}: error {e:.3e} > tolerance {tolerance:.3e} (naive {jnp.dtype(dtype).name} "
        f"error {b:.3e}); all leaves: {['%.2e' % x for x in got_errors]} (seed {SEED})")
