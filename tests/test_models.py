"""The Llama model trains on jaxkernels' ops, agrees with its plain-JAX twin, splits its batch
over a mesh step for step, and refuses configs that do not exist."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxkernels as jk
from models import llama
from tests import numerics

TINY = llama.preset("tiny", max_len=32, depth=1)  # one layer: a step compiles sooner
# The ops a Llama step calls (and glu, where the product's gated epilogue runs apart).
MODEL_OPS = ("flash_attention", "linear_softmax_cross_entropy", "matmul", "rms_norm")


def _tokens(cfg, batch=4, seed_label="tokens"):
  gen = numerics.rng(seed_label)
  return jnp.asarray(gen.integers(0, cfg.vocab, (batch, cfg.max_len)), jnp.int32)


def test_tiny_loss_falls():
  """A real curve: 12 AdamW steps on one batch, the loss falling at (nearly) every step and by
  more than a nat in all."""
  model, optimizer = llama.make(llama.preset("tiny"))
  tokens = _tokens(llama.PRESETS["tiny"])
  losses = np.array([float(llama.train_step(model, optimizer, tokens)) for _ in range(12)])
  assert np.all(np.isfinite(losses))
  assert losses[0] == pytest.approx(np.log(256), rel=0.02)  # uniform at the start
  assert losses[-1] < losses[0] - 1.0, losses
  assert np.sum(np.diff(losses) < 0) >= 10, losses


def test_kernels_match_the_xla_path():
  """kernels="jaxkernels" (on the CPU the Triton kernels, interpreted) against kernels="xla"
  (XLA ops, optax's loss on the whole logits): the first step's loss and every gradient, same
  parameters."""
  tokens = _tokens(TINY, seed_label="match")
  want_model, _ = llama.make(dataclasses.replace(TINY, kernels="xla"), seed=3)
  # One program each (op by op, every primitive of the model compiled on its own: 2x the time).
  loss_and_grads = nnx.jit(nnx.value_and_grad(llama.loss_fn))
  with jax.default_matmul_precision("highest"):
    want_loss, want_grads = loss_and_grads(want_model, tokens)
  # Float32 throughout: each fused op may differ from XLA's by its reduction's rounding, ~4 eps
  # sqrt(n) for its longest reduction (the vocabulary's or the width's); they pass through.
  tolerance = 4 * numerics.F32_EPS * TINY.vocab**0.5 * (4 * TINY.depth + 2)
  model, _ = llama.make(TINY, seed=3)
  # Compiled on a GPU, the device's best kernels; on the CPU, Triton's interpreted. Every op
  # call on them (none falling back: XLA's reference would match XLA's path by construction).
  with numerics.kernel_mode("triton"), jax.default_matmul_precision("highest"), \
       numerics.served_by(None if numerics.COMPILED else "triton", MODEL_OPS):
    loss, grads = loss_and_grads(model, tokens)
  assert abs(float(loss) - float(want_loss)) <= tolerance * abs(float(want_loss))
  errors = numerics.errors(jax.tree.leaves(nnx.state(grads)),
                           [np.asarray(g) for g in jax.tree.leaves(nnx.state(want_grads))])
  assert max(errors) <= tolerance, (max(errors), tolerance)


def _loss_jaxpr(cfg, tokens, grad: bool = False):
  """The jaxpr of the model's loss under ``cfg`` (with its gradients where ``grad``), the
  kernels traced as Triton's interpreted ones: nothing runs."""
  graphdef, state = nnx.split(llama.make(cfg, seed=2)[0])
  loss = lambda state: llama.loss_fn(nnx.merge(graphdef, state), tokens)
  with jk.interpret_mode("triton"):
    return jax.make_jaxpr(jax.value_and_grad(loss) if grad else loss)(state)


def _kernels_in(cfg, tokens) -> collections.Counter:
  """The Pallas kernel calls (by their jk_<op>_<pass> names) of a train step's loss and
  gradients under ``cfg``, read from its jaxpr: pallas_call's, and mpmd_map's (plgpu.kernel's,
  the Mosaic GPU kernels but the matmul; core_map's on a JAX that binds that)."""
  jaxpr = _loss_jaxpr(cfg, tokens, grad=True)
  names = collections.Counter()

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name in ("pallas_call", "mpmd_map", "core_map"):
        names[eqn.params["name"]] += 1
      for value in eqn.params.values():
        for sub in value if isinstance(value, (list, tuple)) else [value]:
          inner = getattr(sub, "jaxpr", sub)  # a closed jaxpr's, or a jaxpr itself
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(jaxpr.jaxpr)
  return names


def test_reference_ops_put_each_op_group_on_the_xla_path():
  """reference_ops naming every group calls no kernel (kernels="xla"'s path); each group left
  alone on the kernels calls some, and the groups' calls add up to the whole model's, each
  kernel call counted once (no call switched by two groups, none by no group)."""
  tokens = _tokens(TINY, seed_label="reference_ops")
  assert not _kernels_in(dataclasses.replace(TINY, reference_ops=llama.OPS), tokens)
  every = _kernels_in(TINY, tokens)
  alone = {op: _kernels_in(dataclasses.replace(
      TINY, reference_ops=tuple(o for o in llama.OPS if o != op)), tokens) for op in llama.OPS}
  assert all(alone.values()), alone
  assert sum(alone.values(), collections.Counter()) == every, (every, alone)


def test_a_tpu_leaves_norms_products_and_mlp_to_xla_unless_told():
  """Left to the platform (reference_ops=None), a TPU's model runs the norms, the products
  and the MLP on XLA (which fuses them into its dots) and keeps attention's and the loss's
  kernels, every call of theirs; a GPU's runs every group on kernels; a tuple given, even
  empty, is taken as it is."""
  assert TINY.reference_ops is None
  assert TINY.for_platform("gpu").reference_ops == ()
  assert TINY.for_platform("tpu").reference_ops == llama.TPU_REFERENCE_OPS
  assert dataclasses.replace(TINY, reference_ops=()).for_platform("tpu").reference_ops == ()
  tokens = _tokens(TINY, seed_label="tpu default")
  kept = _kernels_in(TINY.for_platform("tpu"), tokens)
  assert kept and all("attention" in name or "entropy" in name for name in kept), kept


def _scan_outputs(cfg, tokens) -> list:
  """The (shape, dtype) of each value the scanned layers hand on (the carry out, then any
  stacked outputs), read from the forward's jaxpr."""
  jaxpr = _loss_jaxpr(cfg, tokens)
  scans = [eqn for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "scan"]
  assert len(scans) == 1, [eqn.primitive.name for eqn in jaxpr.jaxpr.eqns]
  return [(v.aval.shape, v.aval.dtype) for v in scans[0].outvars]


@pytest.mark.parametrize("stream", ["bfloat16", "float32"])
def test_the_stream_crosses_each_layer_in_its_dtype_and_trains(stream):
  """Config.stream: the residual stream (and the block's output added to it) is carried from
  layer to layer in ``stream``, a bfloat16 one never widened to float32 between layers (the
  traffic it saves); a real curve trains on it."""
  cfg = dataclasses.replace(TINY, dtype="bfloat16", stream=stream, scan_layers=True)
  tokens = _tokens(cfg, seed_label="stream")
  b, t, width = tokens.shape[0], tokens.shape[1] - 1, cfg.width  # inputs: all but the last
  # The carry: the (B, T, width) values handed on (the stacked outputs have a layer axis).
  carried = sorted(str(dtype) for shape, dtype in _scan_outputs(cfg, tokens)
                   if shape == (b, t, width))
  assert carried == sorted(["bfloat16", stream]), carried  # the block's output, the stream
  # Trained on the references in float32 activations (a GPU's bfloat16 ones would go to cuDNN,
  # which takes no length of 31): only the stream is narrow.
  model, optimizer = llama.make(dataclasses.replace(cfg, kernels="xla", dtype="float32"), seed=1)
  losses = np.array([float(llama.train_step(model, optimizer, tokens)) for _ in range(8)])
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("policy,kernels,scan", [
    ("full", "xla", False), ("minimal", "xla", True), ("dots", "xla", False),
    (("full", "dots"), "xla", False), ("dots", "jaxkernels", False)])
def test_remat_changes_no_number(policy, kernels, scan):
  """Each policy (one for all layers, or one a layer), unrolled or scanned, on the references
  and on the kernels (Triton's, interpreted: matmul names its output for "dots"), against
  policy "none" unrolled: the same loss and gradients. Float32 products in float32: under
  tf32 (a GPU's default) two programs may round differently (2e-7 of 5e-4 on the H100)."""
  cfg = TINY if isinstance(policy, str) else dataclasses.replace(TINY, depth=len(policy))
  tokens = _tokens(cfg, seed_label="remat")
  context = contextlib.nullcontext() if kernels == "xla" or numerics.COMPILED else \
      jk.interpret_mode("triton")
  with context, jax.default_matmul_precision("highest"):
    (loss, grads), (want_loss, want_grads) = [  # each one program, as a train step runs it
        nnx.jit(nnx.value_and_grad(llama.loss_fn))(llama.make(dataclasses.replace(
            cfg, remat=name, kernels=kernels, scan_layers=layers), seed=1)[0], tokens)
        for name, layers in ((policy, scan), ("none", False))]
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(nnx.state(grads)), jax.tree.leaves(nnx.state(want_grads))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.cpu_only
# The kernels on Explicit axes run in test_train's explicit-meshes test: here under SLOW.
@pytest.mark.parametrize("interpreted,axis_type", numerics.some(
    [pytest.param(*case) for case in ((False, "Explicit"), (True, "Explicit"), (True, "Auto"))],
    keep={"False-Explicit", "True-Auto"}))
def test_data_parallel_train_step_matches_one_device(interpreted, axis_type):
  """The batch split over 8 host devices (parameters and optimizer state replicated): the same
  losses, step for step, as on one device; with the kernels (Triton, interpreted) splitting
  with the batch, and on the references. On Explicit axes the ops read the split from the
  arrays' types; on Auto axes (jax.sharding.Mesh's default, in context) from the default
  rules (batch over "data"), with nothing gathered or warned."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  tokens = [_tokens(TINY, batch=8, seed_label=("dp", i)) for i in range(3)]
  context = jk.interpret_mode("triton") if interpreted else contextlib.nullcontext()
  with context:
    model, optimizer = llama.make(TINY, seed=3)
    want = [float(llama.train_step(model, optimizer, t)) for t in tokens]
    model, optimizer = llama.make(TINY, seed=3)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",),
                             axis_types=(getattr(AxisType, axis_type),))
    state = nnx.state((model, optimizer))
    nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))
    with jax.set_mesh(mesh), warnings.catch_warnings():
      warnings.simplefilter("error", jk.ShardingWarning)
      got = [float(llama.train_step(model, optimizer,
                                    jax.device_put(t, NamedSharding(mesh, P("data")))))
             for t in tokens]
  # Float32 throughout; the gradients' sums over the batch run in another order across shards.
  np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.cpu_only
def test_the_layout_follows_the_rules_set():
  """The parameters' layout: llama.RULES (each weight's width over fsdp) where no rules are
  set; the user's jk.sharding_rules (or Flax's) where they are, as the ops take theirs."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  from flax import nnx as flax_nnx

  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
  state = nnx.state(llama.make(TINY, seed=0)[0])
  # (layers, embed, heads (the kv heads' groups), the group's q, k and v, head dim)
  qkv = lambda: tuple(llama.shardings(state, mesh)["blocks"]["qkv"].spec)[:3]
  with jk.sharding_rules(None):
    assert qkv() == (None, "fsdp", None)  # the mesh has no tensor axis
  with jk.sharding_rules(embed="data", heads=("fsdp", "data")):
    assert qkv() == (None, "data", "fsdp")  # "data" taken by embed already
  with jk.sharding_rules(None), flax_nnx.logical_axis_rules([("heads", "fsdp")]):
    assert qkv() == (None, None, "fsdp")


