"""Ops on sharded arrays, what every op shares: the logical axis rules, a gather's warning (an
error for an explicit kernel), no mesh in context and host arrays through in_shardings (warned,
refused, never hung), a rule read one way, every op compiled for TPUs on Auto axes and lowered
for CUDA per shard. Each op's own layouts: tests/test_sharding_<op>.py."""

from __future__ import annotations

import time
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxkernels as jk
from jaxkernels import backend, partitioning
from jaxkernels.ops.norms import reference as norms_reference
from tests import numerics
from tests.sharding import (MOSAIC_GPU_ATTENTION_KERNELS, auto_mesh, in_own_process,
                            mosaic_gpu_attention_grads, put)

pytestmark = pytest.mark.cpu_only  # the mesh is of host devices, the kernels interpreted


def test_auto_mesh_splits_matmul_attention_and_the_fused_loss(mesh):
  """On the Auto mesh in context, jitted with in_shardings, the ops with rules of their own
  (Triton, interpreted; float32 products): matmul data parallel by the default rules and row
  parallel where the rules split "embed"; GQA attention with q's and k's heads split together
  where the rules split "heads"; the fused loss over the tokens. Each as its reference,
  forward and gradients, each shard's block in the program, nothing warned."""
  gen = numerics.rng("sharding-auto", "rules of their own")
  a = numerics.normal(gen, (8, 16, 64), jnp.float32)
  b = numerics.normal(gen, (64, 32), jnp.float32)
  q = numerics.normal(gen, (8, 16, 4, 16), jnp.float32)
  kv = numerics.normal(gen, (8, 16, 2, 16), jnp.float32)
  labels = jnp.asarray(gen.integers(0, 32, (8, 16)), jnp.int32)
  auto = auto_mesh()
  cases = {
      "matmul data parallel": (lambda a, b: jk.matmul(a, b), (a, b), None, "8x16x64", "2x16x64"),
      "matmul row parallel": (lambda a, b: jk.matmul(a, b), (a, b), {"batch": "data",
                              "embed": "model"}, "8x16x64", "2x16x32"),
      "attention heads": (lambda q, k, v: jk.flash_attention(q, k, v, causal=True),
                          (q, kv, kv), {"batch": "data", "heads": "model"}, "8x16x4x16",
                          "2x16x2x16"),
      "fused loss": (lambda x, w, y: jk.linear_softmax_cross_entropy(x, w, y), (a, b, labels),
                     None, "8x16x64", "2x16x64"),
  }
  fn_op = {"matmul data parallel": "matmul", "matmul row parallel": "matmul",
           "attention heads": "flash_attention", "fused loss": "linear_softmax_cross_entropy"}
  for name, (fn, args, rules, whole, local) in cases.items():
    shardings = tuple(NamedSharding(auto, P("data") if x.ndim > 2 else P()) for x in args)
    floats = [i for i, x in enumerate(args) if x.dtype == jnp.float32]
    value_and_grads = lambda *args: jax.value_and_grad(
        lambda *f: jnp.sum(fn(*[f[floats.index(i)] if i in floats else x
                                for i, x in enumerate(args)]) ** 2),
        argnums=tuple(range(len(floats))))(*[args[i] for i in floats])
    with jax.default_matmul_precision("highest"):
      want = jax.jit(value_and_grads)(*args)  # one device, XLA's path (the CPU's fallback)
      with jk.interpret_mode("triton"), jax.set_mesh(auto), jk.sharding_rules(rules), \
           warnings.catch_warnings(record=True) as caught, \
           numerics.served_by("triton", [fn_op[name]]):
        warnings.simplefilter("always")
        step = jax.jit(value_and_grads, in_shardings=shardings)
        got = step(*args)
        text = step.lower(*args).as_text()
    assert not [w for w in caught if issubclass(w.category, (jk.ShardingWarning,
                                                             jk.FallbackWarning))], (
        name, [str(w.message) for w in caught])
    chex.assert_trees_all_close(got, want, rtol=2e-5, atol=1e-5 * float(jnp.abs(want[0])))
    assert f"tensor<{local}xf32>" in text, (name, local)


