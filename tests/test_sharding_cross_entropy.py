"""The fused loss on sharded arrays: dW summed over token shards in float32, vocabulary
parallelism (each device's row kernels on its slice of the vocabulary), compiled for TPUs."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxkernels as jk
from jaxkernels.ops.cross_entropy import reference as cross_entropy_reference
from tests import numerics
from tests.sharding import put, tpu_compile

pytestmark = pytest.mark.cpu_only  # the mesh is of host devices, the kernels interpreted


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_loss_dw_is_summed_in_float32_and_rounded_once(mesh, reduction):
  """The fused loss's dw, tokens split over all 8 devices, w bfloat16 and whole (x float32:
  its logits and dlogits carry no rounding of their own): kept in float32 through the sum
  across shards and rounded once, as close to the exact dw as one rounding of it (within
  10%); each shard's rounded to bfloat16 and summed so, it was 1.26x that."""
  gen = numerics.rng("sharding", "linear dw", reduction)
  x = numerics.normal(gen, (512, 32), jnp.float32)
  w = numerics.normal(gen, (32, 48), jnp.bfloat16)
  labels = jnp.asarray(gen.integers(0, 48, 512), jnp.int32)
  logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  p[np.arange(512), np.asarray(labels)] -= 1
  exact = np.asarray(x, np.float64).T @ (p / (512 if reduction == "mean" else 1))
  once = np.asarray(jnp.asarray(exact, jnp.bfloat16), np.float64)
  error = lambda got: np.linalg.norm(np.asarray(got, np.float64) - exact) / np.linalg.norm(exact)

  def loss(x, w, labels):
    out = jk.linear_softmax_cross_entropy(x, w, labels, reduction=reduction)
    return out if reduction == "mean" else jnp.sum(out)

  with jk.interpret_mode("triton"):
    dw = jax.jit(jax.grad(loss, argnums=1))(put(mesh, x, P(("data", "model"), None)),
                                             put(mesh, w, P()),
                                             put(mesh, labels, P(("data", "model"))))
  assert dw.dtype == jnp.bfloat16 and dw.sharding.spec in (P(), P(None, None))
  assert error(dw) <= 1.1 * error(once), (error(dw), error(once))


# Vocabulary parallelism: (x's spec, w's spec) on the (data 4, model 2) mesh.
VOCAB_LAYOUTS = {"tokens x vocabulary": (P("data", None), P(None, "model")),
                 "vocabulary over all": (P(), P(None, ("data", "model")))}


@pytest.mark.parametrize("layout", sorted(VOCAB_LAYOUTS))
@pytest.mark.parametrize("impl,options", [
    ("triton", dict(reduction="none")),
    ("xla", dict(reduction="mean", label_smoothing=0.1, z_loss=1e-3, ignore_index=-1)),
    ("triton", dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3, ignore_index=-1))],
    ids=["triton-none", "xla-smoothing-zloss-ignore-mean", "triton-smoothing-zloss-ignore-sum"])
def test_linear_loss_vocabulary_parallel(mesh, layout, impl, options):
  """w split over its vocabulary: each slice's log-sum-exp, label logit and logit sum combined
  by collectives of one number a token (never the logits, never w gathered), forward and both
  gradients by the numerics rule against the unsplit loss; labels in every slice, ignored
  rows among them; dw stays split as w is."""
  spec_x, spec_w = VOCAB_LAYOUTS[layout]
  gen = numerics.rng("sharding-vocab", layout, impl, str(options))
  tokens, d, vocab = 64, 32, 96
  x = numerics.normal(gen, (tokens, d), jnp.float32)
  w = numerics.normal(gen, (d, vocab), jnp.float32, d ** -0.5)
  labels = jnp.asarray(gen.integers(0, vocab, tokens), jnp.int32)
  if options.get("ignore_index") is not None:
    labels = labels.at[::7].set(options["ignore_index"])
  reduction = options["reduction"]
  kw = {k: v for k, v in options.items() if k != "reduction"}
  ct = (numerics.normal(gen, (tokens,), jnp.float32) if reduction == "none"
        else jnp.float32(1.3))

  def ref(cd):
    def f(x, w):
      loss = cross_entropy_reference.linear_softmax_cross_entropy(x, w, labels,
                                                                 compute_dtype=cd, **kw)[0]
      kept = jnp.ones(labels.shape, bool) if kw.get("ignore_index") is None else (
          labels != kw["ignore_index"])
      if reduction == "sum":
        return jnp.sum(loss)
      if reduction == "mean":
        return jnp.sum(loss) / jnp.maximum(jnp.sum(kept), 1).astype(cd)
      return loss
    return f

  fn = jax.jit(lambda x, w: jk.linear_softmax_cross_entropy(
      x, w, put(mesh, labels, P(*spec_x[:1])), reduction=reduction, chunk_size=16,
      implementation=impl, **kw))
  sx, sw = put(mesh, x, spec_x), put(mesh, w, spec_w)
  with jk.interpret_mode("triton"), warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out, vjp = jax.vjp(fn, sx, sw)
    got = (out, vjp(ct))
    text = jax.jit(lambda x, w: jax.vjp(fn, x, w)[1](ct)).lower(sx, sw).compile().as_text()
  assert not [w_ for w_ in caught if issubclass(w_.category, jk.ShardingWarning)], [
      str(w_.message) for w_ in caught]
  assert "all-gather" not in text  # neither w nor the logits gathered
  assert got[1][1].sharding.spec == spec_w  # dw split as w is
  numerics.assert_matches(got, ref, (x, w), ct, dtype=jnp.float32, reduction=max(vocab, tokens))


