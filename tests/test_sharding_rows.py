"""The row ops (the norms, bias_activation, glu, softmax) on sharded arrays: on a (4, 2) mesh of
Explicit axes over 8 host devices each layout gives the unsharded numbers, forward and
gradients (Triton and Mosaic TPU interpreted, through the case table's sharded check); on Auto
axes they split by the rules; compiled for TPUs, split rows are not gathered."""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxkernels as jk
from tests import cases, numerics
from tests.sharding import SHAPE, auto_mesh, in_own_process, local_shape, tpu_compile

pytestmark = pytest.mark.cpu_only  # the mesh is of host devices, the kernels interpreted


# The row ops' cases (tests/cases.py), and glu on [gate | up] side by side, whose halves pair
# within a row (a split last axis is gathered).
OPS = {**{op: cases.CASES[op] for op in ("rms_norm", "layer_norm", "bias_activation", "glu",
                                         "softmax")},
       "glu_packed": cases.VARIANTS["glu_packed"]}


# Layouts of a (B, T, N) array: batch over both axes, batch and sequence, and the last axis
# split (free for the elementwise ops, gathered with a warning for the norms; softmax reduces
# over axis 1, so there the sequence split is the gathered one).
LAYOUTS = {"batch": P(("data", "model"), None, None), "batch+seq": P("data", "model", None),
           "batch+hidden": P("data", None, "model")}
GATHERS = {("rms_norm", "batch+hidden"), ("layer_norm", "batch+hidden"),
           ("glu_packed", "batch+hidden"), ("softmax", "batch+seq")}


def _tpu_interpreted() -> set[tuple[str, str]]:
  """The (op, layout) pairs CI runs on the Mosaic TPU interpreter (~15 s each in a process of
  its own): each kernel module once (the norms, the elementwise ops, softmax), the layouts
  taken in turn. Triton runs every pair through the same split rules, and every op's split
  compiles for TPUs in test_tpu_compile_keeps_rows_split; JAXKERNELS_TEST_SLOW=1 runs every
  pair on both."""
  layouts, out = sorted(LAYOUTS), set()
  for i, op in enumerate(("rms_norm", "glu_packed", "softmax")):
    turn = layouts[i % len(layouts):] + layouts[:i % len(layouts)]
    out.add((op, next(l for l in turn if (op, l) not in GATHERS)))
  return out


# Triton: every op on the last axis split (a gather, with its warning, for the norms and packed
# glu; a plain split for the others), every layout with rms_norm (numerics.grid's cross); every
# pair under SLOW. Mosaic TPU: _tpu_interpreted's three pairs.
@pytest.mark.parametrize("impl,op,layout", [
    *(pytest.param("triton", *case.values, id="triton-" + case.id) for case in numerics.grid(
        sorted(OPS), sorted(LAYOUTS), center=("rms_norm", "batch+hidden"))),
    *(("mosaic_tpu", op, layout) for op in sorted(OPS) for layout in sorted(LAYOUTS))])
def test_sharded_matches_unsharded(request, mesh, impl, op, layout):
  """The numerics rule against the float64 oracle, for the sharded call as for any other."""
  if impl == "mosaic_tpu" and (op, layout) in GATHERS:
    pytest.skip("an all-gather before the kernels hangs the TPU interpreter's callbacks on host "
                "devices (notes/base.md sharding-1); the TPU compiler takes it "
                "(test_tpu_compile_keeps_rows_split) and Triton checks the rule's numbers")
  if impl == "mosaic_tpu" and not numerics.SLOW and (op, layout) not in _tpu_interpreted():
    pytest.skip("each op once on the Mosaic TPU interpreter (the suite's time); Triton takes "
                "every layout through the same rules; JAXKERNELS_TEST_SLOW=1 runs this")
  if impl == "mosaic_tpu" and not in_own_process(request):
    return
  OPS[op].check_sharded(impl, mesh, LAYOUTS[layout], SHAPE, op, layout,
                        gathered=(op, layout) in GATHERS)


# Meshes of Auto axes in context: the split comes from logical axis rules. (rules, x's
# in_sharding, the split the op must run with): the default rules (batch over every data-like
# axis: "data"); ours naming both axes; Flax's naming "model"; rows placed otherwise than the
# rules say (the compiler moves them; the numbers are the same).
AUTO_RULES = {
    "default": (None, P("data"), P("data", None, None)),
    "ours": ({"batch": ("data", "model")}, P(("data", "model")), P(("data", "model"), None, None)),
    "flax": ("flax", P("model"), P("model", None, None)),
    "placed otherwise": (None, P(None, "model"), P("data", None, None)),
}


