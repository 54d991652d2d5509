"""Drop-in fidelity, as the peers' own suites found it (run unmodified with our ops behind
their names): optax's arguments by position, NumPy inputs as JAX types them. (The Flax norms'
dtype rule and mask: tests/test_flax.py.)"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkernels as jk
from tests import numerics


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_cross_entropy_takes_optaxs_arguments_by_position(axis):
  """optax calls ``softmax_cross_entropy_with_integer_labels(logits, labels, axis, where)``
  with ``axis`` (and ``where``) positional: ours takes them third and fourth, as optax's."""
  rng = numerics.rng("optax positional", axis)
  logits = jnp.asarray(rng.standard_normal((3, 5, 7)), jnp.float32)
  shape = tuple(n for d, n in enumerate(logits.shape) if d != axis % 3)
  labels = jnp.asarray(rng.integers(0, logits.shape[axis], shape))
  where = jnp.asarray(rng.random(shape) < 0.7)
  want = optax.softmax_cross_entropy_with_integer_labels(logits, labels, axis, where)
  got = jk.softmax_cross_entropy(logits, labels, axis, where, reduction="none")
  chex.assert_trees_all_close(jnp.where(where, got, 0.0), jnp.where(where, want, 0.0),
                              atol=1e-5, rtol=1e-5)


def test_numpy_float64_inputs_run_as_the_float32_jax_makes_them():
  """With x64 off JAX computes a NumPy float64 array as float32: so do our ops, on their
  kernels (as float64 they fell back to XLA with a warning)."""
  rng = numerics.rng("numpy float64")
  x, r = rng.standard_normal((16, 128)), rng.standard_normal((16, 128))
  assert x.dtype == np.float64
  calls = {
      "rms_norm": lambda: jk.rms_norm(x, np.ones(128), residual=r),
      "layer_norm": lambda: jk.layer_norm(x, np.ones(128), np.zeros(128)),
      "softmax": lambda: jk.softmax(x),
      "glu": lambda: jk.glu(x, r),
      "bias_activation": lambda: jk.bias_activation(x, np.zeros(128), activation="relu"),
      "softmax_cross_entropy": lambda: jk.softmax_cross_entropy(x, np.arange(16)),
  }
  for op, call in calls.items():
    with numerics.kernel_mode(), numerics.served_by(None, [op]):  # whichever kernel serves
      out = call()
    for leaf in jnp.atleast_1d(*out) if isinstance(out, tuple) else [out]:
      assert leaf.dtype == jnp.float32, (op, leaf.dtype)
  want = jk.rms_norm(jnp.asarray(x, jnp.float32), jnp.ones(128), implementation="xla")
  with numerics.kernel_mode(), jax.default_matmul_precision("highest"):
    chex.assert_trees_all_close(jk.rms_norm(x, np.ones(128)), want, atol=1e-5, rtol=1e-5)