def test_tpu_compile_vocabulary_parallel_loss(tpu4):
  """The fused loss with w's vocabulary split over 2 chips and the tokens over the other 2,
  compiled for the TPU (Explicit axes): the Mosaic row kernels run per chip on a slice of the
  vocabulary, forward and backward, and nothing is gathered; the collectives are reductions of
  one number a token (and dx's sum over the slices)."""
  mesh = jax.sharding.Mesh(tpu4.devices.reshape(2, 2), ("data", "model"),
                           axis_types=(AxisType.Explicit,) * 2)
  struct = lambda shape, dtype, spec: jax.ShapeDtypeStruct(
      shape, dtype, sharding=NamedSharding(mesh, spec))
  x = struct((4096, 512), jnp.bfloat16, P("data", None))
  w = struct((512, 32768), jnp.bfloat16, P(None, "model"))
  labels = struct((4096,), jnp.int32, P("data"))
  loss = lambda x, w, y: jk.linear_softmax_cross_entropy(x, w, y, implementation="mosaic_tpu")
  with warnings.catch_warnings():
    warnings.simplefilter("error", jk.ShardingWarning)
    compiled = tpu_compile(mesh, jax.value_and_grad(loss, argnums=(0, 1)), x, w, labels)
  text = compiled.as_text()
  assert "all-gather" not in text and "all-to-all" not in text
  assert "jk_cross_entropy_fwd" in text and "jk_cross_entropy_bwd" in text
  assert "all-reduce" in text


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_class_mask_on_split_tokens_matches_unsplit(mesh, reduction):
  """optax's class-wise ``where`` (XLA's path: no kernel takes it, so the call names no kernel)
  on logits, labels and mask split over the tokens (Explicit axes): the mask split with the
  logits, the loss and its gradient the unsplit call's, the mean over the tokens that take in
  a class."""
  gen = numerics.rng("sharding", "class mask", reduction)
  logits = numerics.normal(gen, (16, 40), jnp.float32, 2.0)
  labels = jnp.asarray(gen.integers(0, 40, 16), jnp.int32)
  mask = jnp.asarray(gen.random((16, 40)) < 0.6).at[3].set(False)  # token 3 takes in none

  def loss(z, y, m):
    out = jk.softmax_cross_entropy(z, y, where=m, reduction=reduction, implementation="xla")
    return out if reduction == "mean" else jnp.sum(out * out)

  want = jax.value_and_grad(loss)(logits, labels, mask)
  spec = P(("data", "model"))
  got = jax.jit(jax.value_and_grad(loss))(put(mesh, logits, spec), put(mesh, labels, spec),
                                           put(mesh, mask, spec))
  # The same float32 reference both ways; only the sums' order differs (the classes', 40, and
  # the mean's over the shards): the rule's float32 floor, 4 eps sqrt(n), relative to each
  # leaf's largest element.
  floor = 4 * numerics.F32_EPS * np.sqrt(40)
  assert max(numerics.errors(got, want)) <= floor, (numerics.errors(got, want), floor)
  assert got[1].sharding.spec[0] == ("data", "model")  # the gradient split as the logits