# Every op under the default rules, every rule with one op (numerics.grid); all pairs under SLOW.
@pytest.mark.parametrize("op,rules", numerics.grid(sorted(OPS), sorted(AUTO_RULES)))
def test_auto_mesh_in_context_splits_by_the_rules(mesh, op, rules):
  """The row ops under ``jax.set_mesh`` of Auto axes, jitted with in_shardings (the classic
  way): each runs per shard as the rules split its rows (Triton, interpreted; each shard's
  block in the program), by the numerics rule forward and backward, nothing gathered or
  warned."""
  from flax import nnx

  case = OPS[op]
  fn, ref, arrays, kinds = case.call, case.reference, case.arrays, case.kinds
  given, placed, want_spec = AUTO_RULES[rules]
  gen = numerics.rng("sharding-auto", op, rules)
  args = arrays(gen, SHAPE)
  out_shapes = jax.eval_shape(ref(jnp.float32), *args)
  ct = jax.tree.map(lambda o: numerics.normal(gen, o.shape, o.dtype), out_shapes)
  auto = auto_mesh()
  shardings = tuple(None if k is None else NamedSharding(auto, placed if k == "rows" else P())
                    for k in kinds)

  def step(args, ct):
    out, vjp = jax.vjp(fn(None), *args)
    return out, vjp(ct)

  context = (nnx.logical_axis_rules([("batch", "model")]) if given == "flax" else
             jk.sharding_rules(given) if given else jk.sharding_rules(None))
  with jk.interpret_mode("triton"), jax.set_mesh(auto), context, \
       warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jitted = jax.jit(step, in_shardings=(shardings, None))
    out, grads = jitted(tuple(args), ct)
    text = jitted.lower(tuple(args), ct).as_text()
  assert not [w for w in caught if issubclass(w.category, jk.ShardingWarning)], [
      str(w.message) for w in caught]
  numerics.assert_matches((out, grads), ref, args, ct, dtype=jnp.float32,
                          reduction=max(SHAPE[-1], math.prod(SHAPE[:-1])))
  # The kernels' shard_map over the mesh in context, each shard's rows as the rules say.
  assert "sdy.manual_computation" in text or "shard_map" in text
  local = [int(d) for d in local_shape(want_spec, auto)]
  assert f"tensor<{local[0]}x{local[1]}x{SHAPE[-1]}xf32>" in text, (local, want_spec)


def test_auto_mesh_runs_the_tpu_kernels_per_shard(request, mesh):
  """The same under the Mosaic TPU interpreter (a process of its own): the layer norm with a
  residual, rows split over "data" by the default rules, forward and backward."""
  if not in_own_process(request):
    return
  case = OPS["layer_norm"]
  fn, ref, arrays, kinds = case.call, case.reference, case.arrays, case.kinds
  gen = numerics.rng("sharding-auto", "tpu")
  args = arrays(gen, SHAPE)
  ct = jax.tree.map(lambda o: numerics.normal(gen, o.shape, o.dtype),
                    jax.eval_shape(ref(jnp.float32), *args))
  auto = auto_mesh()
  shardings = tuple(NamedSharding(auto, P("data") if k == "rows" else P()) for k in kinds)

  def step(args, ct):
    out, vjp = jax.vjp(fn(None), *args)
    return out, vjp(ct)

  with jk.interpret_mode("mosaic_tpu"), jax.set_mesh(auto), jk.sharding_rules(None):
    got = jax.jit(step, in_shardings=(shardings, None))(tuple(args), ct)
  numerics.assert_matches(got, ref, args, ct, dtype=jnp.float32,
                          reduction=max(SHAPE[-1], math.prod(SHAPE[:-1])))


TPU_CASES = {
    "rms_norm+residual": (lambda x, w: jk.rms_norm(x, w[0], residual=x)[0], "vector"),
    "layer_norm": (lambda x, w: jk.layer_norm(x, w[0], w[1]), "vector"),
    "glu": (lambda x, w: jk.glu(x, x * 0.5), "vector"),
    "softmax": (lambda x, w: jk.softmax(x), "vector"),
    "matmul": (lambda x, w: jk.matmul(x, w), "matrix"),
}


@pytest.mark.parametrize("case", sorted(TPU_CASES))
def test_tpu_compile_keeps_rows_split(tpu4, case):
  """Rows split over 4 chips: the compiled program gathers no row array, and each chip holds
  about a quarter of the unsharded call's arguments, outputs and temporaries (forward and
  backward)."""
  _check_rows_split(tpu4, case)


# The row ops' memory on Auto axes (every op's compile there, matmul's included:
# test_tpu_compile_every_op_on_auto_axes).
AUTO_TPU_CASES = sorted(set(TPU_CASES) - {"matmul"})


@pytest.mark.parametrize("case", AUTO_TPU_CASES)
def test_tpu_compile_keeps_rows_split_on_auto_axes(tpu4, case):
  """The same on a mesh of Auto axes in context (jax.sharding.Mesh's default, the arrays placed
  by their shardings): the rows split by the default rules, batch over "data". (v5e only: the
  split is the rules', not the chip's; each compile costs CI ~14 s.)"""
  if tpu4.devices.flat[0].device_kind != "TPU v5 lite":
    pytest.skip("the Auto-axes split is checked on v5e; v6e compiles the same shard_map")
  auto = jax.sharding.Mesh(tpu4.devices, tpu4.axis_names, axis_types=(AxisType.Auto,))
  # The unsharded call's memory from the Explicit mesh: on Auto axes the compiler splits even
  # a replicated input's outputs as it likes.
  _check_rows_split(auto, case, whole_on=tpu4)


def _check_rows_split(tpu4, case, whole_on=None):
  op, weight = TPU_CASES[case]
  rows, n = 4096, 1024
  w_shape = (2, n) if weight == "vector" else (n, n)

  def step(x, w):
    return jax.value_and_grad(lambda x, w: jnp.sum(op(x, w).astype(jnp.float32)),
                              argnums=(0, 1))(x, w)

  def compiled(spec, mesh):
    x = jax.ShapeDtypeStruct((rows, n), jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    w = jax.ShapeDtypeStruct(w_shape, jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    return tpu_compile(mesh, step, x, w)

  split, whole = compiled(P("data", None), tpu4), compiled(P(None, None), whole_on or tpu4)
  text = split.as_text()
  assert "all-gather" not in text and "all-to-all" not in text
  assert "jk_" in text  # the kernels, partitioned
  per_chip = lambda c: (lambda m: m.argument_size_in_bytes + m.output_size_in_bytes +
                        m.temp_size_in_bytes)(c.memory_analysis())
  weights = 2 * math.prod(w_shape) * 2  # the replicated weight and its gradient, bf16
  assert per_chip(split) - weights <= 0.3 * (per_chip(whole) - weights), (
      per_chip(split), per_chip(whole))