def test_auto_mesh_rules_that_do_not_divide_keep_the_dimension_whole(mesh):
  """Rows the rules' axes do not divide (3 over "data"'s 4) run whole, warned once with what
  to do, and still match."""
  x = numerics.normal(numerics.rng("sharding-auto", "odd"), (3, 4, 128), jnp.float32)
  scale = jnp.ones((128,), jnp.float32)
  with jk.interpret_mode("triton"), jax.set_mesh(auto_mesh()), jk.sharding_rules(None), \
       pytest.warns(jk.ShardingWarning, match=r"dimension 0 \(size 3\) stays whole: the sharding "
                    r"rules split it over mesh axes \('data',\) \(size 4\)"):
    got = jax.jit(lambda x, s: jk.rms_norm(x, s))(x, scale)
  chex.assert_trees_all_close(got, jk.rms_norm(x, scale, implementation="xla"), rtol=1e-5,
                              atol=1e-6)


def test_sharding_rules_say_what_they_take():
  with pytest.raises(TypeError, match=r"the rule for 'batch' must be None, a mesh axis name or "
                     r"a tuple of them, got 3"):
    jk.sharding_rules(batch=3)
  with pytest.raises(TypeError, match=r"each rule must be a \(logical name, mesh axes\) pair"):
    jk.sharding_rules([("batch",)])
  mesh = auto_mesh()
  with jk.sharding_rules([("batch", "data"), ("batch", "model"), ("embed", ("model", "pod"))]):
    # The first rule of a name wins; an axis the mesh lacks is left out.
    assert partitioning.current_rules(mesh) == {"batch": ("data",), "embed": ("model",)}
    with jk.sharding_rules(None):
      assert partitioning.current_rules(mesh) == {"batch": ("data",)}  # the default
    assert partitioning.logical_spec(("batch", "length", "embed"), mesh) == ["data", None,
                                                                             "model"]


def test_gather_warns_once_and_an_explicit_kernel_refuses(mesh):
  x = put(mesh, jnp.ones((8, 128)), P("data", "model"))
  with jk.interpret_mode("triton"):
    with pytest.warns(jk.ShardingWarning, match=r"rms_norm: x's dimension 1 \(size 128\) is "
                      r"split over mesh axes \('model',\).*gathered, 0.0 MiB"):
      jax.jit(lambda x: jk.rms_norm(x, jnp.ones(128)))(x)
    with pytest.raises(ValueError, match="implementation='triton' cannot serve this call: x's "
                       "dimension 1"):
      jax.jit(lambda x: jk.rms_norm(x, jnp.ones(128), implementation="triton"))(x)
    # Over a model axis; over a data-like one ("data") B would be a fully sharded weight,
    # gathered quietly (test_fsdp_weight_is_gathered_in_the_map_...).
    a = put(mesh, jnp.ones((8, 128)), P("model", None))
    b = put(mesh, jnp.ones((128, 64)), P(None, "model"))
    with pytest.warns(jk.ShardingWarning, match="b's dimension 1 .* already split a's rows"):
      jax.jit(lambda x, b: jk.matmul(x, b))(a, b)
    b = put(mesh, jnp.ones((128, 64)), P("model", None))
    with pytest.warns(jk.ShardingWarning, match="b's dimension 0 .* already split a's rows"):
      jax.jit(lambda x, b: jk.matmul(x, b))(a, b)


def test_a_kernel_reached_on_auto_axes_is_refused_or_warned():
  """The safety net behind the ops' splits: a kernel planned while a mesh of Auto axes is in
  context (every op splits by the rules before it gets there) would be split by the compiler,
  which cannot split a kernel. Mosaic TPU is refused with what works; a GPU kernel would run
  whole (gathered), with a warning saying so."""
  auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  with jax.set_mesh(auto):
    with pytest.raises(ValueError, match=r"matmul: implementation='mosaic_tpu' cannot run on "
                       r"the mesh in context spans 8 devices on Auto axes.*Explicit axes"):
      partitioning.check_mesh_in_context("matmul", "mosaic_tpu")
    with pytest.warns(jk.ShardingWarning, match="cannot split a triton kernel, so its operands "
                      "are gathered"):
      partitioning.check_mesh_in_context("matmul", "triton")


_LABELS = jnp.arange(16, dtype=jnp.int32) % 64


