"""matmul on sharded arrays: data, column and row parallel layouts, block scales, the gated
product side by side and stacked, dB summed in float32, and fully sharded data parallelism
(the weight gathered in the map, its gradient reduce-scattered)."""

from __future__ import annotations

import math
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxkernels as jk
from jaxkernels import _activations, partitioning
from jaxkernels.ops.cross_entropy import reference as cross_entropy_reference
from tests import numerics
from tests.matmul_cases import glu_reference as glu_spec
from tests.matmul_cases import reference as matmul_spec
from tests.sharding import auto_mesh, put

pytestmark = pytest.mark.cpu_only  # the mesh is of host devices, the kernels interpreted


MATMUL_LAYOUTS = {  # name: (A's spec, B's spec, the output's)
    "data parallel": (P(("data", "model"), None), P(None, None), P(("data", "model"), None)),
    "column parallel": (P("data", None), P(None, "model"), P("data", "model")),
    "row parallel": (P("data", "model"), P("model", None), P("data", None)),
    "A's K alone": (P(None, "model"), P(None, None), P(None, None)),
}


@pytest.mark.parametrize("layout", sorted(MATMUL_LAYOUTS))
def test_matmul_layouts(mesh, layout):
  """Every epilogue operand follows the output; in the row-parallel product the activation
  runs after the partial sums are added."""
  spec_a, spec_b, spec_out = MATMUL_LAYOUTS[layout]
  gen = numerics.rng("sharding-matmul", layout)
  m, k, n = 32, 64, 48
  a = numerics.normal(gen, (m, k), jnp.float32, k ** -0.25)
  b = numerics.normal(gen, (k, n), jnp.float32, k ** -0.25)
  bias, res = numerics.normal(gen, (n,), jnp.float32), numerics.normal(gen, (m, n), jnp.float32)
  config = jk.ops.matmul.triton.Config(block_m=16, block_n=16, block_k=16, num_warps=4,
                                       num_stages=1)

  def fn(impl, cfg):
    return lambda a, b, bias, res: jk.matmul(a, b, bias=bias, residual=res, activation="gelu",
                                             precision=jax.lax.Precision.HIGHEST,
                                             implementation=impl, config=cfg)

  ct = numerics.normal(gen, (m, n), jnp.float32)

  ref = matmul_spec("gelu", True, True)

  with jk.interpret_mode("triton"):
    out, vjp = jax.vjp(jax.jit(fn("triton", config)), put(mesh, a, spec_a), put(mesh, b, spec_b),
                       bias, res)
    got = (out, vjp(ct))
  assert out.sharding.spec == spec_out
  numerics.assert_matches(got, ref, (a, b, bias, res), ct, dtype=jnp.float32, reduction=k,
                          pointwise_rtol=_activations.RTOL)