def test_bad_configs_say_what_exists():
  with pytest.raises(ValueError, match="preset 'huge' does not exist; presets: tiny, 125m"):
    llama.preset("huge")
  with pytest.raises(ValueError, match=r"remat='most' is not one of \('none', 'full'"):
    llama.preset("tiny", remat="most")
  with pytest.raises(ValueError, match=r"kernels='cuda' is not one of \('jaxkernels', 'xla'\)"):
    llama.preset("tiny", kernels="cuda")
  with pytest.raises(ValueError, match=r"reference_ops=\('loss', 'mlps'\): each must be one"):
    llama.preset("tiny", reference_ops=("loss", "mlps"))
  with pytest.raises(ValueError, match=r"stream='int8' is not one of \('float32', 'bfloat16'"):
    llama.preset("tiny", stream="int8")
  with pytest.raises(ValueError, match="heads into kv_heads 3"):
    llama.preset("tiny", kv_heads=3)
  with pytest.raises(ValueError, match=r"one policy per layer \(2\), each one of"):
    llama.preset("tiny", remat=("none", "most"))
  with pytest.raises(ValueError, match=r"one policy per layer \(2\)"):
    llama.preset("tiny", remat=("none",))
  with pytest.raises(ValueError, match="per-layer remat policies need scan_layers=False"):
    llama.preset("tiny", remat=("none", "full"), scan_layers=True)
  with pytest.raises(ValueError, match="remat='auto' must be resolved first"):
    llama.make(llama.preset("tiny", remat="auto"))


def test_mfu_counts_as_the_issues_table():
  """The issue's rows: width 1024, 24 layers, heads 16/4, MLP 2816 (303M matmul parameters),
  batch 8 x 2048 in 120 ms is 33.5% MFU; width 2048, 16 layers, MLP 5632 (787M), batch 4 in
  112 ms is 40.8%: PaLM's count, attention's 12·L·T·width a token not halved by the mask."""
  for name, batch, ms, want in (("350m", 8, 120, 33.5), ("1b", 4, 112, 40.8)):
    cfg = llama.PRESETS[name]
    rate = batch * 2048 / (ms / 1e3)
    assert llama.mfu(cfg, rate, 2048, 989e12) == pytest.approx(want, abs=0.15)  # ms rounded
    assert llama.mfu(cfg, rate, 2048, 989e12, causal_half=True) < 0.93 * want
  assert 300e6 < llama.PRESETS["350m"].matmul_params < 306e6
