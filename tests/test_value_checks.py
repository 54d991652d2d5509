"""Values known only when the computation runs: decode_attention's lengths and the losses'
checked labels. Concrete, they raise at once; traced, they are checked by
``jax.experimental.checkify`` (the op's own message first, a ValueError), and where the
function is not checkified decode clips its lengths into [0, S] (as its docstring says) and
a checked label refuses to compile with JAX's own reason."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jaxkernels as jk
from jaxkernels.ops.attention import reference
from tests import numerics

LABELS_SAID = (r"softmax_cross_entropy: labels must be in \[0, 8\) \(the classes, or "
               r"ignore_index -100\); labels\[{}\] is {} \({} such\)")


def _loss(z, y):
  return jk.softmax_cross_entropy(z, y, ignore_index=-100, labels_checked=True)


def test_concrete_labels_raise_at_once():
  z = jnp.zeros((4, 8))
  with pytest.raises(ValueError, match=LABELS_SAID.format(1, 8, 2)):
    _loss(z, jnp.array([1, 8, -100, -1], jnp.int32))
  with pytest.raises(ValueError, match=r"linear_softmax_cross_entropy: labels must be in "
                     r"\[0, 8\) \(the classes\); labels\[0, 1\] is 9"):
    jk.linear_softmax_cross_entropy(jnp.ones((2, 2, 16)), jnp.ones((16, 8)),
                                    jnp.array([[1, 9], [0, 0]]), labels_checked=True)
  # Under vmap or grad of concrete values the check runs as they are traced.
  with pytest.raises(ValueError, match=r"labels must be in \[0, 8\).*labels\[1\] is 8"):
    jax.vmap(_loss)(jnp.zeros((2, 3, 8)), jnp.array([[1, 2, 3], [0, 8, 1]], jnp.int32))
  assert np.isnan(float(jk.softmax_cross_entropy(z, jnp.array([1, 8, 0, 0]))))  # unchecked


def test_traced_labels_are_checked_under_checkify():
  z = jax.random.normal(jax.random.key(0), (2, 3, 8))
  bad = jnp.array([[1, 2, -100], [0, 3, -7]], jnp.int32)
  checked = jax.jit(checkify.checkify(_loss))
  err, _ = checked(z, bad)
  with pytest.raises(ValueError, match=LABELS_SAID.format("1, 2", -7, 1)):
    err.throw()
  good = jnp.array([[1, 2, -100], [0, 3, 7]], jnp.int32)
  err, loss = checked(z, good)
  err.throw()  # nothing to raise
  chex.assert_trees_all_close(loss, jk.softmax_cross_entropy(z, good, ignore_index=-100))
  # The gradient's program carries the check too.
  err, _ = jax.jit(checkify.checkify(jax.grad(_loss)))(z, bad)
  with pytest.raises(ValueError, match=LABELS_SAID.format("1, 2", -7, 1)):
    err.throw()


def test_traced_labels_unchecked_by_checkify_do_not_compile():
  """A jitted function that asks for the check but is not checkified: JAX refuses it as it
  compiles (no silent NaN, no runtime INTERNAL error with the message buried in it)."""
  with pytest.raises(ValueError, match="checkify.check which was not functionalized"):
    jax.jit(_loss)(jnp.zeros((4, 8)), jnp.array([1, 2, 3, 4], jnp.int32))


def _decode(q, k, v, lengths, implementation=None):
  return jk.decode_attention(q, k, v, lengths=lengths, implementation=implementation)


def _caches():
  keys = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(keys[0], (2, 2, 4, 16))  # two new queries: clipping moves them
  k, v = (jax.random.normal(key, (2, 10, 2, 16)) for key in keys[1:])
  return q, k, v


def test_traced_decode_lengths_are_clipped_into_the_cache():
  """Under jit, as its docstring says: a length past S is S, a negative one 0 (the query then
  sees no key: 0), on the XLA path and on the kernel dispatch picks (interpreted on the CPU,
  compiled on a GPU), in bfloat16 as decoding runs."""
  q, k, v = (x.astype(jnp.bfloat16) for x in _caches())
  lengths = jnp.array([13, -2], jnp.int32)
  clipped = jnp.array([10, 0], jnp.int32)
  want = _decode(q, k, v, clipped, "xla")
  chex.assert_trees_all_close(jax.jit(_decode, static_argnums=4)(q, k, v, lengths, "xla"), want)
  assert not np.asarray(want[1], np.float32).any()
  with numerics.kernel_mode(), numerics.served_by(None, ["decode_attention"]):
    got = jax.jit(_decode)(q, k, v, lengths)
  numerics.assert_matches(
      got, lambda dtype: lambda q, k, v: reference.decode(
          q.astype(dtype), k.astype(dtype), v.astype(dtype), clipped, scale=16 ** -0.5),
      (q, k, v), dtype=jnp.bfloat16, reduction=10)


def test_traced_decode_lengths_are_checked_under_checkify():
  q, k, v = _caches()
  checked = jax.jit(checkify.checkify(_decode))
  err, _ = checked(q, k, v, jnp.array([4, 11], jnp.int32))
  with pytest.raises(ValueError, match=r"decode_attention: lengths must be in \[0, 10\] \(the "
                     r"caches' length S\), got 11 at lengths\[1\]"):
    err.throw()
  err, out = checked(q, k, v, jnp.array([4, 10], jnp.int32))
  err.throw()
  chex.assert_trees_all_close(out, _decode(q, k, v, jnp.array([4, 10], jnp.int32)))