_LENGTHS = jnp.full((8,), 20, jnp.int32)


# Every public op: (a function of x, split over "data", and w, whole; x's shape; w's shape).
NO_MESH_IN_CONTEXT_OPS = {
    "rms_norm": (lambda x, w, **kw: jk.rms_norm(x, w[0], **kw), (16, 128), (1, 128)),
    "layer_norm": (lambda x, w, **kw: jk.layer_norm(x, w[0], w[0], **kw), (16, 128), (1, 128)),
    "softmax": (lambda x, w, **kw: jk.softmax(x, **kw), (16, 128), (1,)),
    "bias_activation": (lambda x, w, **kw: jk.bias_activation(x, w[0], activation="gelu", **kw),
                        (16, 128), (1, 128)),
    "glu": (lambda x, w, **kw: jk.glu(x, **kw), (16, 128), (1,)),  # packed [gate | up]
    "softmax_cross_entropy": (
        lambda x, w, **kw: jk.softmax_cross_entropy(x, _LABELS, reduction="none", **kw),
        (16, 128), (1,)),
    "linear_softmax_cross_entropy": (
        lambda x, w, **kw: jk.linear_softmax_cross_entropy(x, w, _LABELS, reduction="none",
                                                           **kw),
        (16, 128), (128, 64)),
    "matmul": (lambda x, w, **kw: jk.matmul(x, w, **kw), (16, 128), (128, 64)),
    "flash_attention": (lambda q, w, **kw: jk.flash_attention(q, q, q, causal=True, **kw),
                        (8, 16, 2, 16), (1,)),
    "decode_attention": (
        lambda q, kv, **kw: jk.decode_attention(q, kv, kv, lengths=_LENGTHS, **kw),
        (8, 1, 4, 16), (8, 24, 2, 16)),
}


def test_no_mesh_in_context_covers_every_op():
  assert sorted(NO_MESH_IN_CONTEXT_OPS) == backend.ops()


@pytest.mark.parametrize("name", sorted(NO_MESH_IN_CONTEXT_OPS))
def test_no_mesh_in_context_serves_on_xla_or_refuses(mesh, name):
  """jax.jit(f, in_shardings=...) over Auto axes with no mesh in context: the operands' types
  name their mesh but not their split, and no rule applies. With implementation=None XLA's
  ops serve the call (the compiler splits those; the same numbers as implementation="xla"),
  warned once with the fix; a kernel named by the caller is refused before any compiler,
  naming jax.set_mesh. Never a kernel run whole on gathered operands, a hang or an abort."""
  op, x_shape, w_shape = NO_MESH_IN_CONTEXT_OPS[name]
  auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  split = NamedSharding(auto, P("data", *[None] * (len(x_shape) - 1)))
  gen = numerics.rng("no-mesh-in-context", name)
  x = jax.device_put(numerics.normal(gen, x_shape, jnp.float32), split)
  w = numerics.normal(gen, w_shape, jnp.float32)
  with jk.interpret_mode("triton"):
    with pytest.warns(jk.ShardingWarning, match=rf"jaxkernels.{name}: its operands live on a "
                      r"mesh of Auto axes \{'data': 4, 'model': 2\} and no mesh is in context.*"
                      r"XLA's ops serve the call.*jax.set_mesh\(mesh\)"):
      got = jax.jit(lambda x, w: op(x, w), in_shardings=(split, None))(x, w)
    with pytest.raises(ValueError, match=rf"{name}: implementation='triton' cannot run here: "
                       r"its operands live on a mesh of Auto axes.*jax.set_mesh\(mesh\)"):
      jax.jit(lambda x, w: op(x, w, implementation="triton"), in_shardings=(split, None))(x, w)
  want = jax.jit(lambda x, w: op(x, w, implementation="xla"))(np.asarray(x), w)
  # The same float32 ops in two programs (split and whole), fused differently: a few ulps.
  assert max(numerics.errors(got, np.asarray(want, np.float64))) < 16 * numerics.F32_EPS
  assert got.sharding.mesh.shape == auto.shape


