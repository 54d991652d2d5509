"""JAX's debug flags over every op: ``jax.debug_nans`` and ``jax.debug_infs`` check every
primitive's output op by op (and a jitted call's outputs), so an op that makes a NaN or an inf
inside, where its result has none, stops a user's program that sets them. Every op, forward
and backward, with the inputs that reach its edge cases (a fully masked softmax row, an
ignored label, a query that sees no key), runs clean and gives what it gives without them.

On the XLA path here; the kernels compiled in the GPU check (interpreted, a kernel's body runs
op by op, and its -inf initial maxima are its own business, invisible compiled)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkernels as jk
from tests import numerics


def _cases():
  gen = numerics.rng("debug flags")
  x = numerics.normal(gen, (6, 32), jnp.float32)
  masked = x.at[2].set(-jnp.inf).at[3, :16].set(-jnp.inf)  # a row all -inf, one half
  scale = numerics.normal(gen, (32,), jnp.float32, shift=1.0)
  w = numerics.normal(gen, (32, 24), jnp.float32, scale=0.2)
  labels = jnp.asarray([0, 5, -100, 23, 7, -100], jnp.int32)
  q = numerics.normal(gen, (2, 8, 4, 16), jnp.float32)
  kv = numerics.normal(gen, (2, 8, 2, 16), jnp.float32)
  segments = jnp.asarray([[0] * 4 + [1] * 4, [0] * 3 + [1] * 5], jnp.int32)
  hidden = jnp.zeros((8, 8)).at[3].set(-jnp.inf)  # query 3 sees no key
  # (op(a, implementation), a, the flags): an input that holds -inf passes it through any
  # op (jax.nn's too), which debug_infs reports: such a case runs under debug_nans alone.
  both, nans = ("nans", "infs"), ("nans",)
  return {
      "rms_norm": (lambda a, impl: jk.rms_norm(a, scale, residual=a, implementation=impl)[0],
                   x, both),
      "layer_norm": (lambda a, impl: jk.layer_norm(a, scale, scale, implementation=impl), x,
                     both),
      "softmax (masked rows)": (lambda a, impl: jk.softmax(a, implementation=impl), masked,
                                nans),
      "softmax_cross_entropy (ignored)": (lambda a, impl: jk.softmax_cross_entropy(
          a[:, :24], labels, ignore_index=-100, z_loss=1e-4, implementation=impl), x, both),
      "linear_softmax_cross_entropy (ignored)": (lambda a, impl: jk.linear_softmax_cross_entropy(
          a, w, labels, ignore_index=-100, implementation=impl), x, both),
      "matmul": (lambda a, impl: jk.matmul(a, w, activation="gelu", implementation=impl), x,
                 both),
      "glu": (lambda a, impl: jk.glu(a[:, :16], a[:, 16:], implementation=impl), x, both),
      "bias_activation": (lambda a, impl: jk.bias_activation(a, scale, activation="silu",
                                                             implementation=impl), x, both),
      "flash_attention (segments, window)": (lambda a, impl: jk.flash_attention(
          a, kv, kv, local_window_size=(2, 0), segment_ids=segments, implementation=impl), q,
          both),
      "flash_attention (a row sees nothing)": (lambda a, impl: jk.flash_attention(
          a, kv, kv, bias=hidden, implementation=impl), q, nans),
      "decode_attention (length 0)": (lambda a, impl: jk.decode_attention(
          a[:, :1], kv, kv, lengths=jnp.array([0, 6]), implementation=impl), q, both),
  }


CASES = tuple(_cases())


@pytest.mark.parametrize("impl", ["xla", "kernels"])
@pytest.mark.parametrize("name", CASES)
def test_every_op_runs_clean_under_debug_nans_and_infs(name, impl):
  if impl == "kernels" and not numerics.COMPILED:
    pytest.skip("interpreted kernels run their bodies op by op; the GPU check runs this "
                "compiled")
  op, a, flags = _cases()[name]
  impl = None if impl == "kernels" else impl
  value_and_grad = jax.value_and_grad(lambda a: jnp.sum(op(a, impl)))
  want = value_and_grad(a)
  with jax.debug_nans(True), jax.debug_infs("infs" in flags):
    got = value_and_grad(a)
    jitted = jax.jit(value_and_grad)(a)
  chex.assert_trees_all_close(got, want, atol=0, rtol=0)
  # One program against op by op: XLA fuses and reassociates. The value is a float32 sum of
  # up to 1024 outputs that cancel: two summation trees differ by up to 2 log2(n) units of
  # the sum of their magnitudes, and each output by its own op's few units more; 64 units of
  # that sum bound both (a fixed 1e-5 of the cancelled sum failed on one seed: 1.5e-4 at 11.6).
  magnitude = float(jnp.sum(jnp.abs(op(a, impl))))
  chex.assert_trees_all_close(jitted[0], want[0], atol=64 * numerics.F32_EPS * magnitude,
                              rtol=0)
  chex.assert_trees_all_close(jitted[1], want[1], atol=1e-5, rtol=1e-5)
  chex.assert_tree_all_finite(got)
  assert np.all(np.isfinite(np.asarray(got[1])))
