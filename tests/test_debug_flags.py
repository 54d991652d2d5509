"""JAX's debug flags over every op: ``jax.debug_nans`` and ``jax.debug_infs`` check every
primitive's output op by op (and a jitted call's outputs), so an op that makes a NaN or an inf
inside, where its result has none, stops a user's program that sets them. Every op, forward
and backward, with the inputs that reach its edge cases (a fully masked softmax row, an
ignored label, a query that sees no key), runs clean and gives what it gives without them.

On the XLA path here; the kernels compiled in the GPU check (interpreted, a kernel's body runs
op by op, and its -inf initial maxima are its own business, invisible compiled): the device's
best on float32, and Mosaic GPU's on bfloat16 at its widths, each call asserted to have run on
the kernels it names."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkernels as jk
from tests import numerics


def _cases(wide=False):
  """(op(a, implementation), a, the flags) by name; float32 and small, or ``wide``: bfloat16 at
  widths Mosaic GPU takes (rows of whole 128-element vectors, heads of 128, 64-row tiles)."""
  gen = numerics.rng("debug flags", wide)
  dtype, rows, width, vocab, t, h = ((jnp.bfloat16, 128, 256, 384, 128, 128) if wide else
                                     (jnp.float32, 6, 32, 24, 8, 16))
  half = width // 2
  x = numerics.normal(gen, (rows, width), dtype)
  masked = x.at[2].set(-jnp.inf).at[3, :half].set(-jnp.inf)  # a row all -inf, one half
  scale = numerics.normal(gen, (width,), jnp.float32, shift=1.0)
  w = numerics.normal(gen, (width, vocab), dtype, scale=0.2)
  labels = jnp.asarray(gen.integers(0, min(vocab, width), rows), jnp.int32).at[2::3].set(-100)
  q = numerics.normal(gen, (2, t, 4, h), dtype)
  kv = numerics.normal(gen, (2, t, 2, h), dtype)
  segments = jnp.stack([jnp.arange(t) >= t // 2, jnp.arange(t) >= 3 * t // 8]).astype(jnp.int32)
  hidden = jnp.zeros((t, t)).at[3].set(-jnp.inf)  # query 3 sees no key
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
          a[:, :min(vocab, width)], labels, ignore_index=-100, z_loss=1e-4,
          implementation=impl), x, both),
      "linear_softmax_cross_entropy (ignored)": (lambda a, impl: jk.linear_softmax_cross_entropy(
          a, w, labels, ignore_index=-100, implementation=impl), x, both),
      "matmul": (lambda a, impl: jk.matmul(a, w, activation="gelu", implementation=impl), x,
                 both),
      "glu": (lambda a, impl: jk.glu(a[:, :half], a[:, half:], implementation=impl), x, both),
      "bias_activation": (lambda a, impl: jk.bias_activation(a, scale, activation="silu",
                                                             implementation=impl), x, both),
      "flash_attention (segments, window)": (lambda a, impl: jk.flash_attention(
          a, kv, kv, local_window_size=(2, 0), segment_ids=segments, implementation=impl), q,
          both),
      "flash_attention (a row sees nothing)": (lambda a, impl: jk.flash_attention(
          a, kv, kv, bias=hidden, implementation=impl), q, nans),
      "decode_attention (length 0)": (lambda a, impl: jk.decode_attention(
          a[:, :1], kv, kv, lengths=jnp.array([0, t - 2]), implementation=impl), q, both),
  }


CASES = tuple(_cases())


# "kernels": the device's best (float32: Triton's on Hopper); "mosaic_gpu": Mosaic GPU's,
# named, on bfloat16 at its widths. Both compiled, each call asserted to have run on them.
@pytest.mark.parametrize("impl", ["xla", "kernels", "mosaic_gpu"])
@pytest.mark.parametrize("name", CASES)
def test_every_op_runs_clean_under_debug_nans_and_infs(name, impl):
  if impl != "xla" and not numerics.COMPILED:
    pytest.skip("interpreted kernels run their bodies op by op; the GPU check runs this "
                "compiled")
  wide = impl == "mosaic_gpu"
  op, a, flags = _cases(wide)[name]
  impl = None if impl == "kernels" else impl  # the device's best: any kernel must serve
  value_and_grad = jax.value_and_grad(lambda a: jnp.sum(op(a, impl).astype(jnp.float32)))
  with numerics.kernel_mode(), numerics.served_by(impl):
    want = value_and_grad(a)
    with jax.debug_nans(True), jax.debug_infs("infs" in flags):
      got = value_and_grad(a)
      jitted = jax.jit(value_and_grad)(a)
  chex.assert_trees_all_close(got, want, atol=0, rtol=0)
  # One program against op by op: XLA fuses and reassociates. The value is a float32 sum of
  # up to 32768 outputs that cancel: two summation trees differ by up to 2 log2(n) units of
  # the sum of their magnitudes, and each output by its own op's few units more; 64 units of
  # that sum bound both (a fixed 1e-5 of the cancelled sum failed on one seed: 1.5e-4 at 11.6).
  # A 16-bit output's elements may each round the other way in the other program (a fused
  # float32 value on either side of a rounding boundary): one unit of its dtype each, more.
  magnitude = float(jnp.sum(jnp.abs(op(a, impl).astype(jnp.float32))))
  unit = 0.0 if a.dtype == jnp.float32 else float(jnp.finfo(a.dtype).eps)
  chex.assert_trees_all_close(jitted[0], want[0],
                              atol=(64 * numerics.F32_EPS + unit) * magnitude, rtol=0)
  # The gradient's elements: float32's few units, or that one unit of a 16-bit gradient.
  chex.assert_trees_all_close(jitted[1], want[1], atol=unit or 1e-5, rtol=unit or 1e-5)
  chex.assert_tree_all_finite(got)
  assert np.all(np.isfinite(np.asarray(got[1], np.float32)))