@pytest.mark.parametrize("name", sorted(NO_MESH_IN_CONTEXT_OPS))
def test_host_arrays_through_in_shardings_warn_or_refuse(mesh, name):
  """jax.jit(f, in_shardings=...) called on host (NumPy) arrays, no mesh in context: the traced
  operands carry no mesh at all, so only the program's lowering can tell that it spans 8
  devices. With implementation=None the kernel's lowering warns, naming the fix (the kernel
  runs whole on every device, its operands gathered: the same numbers as XLA's); a kernel
  named by the caller is refused when the program is lowered, before anything runs. Placed on
  the mesh first (device_put), the call falls back to XLA's ops as above."""
  op, x_shape, w_shape = NO_MESH_IN_CONTEXT_OPS[name]
  auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  split = NamedSharding(auto, P("data", *[None] * (len(x_shape) - 1)))
  gen = numerics.rng("host-arrays-in-shardings", name)
  x = np.asarray(numerics.normal(gen, x_shape, jnp.float32))
  w = np.asarray(numerics.normal(gen, w_shape, jnp.float32))
  with jk.interpret_mode("triton"):
    with pytest.warns(jk.ShardingWarning, match=rf"jaxkernels.{name}: its program spans 8 "
                      r"devices, but no mesh was in sight.*runs whole on every device.*"
                      r"jax.set_mesh\(mesh\)"):
      got = jax.jit(lambda x, w: op(x, w), in_shardings=(split, None))(x, w)
    named = jax.jit(lambda x, w: op(x, w, implementation="triton"), in_shardings=(split, None))
    with pytest.raises(ValueError, match=rf"{name}: implementation='triton' cannot run here: "
                       r"its program spans 8 devices.*jax.set_mesh\(mesh\)"):
      named.lower(x, w)
    # One device: no question, no warning.
    with warnings.catch_warnings():
      warnings.simplefilter("error", jk.ShardingWarning)
      jax.jit(lambda x, w: op(x, w, implementation="triton"))(x, w)
  want = jax.jit(lambda x, w: op(x, w, implementation="xla"))(x, w)
  assert max(numerics.errors(got, np.asarray(want, np.float64))) < 16 * numerics.F32_EPS


@pytest.mark.parametrize("interpret", ["mosaic_tpu", "mosaic_gpu"])
def test_host_arrays_through_in_shardings_never_hang_interpreted(request, mesh, interpret):
  """The Mosaic interpreters' kernels wait on each other across devices and threads: with the
  program's 8 devices unseen when traced, flash_attention hung there (NPROC unset) and aborted
  at XLA's rendezvous timeout. Now refused when the program is lowered: Mosaic TPU cannot run
  a kernel whole on 8 devices of a split program; the GPU interpreter on 8 devices needs more
  host threads than NPROC gives this process (16; a process of its own), and says so."""
  if interpret == "mosaic_gpu" and not in_own_process(request):
    return
  op, x_shape, _ = NO_MESH_IN_CONTEXT_OPS["flash_attention"]
  auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  split = NamedSharding(auto, P("data", None, None, None))
  # The GPU kernel takes 16-bit operands and head dims that are multiples of 64.
  shape, dtype = ((8, 128, 2, 64), jnp.bfloat16) if interpret == "mosaic_gpu" else (x_shape,
                                                                                     jnp.float32)
  q = np.asarray(numerics.normal(numerics.rng("never-hang", interpret), shape, dtype))
  message = {"mosaic_tpu": r"the mosaic_tpu kernel that dispatch picked cannot run here: its "
                           r"program spans 8 devices",
             "mosaic_gpu": r"the mosaic_gpu interpreter on 8 device\(s\) needs at least 64 host "
                           r"threads.*NPROC"}[interpret]
  start = time.perf_counter()
  with jk.interpret_mode(interpret), pytest.raises(ValueError, match=message):
    jax.jit(lambda q: op(q, None), in_shardings=split).lower(q)
  assert time.perf_counter() - start < 60


def test_with_mesh_is_no_mesh_in_context(mesh):
  """`with mesh:` (deprecated by jax 0.12) sets no mesh that traced code can read: the same
  fallback as no mesh at all, and the warning says jax.set_mesh is what works."""
  auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  split = NamedSharding(auto, P("data", None))
  x = jax.device_put(numerics.normal(numerics.rng("with-mesh"), (16, 128), jnp.float32), split)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    with auto, jk.interpret_mode("triton"), pytest.warns(
        jk.ShardingWarning, match=r"no mesh is in context.*`with mesh:` is not enough"):
      jax.jit(lambda x: jk.rms_norm(x, jnp.ones(128)), in_shardings=split)(x)


