"""The ops as the tests call them: one table of cases keyed by the registered ops (every public
op has one: tests/test_structure.py), the one check every family's tests run a call through,
and its sharded variant. Each family's file keeps its own edge cases; what runs a call, asks
``jk.supports``, takes the gradient and judges it by the numerics rule is here, once."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxkernels as jk
from jaxkernels import testing
from jaxkernels.ops.attention import reference as attention_reference
from jaxkernels.ops.attention.common import Window
from jaxkernels.ops.cross_entropy import reference as cross_entropy_reference
from jaxkernels.ops.elementwise import reference as elementwise_reference
from jaxkernels.ops.matmul import reference as matmul_reference
from jaxkernels.ops.norms import reference as norms_reference
from jaxkernels.ops.softmax import reference as softmax_reference
from tests import numerics

EPS = 1e-6
# Words of a refusal by design (check's ``refused``): TPUs have no float16.
NO_TPU_FLOAT16 = "float16 is not a TPU dtype"


def check(op: str, implementation: str, fn: Callable[..., Any], reference, primals, ct, *,
          dtype, reduction: int, pointwise_rtol=None, support=None, grads: bool = True,
          judge_grads: bool = True, refused: str | None = None):
  """``fn(*primals)`` and, with ``grads``, its gradient for the cotangent ``ct``, where the
  kernels run (interpreted on the CPU, compiled under JAXKERNELS_TEST_COMPILED), judged
  against the float64 oracle of ``reference`` (compute dtype -> function) by the numerics
  rule; every op call inside must have run on ``implementation`` (a fallback, or a path that
  skips dispatch, fails), ``op`` among them. ``judge_grads=False``: the gradient runs but is
  not judged (ill-conditioned by the math, as a one-element row's norm). Returns what ran:
  (out, grads), or out.

  ``implementation`` must serve the call (``jk.supports``, asked with ``support``, (args,
  kwargs); default: the primals): a refusal fails the test, unless the caller lists it,
  ``refused`` naming words of the reason it expects; then the test skips with that reason
  (and fails where the kernel serves the call after all: the listing is stale)."""
  args, kwargs = support if support is not None else (primals, {})
  if (reason := numerics.elsewhere(implementation)) is not None:
    pytest.skip(reason)
  with numerics.kernel_mode():
    supported = jk.supports(op, implementation, *args, **kwargs)
    if refused is not None:
      assert not supported, (f"{implementation} serves this {op} call, listed as refused "
                             f"({refused!r}): the listing is stale")
      assert refused in supported.reason, (refused, supported.reason)
      pytest.skip(f"{implementation} refuses it, as listed: {supported.reason}")
    if not supported:
      pytest.fail(f"{implementation} refuses a call of {op} it must serve: {supported.reason} "
                  "(a refusal by design is listed: check's refused)", pytrace=False)
    with numerics.served_by(implementation, ops=(op,)):
      if grads:
        out, vjp = jax.vjp(fn, *primals)
        got = (out, vjp(ct))
      else:
        got = fn(*primals)
  judged, judged_ct = (got, ct) if grads and judge_grads else (got[0] if grads else got, None)
  rtol = {} if pointwise_rtol is None else {"pointwise_rtol": pointwise_rtol}
  numerics.assert_matches(judged, reference, primals, judged_ct, dtype=dtype,
                          reduction=reduction, **rtol)
  return got


@dataclasses.dataclass(frozen=True)
class Case:
  """One op (or a variant of one) as the table's tests call it, on arrays drawn in float32 and
  rounded to the case's dtype.

  Fields:
    op: the registered op's name.
    call: ``implementation -> fn(*arrays)``.
    reference: ``compute dtype -> fn(*arrays)``: the spec, for the numerics rule.
    arrays: ``(generator, shape) -> arrays``, float32, x's ``shape`` (the product's N 3/4 of
      x's width and the fused loss's vocabulary 3/2 of it, so that x's whole 64-row tiles and
      128-element vectors make theirs).
    support: ``(*arrays) -> (args, kwargs)``: the call as ``jk.supports`` asks it.
    kinds: for each array, how a sharded layout of x splits it (:meth:`check_sharded`): "rows"
      (as x), "vector" (along x's last axis), or None (an absent array); None for an op whose
      layouts its own sharded tests draw (a product's, attention's).
  """

  op: str
  call: Callable[[str | None], Callable[..., Any]]
  reference: Callable[[Any], Callable[..., Any]]
  arrays: Callable[..., Sequence[Any]]
  support: Callable[..., tuple[tuple, dict]]
  kinds: tuple[str | None, ...] | None = None

  def check(self, implementation: str, shape, *labels, dtype=jnp.float32, grads=True):
    """The call on fresh arrays of x's ``shape`` in ``dtype`` (integer arrays kept), forward
    and (with ``grads``) gradient, by :func:`check`."""
    gen = numerics.rng("case", self.op, implementation, shape, jnp.dtype(dtype).name, *labels)
    primals = tuple(a if a is None or not jnp.issubdtype(a.dtype, jnp.floating)
                    else a.astype(dtype) for a in self.arrays(gen, shape))
    out_shapes = jax.eval_shape(self.call("xla"), *primals)  # the op's dtypes, not the spec's
    ct = jax.tree.map(lambda o: numerics.normal(gen, o.shape, o.dtype), out_shapes)
    return check(self.op, implementation, self.call(implementation), self.reference, primals,
                 ct, dtype=dtype, reduction=max(shape[-1], math.prod(shape[:-1])),
                 support=self.support(*primals), grads=grads)

  def check_sharded(self, implementation: str | None, mesh, spec: P, shape, *labels,
                    gathered: bool = False):
    """The call on arrays laid out on ``mesh`` as ``spec`` says for x (the rows; a vector
    along x's last axis follows its split), forward and gradient under jit, on the kernels of
    ``implementation`` (interpreted: a call that names none picks them; None, the first that
    serves), against the oracle by the numerics rule; warned of a gather exactly where
    ``gathered``; the output split as x where nothing is gathered."""
    assert self.kinds is not None, f"{self.op}: its layouts are its own tests'"
    gen = numerics.rng("sharding", self.op, *labels)
    args = self.arrays(gen, shape)
    specs = [None if k is None else spec if k == "rows" else P(spec[-1]) for k in self.kinds]
    sharded = [a if s is None or a is None else jax.device_put(a, NamedSharding(mesh, s))
               for a, s in zip(args, specs)]
    out_shapes = jax.eval_shape(self.reference(jnp.float32), *args)
    ct = jax.tree.map(lambda o: numerics.normal(gen, o.shape, o.dtype), out_shapes)
    with jk.interpret_mode(implementation), warnings.catch_warnings(record=True) as caught, \
         testing.served() as calls:
      warnings.simplefilter("always")
      out, vjp = jax.vjp(jax.jit(self.call(None)), *sharded)
      got = (out, vjp(ct))
    warned = [str(w.message) for w in caught if issubclass(w.category, jk.ShardingWarning)]
    assert bool(warned) == gathered, warned
    # Each shard's call on the kernels interpret mode picks, none falling back to XLA's path.
    assert not [w for w in caught if issubclass(w.category, jk.FallbackWarning)], [
        str(w.message) for w in caught]
    numerics.assert_served(calls, implementation, ops=(self.op,))
    numerics.assert_matches(got, self.reference, args, ct, dtype=jnp.float32,
                            reduction=max(shape[-1], math.prod(shape[:-1])))
    if not gathered:
      assert jax.tree.leaves(out)[0].sharding.spec == spec  # the output split as x was
    return got


def _norm(layer: bool) -> Case:
  name = "layer_norm" if layer else "rms_norm"

  def call(implementation):
    def f(x, s, b, r):
      if layer:
        return jk.layer_norm(x, s, b, eps=EPS, residual=r, implementation=implementation)
      return jk.rms_norm(x, s, eps=EPS, residual=r, implementation=implementation)
    return f

  def reference(cd):
    def f(x, s, b, r):
      if layer:
        return norms_reference.layer_norm(x, s, b, eps=EPS, residual=r, compute_dtype=cd)
      return norms_reference.rms_norm(x, s, eps=EPS, residual=r, compute_dtype=cd)
    return f

  def arrays(gen, shape):
    n = shape[-1]
    return (numerics.normal(gen, shape, jnp.float32),
            numerics.normal(gen, (n,), jnp.float32, 0.2, 1),
            numerics.normal(gen, (n,), jnp.float32, 0.2) if layer else None,
            numerics.normal(gen, shape, jnp.float32))

  def support(x, s, b, r):
    return ((x, s, b) if layer else (x, s)), {"residual": r}
  return Case(name, call, reference, arrays, support,
              ("rows", "vector", "vector" if layer else None, "rows"))


def _rows(gen, shape, scale=1.0):
  return numerics.normal(gen, shape, jnp.float32, scale)


def _attention_arrays(gen, shape):
  """q (B, T, N, H) from x's (B, T, N*H) rows: N = 2 heads, H = the rest; k and v alike."""
  b, t, width = shape
  return tuple(numerics.normal(gen, (b, t, 2, width // 2), jnp.float32) for _ in range(3))


def _decode_arrays(gen, shape):
  """q (B, 1, 2, H) against caches (B, T, 2, H), x's (B, T, 2H)."""
  b, t, width = shape
  q = numerics.normal(gen, (b, 1, 2, width // 2), jnp.float32)
  k, v = (numerics.normal(gen, (b, t, 2, width // 2), jnp.float32) for _ in range(2))
  return q, k, v


def _lengths(k):
  """Each sequence's cache, all but its last three entries (sequences of unequal length)."""
  b, t = k.shape[:2]
  return jnp.maximum(t - 3 - jnp.arange(b, dtype=jnp.int32), 1)


def _labels(gen, shape, vocab):
  return jnp.asarray(gen.integers(0, vocab, shape), jnp.int32)


def _ce_labels(z):
  """Labels for logits ``z`` (..., V), the same for every call of a shape in a session."""
  return _labels(numerics.rng("labels", z.shape), z.shape[:-1], z.shape[-1])


def _linear_labels(x, w):
  return _labels(numerics.rng("labels", x.shape, w.shape), x.shape[:-1], w.shape[-1])


CASES: dict[str, Case] = {
    "rms_norm": _norm(False),
    "layer_norm": _norm(True),
    "bias_activation": Case(
        "bias_activation",
        lambda impl: lambda x, b: jk.bias_activation(x, b, activation="gelu",
                                                     implementation=impl),
        lambda cd: lambda x, b: elementwise_reference.bias_activation(x, b, activation="gelu",
                                                                      compute_dtype=cd),
        lambda gen, shape: (_rows(gen, shape), _rows(gen, shape[-1:])),
        lambda x, b: ((x, b), {"activation": "gelu"}),
        ("rows", "vector")),
    "glu": Case(
        "glu",
        lambda impl: lambda g, u: jk.glu(g, u, implementation=impl),
        lambda cd: lambda g, u: elementwise_reference.glu(g, u, compute_dtype=cd),
        lambda gen, shape: (_rows(gen, shape), _rows(gen, shape)),
        lambda g, u: ((g, u), {}),
        ("rows", "rows")),
    "softmax": Case(
        "softmax",
        lambda impl: lambda x: jk.softmax(x, axis=1, implementation=impl),
        lambda cd: lambda x: softmax_reference.softmax(x, axis=1, compute_dtype=cd),
        lambda gen, shape: (_rows(gen, shape, 3.0),),
        lambda x: ((x,), {"axis": 1}),
        ("rows",)),
    "matmul": Case(
        "matmul",
        lambda impl: lambda a, b: jk.matmul(a, b, implementation=impl),
        lambda cd: lambda a, b: matmul_reference.in_dtype(cd, a, b),
        lambda gen, shape: (_rows(gen, shape), _rows(gen, (shape[-1], 3 * shape[-1] // 4), 0.1)),
        lambda a, b: ((a, b), {})),
    "softmax_cross_entropy": Case(
        "softmax_cross_entropy",
        lambda impl: lambda z: jk.softmax_cross_entropy(z, _ce_labels(z), reduction="none",
                                                        implementation=impl),
        lambda cd: lambda z: cross_entropy_reference.softmax_cross_entropy(
            z, _ce_labels(z), compute_dtype=cd)[0],
        lambda gen, shape: (_rows(gen, shape, 3.0),),
        lambda z: ((z, _ce_labels(z)), {"reduction": "none"})),
    "linear_softmax_cross_entropy": Case(
        "linear_softmax_cross_entropy",
        lambda impl: lambda x, w: jk.linear_softmax_cross_entropy(
            x, w, _linear_labels(x, w), reduction="none", chunk_size=16, implementation=impl),
        lambda cd: lambda x, w: cross_entropy_reference.linear_softmax_cross_entropy(
            x, w, _linear_labels(x, w), compute_dtype=cd)[0],
        lambda gen, shape: (_rows(gen, shape), _rows(gen, (shape[-1], 3 * shape[-1] // 2), 0.3)),
        lambda x, w: ((x, w, _linear_labels(x, w)), {"reduction": "none", "chunk_size": 16})),
    "flash_attention": Case(
        "flash_attention",
        lambda impl: lambda q, k, v: jk.flash_attention(q, k, v, causal=True,
                                                        implementation=impl),
        lambda cd: lambda q, k, v: attention_reference.attention(
            q, k, v, window=Window.of(True, None), scale=q.shape[-1] ** -0.5,
            compute_dtype=cd),
        _attention_arrays,
        lambda q, k, v: ((q, k, v), {"causal": True})),
    "decode_attention": Case(
        "decode_attention",
        lambda impl: lambda q, k, v: jk.decode_attention(q, k, v, lengths=_lengths(k),
                                                         implementation=impl),
        lambda cd: lambda q, k, v: attention_reference.decode(
            q, k, v, _lengths(k), scale=q.shape[-1] ** -0.5, compute_dtype=cd),
        _decode_arrays,
        lambda q, k, v: ((q, k, v), {"lengths": _lengths(k)})),
}

# Variants of an op the sharded tests take as cases of their own: glu of [gate | up] side by
# side, whose halves pair within a row (a split last axis is gathered).
VARIANTS: dict[str, Case] = {
    "glu_packed": Case(
        "glu",
        lambda impl: lambda x: jk.glu(x, implementation=impl),
        lambda cd: lambda x: elementwise_reference.glu(*jnp.split(x, 2, axis=-1),
                                                       compute_dtype=cd),
        lambda gen, shape: (_rows(gen, shape),),
        lambda x: ((x,), {}),
        ("rows",)),
}