@pytest.mark.parametrize("layout", sorted(MATMUL_LAYOUTS))
@pytest.mark.parametrize("scales", ["placed", "replicated"])
def test_matmul_block_scales_layouts(mesh, layout, scales):
  """Block-scaled fp8 (1 x 32 blocks of A, 32 x 16 of B) on every layout: the scales split with
  the K and N blocks they scale, whether placed like their operands or replicated (sliced
  locally); in the row-parallel product each K shard scales its own blocks before the sum, and
  bias + gelu run after it."""
  spec_a, spec_b, spec_out = MATMUL_LAYOUTS[layout]
  gen = numerics.rng("sharding-block-scales", layout, scales)
  m, k, n = 32, 128, 64
  f8 = jnp.float8_e4m3fn
  a, b = numerics.normal(gen, (m, k), f8), numerics.normal(gen, (k, n), f8)
  a_scale = jnp.asarray(gen.uniform(0.25, 4, (m, k // 32)), jnp.float32)
  b_scale = jnp.asarray(gen.uniform(0.25, 4, (k // 32, n // 16)), jnp.float32)
  bias = numerics.normal(gen, (n,), jnp.float32)
  fn = jax.jit(lambda a, b, sa, sb, bias: jk.matmul(a, b, a_scale=sa, b_scale=sb, bias=bias,
                                                    activation="gelu", out_dtype=jnp.float32))
  placed = scales == "placed"
  got = fn(put(mesh, a, spec_a), put(mesh, b, spec_b),
           put(mesh, a_scale, spec_a if placed else P()),
           put(mesh, b_scale, spec_b if placed else P()), bias)
  assert got.sharding.spec == spec_out
  want = jk.matmul(a, b, a_scale=a_scale, b_scale=b_scale, bias=bias, activation="gelu",
                   out_dtype=jnp.float32)
  # float32 sums in another order (the K shards' partial sums): a few float32 ulps of the terms.
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("rules", [None, {"batch": "data", "embed": "model"}],
                         ids=["data parallel", "row parallel"])
def test_matmul_block_scales_on_an_auto_mesh(mesh, rules):
  """Block-scaled fp8 on the Auto mesh in context (jit with in_shardings, logical axis rules):
  the scales follow their operands' split, K's blocks included where the rules split "embed";
  the product as on one device, each shard's block of a in the program, nothing warned."""
  gen = numerics.rng("sharding-auto-block-scales", str(rules))
  f8 = jnp.float8_e4m3fn
  a, b = numerics.normal(gen, (8, 16, 128), f8), numerics.normal(gen, (128, 64), f8)
  a_scale = jnp.asarray(gen.uniform(0.25, 4, (8, 16, 128 // 32)), jnp.float32)
  b_scale = jnp.asarray(gen.uniform(0.25, 4, (128 // 32, 64 // 16)), jnp.float32)
  fn = lambda a, b, sa, sb: jk.matmul(a, b, a_scale=sa, b_scale=sb, out_dtype=jnp.float32)
  want = fn(a, b, a_scale, b_scale)
  auto = auto_mesh()
  shardings = tuple(NamedSharding(auto, P("data") if x.ndim > 2 else P())
                    for x in (a, b, a_scale, b_scale))
  with jax.set_mesh(auto), jk.sharding_rules(rules), \
       warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    step = jax.jit(fn, in_shardings=shardings)
    got = step(a, b, a_scale, b_scale)
    text = step.lower(a, b, a_scale, b_scale).as_text()
  assert not [w for w in caught if issubclass(w.category, jk.ShardingWarning)], [
      str(w.message) for w in caught]
  # float32 sums in another order (the K shards' partial sums): a few float32 ulps of the terms.
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
  local = "2x16x64" if rules else "2x16x128"
  assert f"tensor<{local}xf8E4M3FN>" in text, local


@pytest.mark.parametrize("layout", ["data parallel", "row parallel", "column parallel"])
def test_matmul_glu_layouts(mesh, layout):
  """matmul(glu=True) on split operands: the product as its layout splits it, then glu on
  [gate | up], whose halves pair up within a row: a split N is gathered, with the warning
  (an explicit implementation refuses to gather, as every op does)."""
  spec_a, spec_b, _ = MATMUL_LAYOUTS[layout]
  gen = numerics.rng("sharding-matmul-glu", layout)
  m, k, n = 32, 64, 24
  a = numerics.normal(gen, (m, k), jnp.float32, k ** -0.25)
  b = numerics.normal(gen, (k, 2 * n), jnp.float32, k ** -0.25)
  ct = numerics.normal(gen, (m, n), jnp.float32)
  config = jk.ops.matmul.triton.Config(block_m=16, block_n=16, block_k=16, num_warps=4,
                                       num_stages=1)
  column = layout == "column parallel"
  fn = lambda impl: jax.jit(lambda a, b: jk.matmul(
      a, b, activation="silu", glu=True, precision=jax.lax.Precision.HIGHEST,
      implementation=impl, config=None if impl is None else config))
  operands = put(mesh, a, spec_a), put(mesh, b, spec_b)
  with jk.interpret_mode("triton"), warnings.catch_warnings():
    warnings.simplefilter("error", jk.ShardingWarning)
    if column:
      with pytest.raises(ValueError, match="glu: implementation='triton' cannot serve this "
                         r"call: gate's dimension 1 \(size 48\) is split"):
        fn("triton")(*operands)
      with pytest.warns(jk.ShardingWarning, match="glu: gate's dimension 1"):
        out, vjp = jax.vjp(fn(None), *operands)
    else:
      out, vjp = jax.vjp(fn("triton"), *operands)
    got = (out, vjp(ct))
  assert out.sharding.spec[0] == spec_a[0]  # the rows stay split
  numerics.assert_matches(got, glu_spec("silu", False, False), (a, b), ct, dtype=jnp.float32,
                          reduction=k, pointwise_rtol=_activations.RTOL)


STACKED_GLU_LAYOUTS = {  # name: (A's spec, the stacked B's, the output's)
    "data parallel": (P(("data", "model"), None), P(None, None, None), P(("data", "model"), None)),
    "column parallel": (P("data", None), P(None, None, "model"), P("data", "model")),
    "row parallel": (P("data", "model"), P("model", None, None), P("data", None)),
}


@pytest.mark.parametrize("layout", sorted(STACKED_GLU_LAYOUTS))
def test_matmul_stacked_glu_layouts(mesh, layout):
  """matmul(glu=True) with b stacked (K, 2, N), bias (2, N) and a residual: split over N each
  shard gates its own columns (tensor parallelism's column-parallel MLP: nothing gathered,
  nothing warned, the output split over N); split over K the partial products are summed
  before the gate; forward and every gradient as the side-by-side call on one device."""
  spec_a, spec_b, spec_out = STACKED_GLU_LAYOUTS[layout]
  gen = numerics.rng("sharding-matmul-stacked-glu", layout)
  m, k, n = 32, 64, 24
  a = numerics.normal(gen, (m, k), jnp.float32, k ** -0.25)
  b = numerics.normal(gen, (k, 2, n), jnp.float32, k ** -0.25)
  bias, res = numerics.normal(gen, (2, n), jnp.float32), numerics.normal(gen, (m, n), jnp.float32)
  ct = numerics.normal(gen, (m, n), jnp.float32)
  config = jk.ops.matmul.triton.Config(block_m=16, block_n=16, block_k=16, num_warps=4,
                                       num_stages=1)
  fn = jax.jit(lambda a, b, bias, res: jk.matmul(
      a, b, bias=bias, residual=res, activation="silu", glu=True,
      precision=jax.lax.Precision.HIGHEST, implementation="triton", config=config))
  with jk.interpret_mode("triton"), warnings.catch_warnings():
    warnings.simplefilter("error", jk.ShardingWarning)
    out, vjp = jax.vjp(fn, put(mesh, a, spec_a), put(mesh, b, spec_b),
                       put(mesh, bias, P(None, spec_b[2])), put(mesh, res, spec_out))
    got = (out, vjp(ct))
    text = fn.lower(put(mesh, a, spec_a), put(mesh, b, spec_b),
                    put(mesh, bias, P(None, spec_b[2])), put(mesh, res, spec_out)).as_text()
  assert out.sharding.spec == spec_out
  assert "all-gather" not in text and "all_gather" not in text
  side_by_side = glu_spec("silu", True, True)
  want = lambda cd: (lambda a, b, bias, res: side_by_side(cd)(
      a, b.reshape(k, 2 * n), bias.reshape(2 * n), res))
  numerics.assert_matches(got, want, (a, b, bias, res), ct, dtype=jnp.float32, reduction=k,
                          pointwise_rtol=_activations.RTOL)


def test_matmul_stacked_glu_bad_input_names_itself():
  a = jnp.ones((4, 8))
  with pytest.raises(ValueError, match=r"stacked, \(K, 2, N\).*got b shape \(8, 3, 4\)"):
    jk.matmul(a, jnp.ones((8, 3, 4)), activation="silu", glu=True)
  with pytest.raises(ValueError, match=r"bias must be \(2, 4\).*got shape \(8,\)"):
    jk.matmul(a, jnp.ones((8, 2, 4)), bias=jnp.ones(8), activation="silu", glu=True)
  with pytest.raises(ValueError, match="disagree on K"):
    jk.matmul(a, jnp.ones((6, 2, 4)), activation="silu", glu=True)


@pytest.mark.parametrize("spec_b", [P(), P("data", None)], ids=["whole", "fsdp"])
def test_data_parallel_db_is_summed_in_float32_and_rounded_once(mesh, spec_b):
  """bfloat16, rows split over all 8 devices, B whole or split over "data" (fully sharded:
  gathered in the map, dB reduce-scattered back onto the split): each shard's dB is a partial
  sum of the rows' contributions. Kept in float32 through the sum across shards and rounded
  once, dB is as close to the exact one as a single rounding of it (within 10%); rounded at
  each shard and summed in bfloat16, it was not (6.1e-3 off on 2 GPUs)."""
  gen = numerics.rng("sharding", "db")
  a = numerics.normal(gen, (256, 64), jnp.bfloat16)
  b = numerics.normal(gen, (64, 32), jnp.bfloat16)
  dy = numerics.normal(gen, (256, 32), jnp.bfloat16)
  exact = np.asarray(a, np.float64).T @ np.asarray(dy, np.float64)
  once = np.asarray(jnp.asarray(exact, jnp.bfloat16), np.float64)
  error = lambda got: np.linalg.norm(np.asarray(got, np.float64) - exact) / np.linalg.norm(exact)
  with jk.interpret_mode("triton"):
    _, vjp = jax.vjp(jax.jit(lambda a, b: jk.matmul(a, b)),
                     put(mesh, a, P(("data", "model"), None)), put(mesh, b, spec_b))
    _, db = vjp(put(mesh, dy, P(("data", "model"), None)))
  assert db.dtype == jnp.bfloat16
  assert tuple(db.sharding.spec) + (None,) * 2 == tuple(spec_b) + (None,) * (4 - len(spec_b))
  assert error(db) <= 1.1 * error(once), (error(db), error(once))


# Fully sharded data parallelism: the operands' specs on the (data 4, model 2) mesh (a or x,
# the weight[, labels]) for each op that takes a weight, the weight split over "data" too.
FSDP_LAYOUTS = {
    "matmul, K over data": (P("data", None), P("data", None)),
    "matmul, N over data, K over model": (P("data", "model"), P("model", "data")),
    "stacked glu, K over data, N over model": (P("data", None), P("data", None, "model")),
    "fused loss, D over data, vocabulary over model": (P("data", None), P("data", "model"),
                                                       P("data")),
}


def _fsdp_case(layout, gen):
  """(the op on (a or x, the weight[, labels]), its spec for assert_matches, the primals,
  the cotangent, the contraction length) for an FSDP_LAYOUTS entry, float32."""
  m, k, n = 32, 64, 48
  a = numerics.normal(gen, (m, k), jnp.float32, k ** -0.25)
  hi = jax.lax.Precision.HIGHEST
  if layout.startswith("fused loss"):
    w = numerics.normal(gen, (k, n), jnp.float32, k ** -0.25)
    labels = jnp.asarray(gen.integers(0, n, m), jnp.int32)
    fn = lambda impl: lambda x, w, labels: jk.linear_softmax_cross_entropy(
        x, w, labels, reduction="none", implementation=impl)
    spec = lambda cd: lambda x, w: cross_entropy_reference.linear_softmax_cross_entropy(
        x, w, labels, compute_dtype=cd)[0]
    return fn, spec, (a, w, labels), numerics.normal(gen, (m,), jnp.float32), k
  if layout.startswith("stacked glu"):
    b = numerics.normal(gen, (k, 2, n // 2), jnp.float32, k ** -0.25)
    fn = lambda impl: lambda a, b: jk.matmul(a, b, activation="silu", glu=True, precision=hi,
                                              implementation=impl)
    side_by_side = glu_spec("silu", False, False)
    spec = lambda cd: lambda a, b: side_by_side(cd)(a, b.reshape(k, n))
    return fn, spec, (a, b), numerics.normal(gen, (m, n // 2), jnp.float32), k
  b = numerics.normal(gen, (k, n), jnp.float32, k ** -0.25)
  fn = lambda impl: lambda a, b: jk.matmul(a, b, precision=hi, implementation=impl)
  return fn, matmul_spec(None, False, False), (a, b), numerics.normal(gen, (m, n),
                                                                      jnp.float32), k


@pytest.mark.parametrize("layout", sorted(FSDP_LAYOUTS))
def test_fsdp_weight_is_gathered_in_the_map_and_its_gradient_reduce_scattered(mesh, layout):
  """A weight split over a data-like axis ("data") where the rows are split over it too:
  gathered inside the op's map, quietly (that is fully sharded data parallelism, not a
  layout to warn of; an explicit kernel serves it), the rest of its split kept (column- or
  row-parallel over "model", the vocabulary-parallel loss). Forward and gradients as the spec;
  the weight's gradient comes back split as the weight is, by a reduce-scatter of each
  device's share: no all-reduce of the weight's gathered size (the sum over the whole weight
  that was sliced after)."""
  specs = FSDP_LAYOUTS[layout]
  fn, spec, primals, ct, k = _fsdp_case(layout, numerics.rng("sharding-fsdp", layout))
  placed = [put(mesh, x, s) for x, s in zip(primals, specs)]
  diff, rest, at = placed[:2], placed[2:], 1  # (a or x, the weight), the labels
  f = jax.jit(lambda *d: fn("triton")(*d, *rest))
  with jk.interpret_mode("triton"), warnings.catch_warnings():
    warnings.simplefilter("error", jk.ShardingWarning)
    out, vjp = jax.vjp(f, *diff)
    grads = vjp(ct)
    text = jax.jit(lambda *d: jax.vjp(f, *d)[1](ct)).lower(*diff).compile().as_text()
  w, dw = diff[at], grads[at]
  chex.assert_equal(tuple(dw.sharding.spec) + (None,) * (w.ndim - len(dw.sharding.spec)),
                    tuple(specs[at]) + (None,) * (w.ndim - len(specs[at])))
  sizes = dict(mesh.shape)
  gathered = [length // math.prod(sizes[a] for a in partitioning.axes(e) if a != "data")
              for length, e in zip(w.shape, tuple(specs[at]) + (None,) * w.ndim)]
  whole = f"f32[{','.join(map(str, gathered))}]"
  reduced = re.findall(r"= (\S+) all-reduce(?:-start)?\(", text)
  assert "reduce-scatter" in text, "no reduce-scatter in the compiled backward"
  assert not [r for r in reduced if r.startswith(whole)], (whole, reduced)
  numerics.assert_matches((out, grads), spec, primals[:2], ct, dtype=jnp.float32,
                          reduction=k, pointwise_rtol=_activations.RTOL)


def test_fsdp_weight_on_an_auto_mesh_follows_the_rules(mesh):
  """On a mesh of Auto axes in context, rules that split "embed" over "data" lay B's K out over
  it: B is gathered in the map (the map over "data" alone, "model" splitting nothing), no
  warning, and dB reduce-scattered; forward and gradients as the spec."""
  auto = jax.sharding.Mesh(mesh.devices, mesh.axis_names)
  fn, spec, (a, b), ct, k = _fsdp_case("matmul, K over data", numerics.rng("sharding-fsdp-auto"))
  f = jax.jit(fn("triton"), in_shardings=(NamedSharding(auto, P("data")),
                                          NamedSharding(auto, P("data"))))
  with jax.set_mesh(auto), jk.sharding_rules(batch="data", embed="data"), \
       jk.interpret_mode("triton"), warnings.catch_warnings():
    warnings.simplefilter("error", jk.ShardingWarning)
    out, vjp = jax.vjp(f, a, b)
    grads = vjp(ct)
    text = jax.jit(lambda a, b: jax.vjp(f, a, b)[1](ct)).lower(a, b).compile().as_text()
  assert "reduce-scatter" in text, "no reduce-scatter in the compiled backward"
  numerics.assert_matches((out, grads), spec, (a, b), ct, dtype=jnp.float32, reduction=k)