def test_a_rule_is_data_read_one_way(mesh):
  """partitioning.split reads any op's rule the same way: a group takes the axes of the first
  operand that splits it (here y's, x's being whole); a whole dimension that is split is
  gathered, warned; an axis already taken by another group is dropped from the later one,
  warned; a group whose axes do not divide one of its dimensions stays whole (the operand that
  split it is gathered), warned; a
  broadcast dimension of size 1 and a quiet whole one say nothing."""
  Free, Whole = partitioning.Free, partitioning.Whole
  rule = {"x": (Free("rows", label="rows"), Whole(why="it is summed")),
          "y": (Free("rows", label="rows"), Free("cols", label="cols")),
          "z": (Free("cols", broadcast=True), Whole(quiet=True)),
          "w": (Free("other", label="other"), Free("heads", label="heads")),
          "v": (Free("heads"),)}
  shapes = {"x": ((8, 6), P(None, "model")), "y": ((8, 4), P("data", "model")),
            "z": ((1, 6), P(None, "model")), "w": ((4, 6), P("data", None)),
            "v": ((3,), P())}
  structs = {k: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
             for k, (shape, spec) in shapes.items()}
  decided, specs = {}, {}

  def f(**arrays):
    where = partitioning.split("op", None, arrays, rule)
    decided.update(where.groups)
    specs.update(y=where.spec(rule["y"]), z=where.spec(rule["z"], arrays["z"].shape))
    return arrays["x"]

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.jit(lambda x, y, z, w, v: f(x=x, y=y, z=z, w=w, v=v)).trace(**structs)
  # rows from y's "data"; cols from y's "model"; w's "data" is taken by rows: dropped.
  assert decided == {"rows": ("data",), "cols": ("model",)}
  assert specs == {"y": P("data", "model"), "z": P(None, None)}
  messages = sorted(str(w.message) for w in caught if issubclass(w.category, jk.ShardingWarning))
  assert len(messages) == 2, messages
  assert "x's dimension 1 (size 6) is split over mesh axes ('model',), and it is summed" in \
      messages[1]
  assert "w's dimension 0 (size 4) is split over mesh axes ('data',), and those axes already " \
      "split y's rows" in messages[0]
  # A group that does not divide: heads from w (over "model", 2) against v's 3.
  structs["w"] = jax.ShapeDtypeStruct((4, 6), jnp.float32,
                                      sharding=NamedSharding(mesh, P(None, "model")))
  structs["y"] = jax.ShapeDtypeStruct((8, 4), jnp.float32,
                                      sharding=NamedSharding(mesh, P("data", None)))
  structs["x"] = jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=NamedSharding(mesh, P()))
  decided.clear()
  with pytest.warns(jk.ShardingWarning, match=r"w's dimension 1 \(size 6\) is split over mesh "
                    r"axes \('model',\), and those axes \(size 2\) do not divide v's 3 along "
                    r"its dimension 0, which splits with w's heads"):
    jax.jit(lambda x, y, z, w, v: f(x=x, y=y, z=z, w=w, v=v)).trace(**structs)
  assert decided == {"rows": ("data",)}


def test_an_axis_that_does_not_divide_is_named(mesh):
  """On Explicit axes jax itself refuses an array split unevenly, naming the dimension and the
  split; a split the rule derives (a group's axes over another operand's dimension, the rules'
  axes on an Auto mesh) that does not divide is kept whole, warned (tests below and above)."""
  x = jax.ShapeDtypeStruct((6, 128), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
  with pytest.raises(ValueError, match="does not evenly divide the dimension size 6"):
    jax.jit(lambda x: jk.rms_norm(x, jnp.ones(128))).trace(x)


def test_a_one_device_mesh():
  """A one-device mesh of Explicit axes: the kernel runs once, whole, with no collective."""
  mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:1])
  x = jax.device_put(numerics.normal(numerics.rng("one-device"), (8, 128), jnp.float32),
                     NamedSharding(mesh, P("data", None)))
  with jk.interpret_mode("triton"):
    f = jax.jit(lambda x: jk.rms_norm(x, jnp.ones(128)))
    y = f(x)
    text = f.lower(x).compile().as_text()
  assert not any(c in text for c in ("all-gather", "all-reduce", "all-to-all"))
  want = norms_reference.rms_norm(x, jnp.ones(128), eps=1e-6)
  assert max(numerics.errors(y, np.asarray(want, np.float64))) < 8 * numerics.F32_EPS


def _every_op(x, w, b, logits, labels, q, kv, lengths):
  """Each public op on the batch-split operands, forward and (but decode) gradients: the
  sum of their losses, and the kernels' names each must leave in the compiled program."""
  dq = q[:, :1]
  losses = [
      jk.rms_norm(x, b[0]), jk.layer_norm(x, b[0], b[1]), jk.softmax(x),
      jk.bias_activation(x, b[0], activation="gelu"), jk.glu(x, x * 0.5),
      jk.matmul(x, w, activation="silu"),
      jk.softmax_cross_entropy(logits, labels, reduction="none"),
      jk.linear_softmax_cross_entropy(x, w, labels, reduction="sum"),
      jk.flash_attention(q, kv, kv, causal=True),
  ]
  total = sum(jnp.sum(t.astype(jnp.float32)) for t in losses)
  return total + 0 * jnp.sum(jk.decode_attention(dq, kv, kv, lengths=lengths))


EVERY_OP_KERNELS = ("jk_rms_norm_fwd", "jk_rms_norm_bwd", "jk_layer_norm_fwd",
                    "jk_layer_norm_bwd", "jk_softmax_fwd", "jk_softmax_bwd", "jk_bias_gelu_fwd",
                    "jk_bias_gelu_bwd", "jk_glu_silu_fwd", "jk_glu_silu_bwd", "jk_matmul",
                    "jk_cross_entropy_fwd", "jk_cross_entropy_bwd", "jk_attention_fwd",
                    "jk_attention_dkdv", "jk_attention_dq", "jk_decode_attention")


def test_tpu_compile_every_op_on_auto_axes(tpu4):
  """Every public op, compiled for v5e and v6e (4 chips) on a mesh of Auto axes in context,
  the operands placed batch-split by their shardings (jit's in_shardings, the classic way):
  each op splits by the default rules (batch over "data") and its Mosaic kernels run per
  chip, forward and backward; no operand is gathered. One program for all ten, one compile
  per chip."""
  auto = jax.sharding.Mesh(tpu4.devices, tpu4.axis_names, axis_types=(AxisType.Auto,))
  split, whole = NamedSharding(auto, P("data")), NamedSharding(auto, P())
  struct = lambda shape, dtype, sharding: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  args = (struct((8, 256, 512), jnp.bfloat16, split),  # x: (batch, length, embed)
          struct((512, 512), jnp.bfloat16, whole),  # w
          struct((2, 512), jnp.bfloat16, whole),  # norm scale and bias
          struct((8, 256, 512), jnp.bfloat16, split),  # logits
          struct((8, 256), jnp.int32, split),  # labels
          struct((8, 256, 8, 128), jnp.bfloat16, split),  # q
          struct((8, 256, 2, 128), jnp.bfloat16, split),  # k and v
          struct((8,), jnp.int32, split))  # decode's cache lengths
  grad = jax.value_and_grad(_every_op, argnums=(0, 1, 2, 3, 5, 6))
  with jax.set_mesh(auto):
    with warnings.catch_warnings():
      warnings.simplefilter("error", jk.ShardingWarning)  # nothing gathered, nothing refused
      text = jax.jit(grad).lower(*args).compile().as_text()
  assert "all-gather" not in text and "all-to-all" not in text
  missing = [name for name in EVERY_OP_KERNELS if name not in text]
  assert not missing, f"kernels not in the compiled program: {missing}"


def test_tpu_compile_with_no_mesh_in_context_takes_xla_or_refuses(tpu4):
  """jax.jit alone over a v5e's 4 chips (Auto axes, no mesh in context), where the Mosaic
  compiler once failed ("cannot be automatically partitioned"): dispatch compiles XLA's ops,
  warned; mosaic_tpu by name is refused before any compiler, naming jax.set_mesh."""
  if tpu4.devices.flat[0].device_kind != "TPU v5 lite":
    pytest.skip("checked on v5e; the refusal does not depend on the chip")
  auto = jax.sharding.Mesh(tpu4.devices, tpu4.axis_names, axis_types=(AxisType.Auto,))
  x = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16,
                           sharding=NamedSharding(auto, P("data", None)))
  with pytest.warns(jk.ShardingWarning, match="no mesh is in context.*XLA's ops serve"):
    text = jax.jit(lambda x: jk.rms_norm(x, jnp.ones(1024, jnp.bfloat16))).lower(
        x).compile().as_text()
  assert "all-gather" not in text
  with pytest.raises(ValueError, match=r"implementation='mosaic_tpu' cannot run here.*"
                     r"jax.set_mesh\(mesh\)"):
    jax.jit(lambda x: jk.rms_norm(x, jnp.ones(1024, jnp.bfloat16),
                                  implementation="mosaic_tpu")).lower(x)


@pytest.mark.parametrize("impl", ["triton", "mosaic_gpu"])
def test_cuda_lowering_splits_the_kernels(mesh, impl):
  """Exported for CUDA on the (4, 2) mesh, rows split over all 8 devices: each kernel runs in
  the manual (per-shard) computation, and no operand is gathered (forward and backward)."""
  from jax import export

  from jaxkernels._triton import CUSTOM_CALL

  rows = NamedSharding(mesh, P(("data", "model"), None))
  x = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16, sharding=rows)
  whole = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))
  if impl == "triton":
    op, w, name = (lambda x, w: jk.rms_norm(x, w, implementation=impl),
                   whole((1024,), jnp.float32), "jk_rms_norm_bwd")
  else:
    op, w, name = (lambda x, w: jk.matmul(x, w, implementation=impl),
                   whole((1024, 1024), jnp.bfloat16), "mosaic_gpu")

  def step(x, w):
    return jax.value_and_grad(lambda x, w: jnp.sum(op(x, w).astype(jnp.float32)),
                              argnums=(0, 1))(x, w)

  text = export.export(jax.jit(step), platforms=["cuda"], disabled_checks=[
      export.DisabledSafetyCheck.custom_call(CUSTOM_CALL)])(x, w).mlir_module()
  assert "manual_computation" in text and name in text
  assert "all_gather" not in text and "all_to_all" not in text


def test_cuda_lowering_on_auto_axes_runs_each_kernel_per_shard(mesh):
  """Exported for CUDA under an Auto mesh in context: the Mosaic GPU attention kernels (forward,
  dq, dk/dv) on each shard's batch and heads as the rules split them, and the Triton norm on
  each shard's rows; nothing gathered."""
  from jax import export

  from jaxkernels._triton import CUSTOM_CALL as TRITON_CUSTOM_CALL

  auto = auto_mesh()
  rows = NamedSharding(auto, P("data"))
  q = jax.ShapeDtypeStruct((8, 256, 8, 128), jnp.bfloat16, sharding=rows)
  kv = jax.ShapeDtypeStruct((8, 256, 2, 128), jnp.bfloat16, sharding=rows)

  x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16, sharding=rows)
  norm = lambda x: jk.rms_norm(x, jnp.ones(256, jnp.bfloat16), implementation="triton")
  with jax.set_mesh(auto), jk.sharding_rules(batch="data", heads="model"):
    attention = export.export(jax.jit(mosaic_gpu_attention_grads), platforms=["cuda"])(
        q, kv, kv).mlir_module()
    normed = export.export(jax.jit(norm), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)])(x).mlir_module()
  for name in MOSAIC_GPU_ATTENTION_KERNELS:
    assert name in attention, name
  # q's 8 heads and k's 2 over "model" (2): 4 and 1 a shard, the batch of 8 over "data" (4).
  assert "tensor<2x256x4x128xbf16>" in attention and "tensor<2x256x1x128xbf16>" in attention
  assert "tensor<16x256xbf16>" in normed and "__gpu$xla.gpu.triton" in normed
  for text in (attention, normed):
    assert "manual_computation" in text
    assert "all_gather" not in text and "all_to_all" not in text
