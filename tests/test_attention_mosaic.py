"""flash_attention's Mosaic kernels: Hopper's (Mosaic GPU: interpreted small, compiled on
the GPU check, lowered for CUDA) and the TPU's (interpreted with TPU semantics, AOT-compiled
for v5e, v5p and v6e), each against the float64 oracle by the numerics rule."""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

import jaxkernels as jk
from jaxkernels import hardware, roofline
from jaxkernels.ops.attention import mosaic_gpu as attention_mosaic_gpu
from jaxkernels.ops.attention import mosaic_tpu as attention_mosaic_tpu
from tests import numerics
from tests.attention_cases import (DTYPES, AttentionTest, Case, attention_problem,
                                   case_reference, draw_case, every_feature_vjp,
                                   passes_around_kernels)
from tests.conftest import aot_compile, cuda_lowering


class TestAttentionMosaicGpu(AttentionTest):
  """The Hopper kernels: 16-bit inputs, head dims of multiples of 64 (others zero-padded to
  one); the backward is the Mosaic GPU dq and dk/dv kernels', with a bias and the d(bias)
  kernel's. Interpreted on the CPU the
  products are plain dots and the accumulators float32 shared memory (the interpreter has no
  wgmma from registers); the schedule, barriers, rings and masks are the kernels' own."""

  IMPL = "mosaic_gpu"
  DTYPES = (jnp.bfloat16, jnp.float16)
  HEAD_DIMS = (64,)
  SMALL_HEAD_DIM = 64
  FEATURE_DTYPE = jnp.bfloat16
  test_head_dims = None  # float32 is Triton's; test_padded_head_dims below

  # One drawn example interpreted (two took 204 s on CI's 2 cores); the GPU check draws two.
  @settings(max_examples=2 if numerics.COMPILED or numerics.SLOW else 1, deadline=None,
            phases=(Phase.explicit, Phase.generate),
            suppress_health_check=[HealthCheck.differing_executors])
  @given(data=st.data())
  def test_drawn(self, data):
    self.check_drawn(data)

  def test_segments_without_common_ids(self):
    numerics.slow_when_interpreted(86)
    super().test_segments_without_common_ids()

  def test_block_edges(self):
    """Several query tiles and key blocks: partial ones at both ends, a window that leaves one
    warpgroup of a tile idle through steps its partner computes, GQA, segments, the cap; with
    a bias over the heads (the d(bias) kernel sums the batch; tiles the window hides are
    skipped) and without (whose dk/dv kernel walks both query heads of the group through
    128-query blocks)."""
    numerics.slow_when_interpreted(193)
    config = attention_mosaic_gpu.Config(block_q=64, block_kv=64, stages=2)
    case = Case(batch=1, q_len=130, kv_len=150, kv_heads=1, group=2, head_dim=64,
                dtype=jnp.bfloat16, window=(40, 70), segments=2, soft_cap=3.0)
    self.check(case.replace(bias=(1, 2)), config)
    config = attention_mosaic_gpu.Config(block_q=64, block_kv=64, stages=2, bwd_block_q=128,
                                         bwd_block_kv=128, bwd_stages=3)
    self.check(case.replace(q_len=200, window=(150, 20)), config)

  def test_head_dim_256(self):
    """Past head dim 128: the dk/dv kernel's warpgroups share 64 keys, each its half of dk and
    dv's columns, and the dq kernel takes 32 keys a step (a 64-byte swizzle); causal, GQA,
    segments, a cap, partial blocks at both ends, the heuristic's config. With a float32 bias
    broadcast over batch and heads (no segments): each compute warpgroup of the forward loads
    its own bias tiles, one buffer deep, and the d(bias) kernel takes the head dim in four
    blocks; with segment ids too a bias is refused (the forward's tiles do not fit a CTA)."""
    numerics.slow_when_interpreted(150)
    case = Case(batch=1, q_len=130, kv_len=100, kv_heads=1, group=2, head_dim=256,
                dtype=jnp.bfloat16, causal=True, segments=2, soft_cap=3.0)
    self.check(case, None)
    self.check(case.replace(segments=0, bias=(1, 1), bias_dtype=jnp.float32), None)
    q = jnp.ones((1, 64, 2, 256), jnp.bfloat16)
    with numerics.kernel_mode():
      reason = jk.supports("flash_attention", self.IMPL, q, q, q,
                           bias=jnp.zeros((1, 1, 64, 64), jnp.bfloat16),
                           segment_ids=jnp.zeros((1, 64), jnp.int32)).reason
      assert "a bias at head dim 256 with segment ids" in reason, reason
    q = jnp.ones((1, 64, 2, 256), jnp.bfloat16)
    too_big = attention_mosaic_gpu.Config(block_kv=64, bwd_block_q=128)
    with numerics.kernel_mode(), pytest.raises(ValueError, match="dk/dv kernel needs"):
      jk.flash_attention(q, q, q, implementation=self.IMPL, config=too_big)

  def test_bias_head_dim_128(self):
    """A bias of every batch and head at head dim 128, float32: the d(bias) kernel's ring
    takes the head dim in two blocks; both backward kernels read their tiles of it in the
    float32 swizzle; partial blocks at both ends, T < S."""
    numerics.slow_when_interpreted(60)
    self.check(Case(batch=2, q_len=70, kv_len=130, kv_heads=2, group=1, head_dim=128,
                    dtype=jnp.bfloat16, bias=(2, 2), bias_dtype=jnp.float32), None)

  @pytest.mark.parametrize("head_dim", [96, 32])
  def test_padded_head_dims(self, head_dim):
    """Head dims that are not whole 64-column tiles (96: a model's, 32: under one tile) run on
    q, k and v zero-padded to the next multiple of 64, the outputs and gradients cropped:
    causal GQA with a partial block at both ends, forward and backward; with a bias too at
    96. (CI lowers them: test_lowers_for_cuda.)"""
    numerics.slow_when_interpreted(28)
    case = Case(batch=1, q_len=40, kv_len=33, kv_heads=1, group=2, head_dim=head_dim,
                dtype=jnp.bfloat16, causal=True)
    self.check(case)
    if head_dim == 96:
      self.check(case.replace(causal=False, bias=(1, 2), bias_dtype=jnp.float32))

  @pytest.mark.parametrize("head_dim", [64, 96])
  def test_under_transformations(self, head_dim):
    """The contract on these kernels (64: whole tiles; 96: zero-padded to 128), each against
    the reference by the numerics rule, forward and gradient: eager, jit, and vmap over the
    only batch dim of unbatched (T, N, H) inputs; jax.jvp's tangent (forward mode runs the
    reference). Compiled, jax.checkpoint too, and under jax.debug_nans and jax.debug_infs,
    giving what they give without (interpreted, the kernel's body runs op by op, its -inf
    initial maxima would trip them, and its ordered callbacks do not remat)."""
    numerics.slow_when_interpreted(120)
    case = Case(batch=2, q_len=70, kv_len=66, kv_heads=1, group=2, head_dim=head_dim,
                dtype=jnp.bfloat16, causal=True, return_lse=False)
    (q, k, v, _), _, (do, _) = draw_case(case, "transformations")
    reference_ = case_reference(case, None, None)
    rule = dict(dtype=case.dtype, reduction=max(case.kv_len, case.q_len, head_dim))
    call = functools.partial(jk.flash_attention, causal=True, implementation=self.IMPL)

    def value_and_grads(f):
      out, back = jax.vjp(f, q, k, v)
      return out, back(do)

    variants = [("eager", call), ("jit", jax.jit(call)), ("vmap of unbatched", jax.vmap(call))]
    if numerics.COMPILED:  # the interpreter's ordered callbacks cannot be rematerialized
      variants.append(("checkpoint", jax.checkpoint(call)))
    with numerics.kernel_mode():
      runs = {name: value_and_grads(f) for name, f in variants}
      tangents = tuple(x[::-1] for x in (do, k, v))  # fresh directions, the primals' shapes
      forward = jax.jvp(call, (q, k, v), tangents)
      if numerics.COMPILED:
        with jax.debug_nans(True), jax.debug_infs(True):
          flagged = value_and_grads(call)
        chex.assert_trees_all_equal(flagged, runs["eager"])
    for name, got in runs.items():
      numerics.assert_matches(got, reference_, (q, k, v), do, note=name, **rule)
    assert runs["vmap of unbatched"][0].shape == q.shape
    numerics.assert_matches(forward, lambda cd: lambda q, k, v: jax.jvp(
        reference_(cd), (q, k, v), tuple(t.astype(q.dtype) for t in tangents)), (q, k, v),
        note="jvp", **rule)

  def test_unsupported_calls_say_why(self):
    q = jnp.ones((1, 8, 2, 64), jnp.float32)
    with numerics.kernel_mode():
      assert "16-bit" in jk.supports("flash_attention", self.IMPL, q, q, q).reason

  def test_lowers_for_cuda(self):
    """Forward, dq and dk/dv are Mosaic GPU kernels, and with a bias d(bias) too; with a
    float32 bias and segments at head dims 128 and 192, and a float32 bias at 256 (and 96 and
    200, zero-padded to 128 and 256), every kernel fits a CTA's shared memory (the lowering
    counts it)."""
    q = jax.ShapeDtypeStruct((2, 200, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 300, 2, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 200), jnp.int32)
    kv_seg = jax.ShapeDtypeStruct((2, 300), jnp.int32)
    text = cuda_lowering(every_feature_vjp("mosaic_gpu"), q, k, k, None, seg, kv_seg, q)
    assert text.count("custom_call @mosaic_gpu") == 3, text.count("custom_call @mosaic_gpu")
    for name in ("jk_attention_fwd_mgpu", "jk_attention_dq_mgpu", "jk_attention_dkdv_mgpu"):
      assert name in text, name
    bias = jax.ShapeDtypeStruct((1, 8, 200, 300), jnp.float32)
    text = cuda_lowering(every_feature_vjp("mosaic_gpu"), q, k, k, bias, seg, kv_seg, q)
    assert text.count("custom_call @mosaic_gpu") == 4, text.count("custom_call @mosaic_gpu")
    for name in ("jk_attention_fwd_mgpu", "jk_attention_dq_mgpu", "jk_attention_dkdv_mgpu",
                 "jk_attention_dbias_mgpu"):
      assert name in text, name
    assert "triton" not in text
    for h, segments in ((192, (seg, kv_seg)), (256, (None, None))):
      q, k = (jax.ShapeDtypeStruct(a.shape[:3] + (h,), a.dtype) for a in (q, k))
      text = cuda_lowering(every_feature_vjp("mosaic_gpu"), q, k, k, bias, *segments, q)
      calls = text.count("custom_call @mosaic_gpu")
      assert calls == 4, (h, calls)
    # Head dims not whole 64-column tiles: q, k, v padded (XLA pads), the same four kernels.
    for h in (96, 200):
      q, k = (jax.ShapeDtypeStruct(a.shape[:3] + (h,), a.dtype) for a in (q, k))
      text = cuda_lowering(every_feature_vjp("mosaic_gpu"), q, k, k, bias, None, None, q)
      assert text.count("custom_call @mosaic_gpu") == 4 and "triton" not in text, h


class TestAttentionMosaicTpu(AttentionTest):
  IMPL = "mosaic_tpu"
  DTYPES = (jnp.float32, jnp.bfloat16)

  def test_small_blocks(self):
    """Several query and key blocks: partial ones at both ends, windows cutting blocks, GQA
    walks over the group's heads, a bias broadcast over the batch."""
    config = attention_mosaic_tpu.Config(block_q=16, block_k=128, bwd_block_q=16,
                                         bwd_block_k=128, vmem_limit_bytes=32 << 20)
    self.check(Case(batch=2, q_len=45, kv_len=150, kv_heads=1, group=2, head_dim=32,
                    window=(60, 20), bias=(1, 2), segments=2, soft_cap=3.0), config)

  def test_aot_compiles(self, tpu_mesh):
    """Forward and backward, every feature, compile for v5e, v5p and v6e."""
    q = jax.ShapeDtypeStruct((2, 300, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 500, 2, 128), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 8, 300, 500), jnp.float32)
    seg = jax.ShapeDtypeStruct((2, 300), jnp.int32)
    kv_seg = jax.ShapeDtypeStruct((2, 500), jnp.int32)
    text = aot_compile(tpu_mesh, every_feature_vjp("mosaic_tpu"), q, k, k, bias, seg, kv_seg, q)
    for name in ("jk_attention_fwd", "jk_attention_dkdv", "jk_attention_dq",
                 "jk_attention_dbias"):
      assert name in text, name


  def test_production_blocks_at_head_dim_256(self):
    """The heuristic's heads-major production blocks (512 query rows; backward 512 x 512) at
    head dim 256, GQA, plain and causal, forward and every gradient against the reference:
    they were 128-row blocks there, memory-bound (notes/attn.md tpu-splash-2)."""
    numerics.slow_when_interpreted(20)
    config = attention_mosaic_tpu.heuristic(attention_problem(q_len=1024, heads=2, kv_heads=1,
                                                     head_dim=256, bias=(1, 1)),
                                            hardware.chip("TPU v5e"))
    assert not config.in_place
    assert (config.block_q, config.bwd_block_q, config.bwd_block_k) == (512, 512, 512)
    for causal in (False, True):
      self.check(Case(batch=1, q_len=1024, kv_len=1024, kv_heads=1, group=2, head_dim=256,
                      dtype=jnp.float32, causal=causal), config)

  IN_PLACE = attention_mosaic_tpu.Config(block_q=128, block_k=128, bwd_block_q=128,
                                         bwd_block_k=128, vmem_limit_bytes=32 << 20,
                                         in_place=True)

  @settings(max_examples=numerics.draws(4), deadline=None,
            phases=(Phase.explicit, Phase.generate),
            suppress_health_check=[HealthCheck.differing_executors])
  @given(data=st.data())
  def test_in_place_drawn(self, data):
    """(B, T, N, H) read in place, every head a step: odd T and S over several 128-row
    blocks, GQA groups of 1-3, both dtypes (bfloat16 with even head counts: two heads to a
    32-bit word), head dims of one and two 128-lane pieces and of 64 and 32 (two and four
    heads side by side in 128 lanes), every mask feature."""
    dtype = data.draw(st.sampled_from(self.DTYPES))
    head_dim = data.draw(st.sampled_from([32, 64, 128, 256]))
    kv_heads = data.draw(st.sampled_from(
        [4] if head_dim == 32 else [2] if dtype == jnp.bfloat16 or head_dim == 64 else [1, 2]))
    case = Case(batch=data.draw(st.integers(1, 2)), q_len=data.draw(st.integers(1, 300)),
                kv_len=data.draw(st.integers(1, 300)), kv_heads=kv_heads,
                group=data.draw(st.sampled_from([1, 2, 3])),
                head_dim=head_dim, dtype=dtype,
                causal=data.draw(st.booleans()),
                window=data.draw(st.sampled_from([None, (70, 0), (0, 130)])),
                soft_cap=data.draw(st.sampled_from([None, 2.5])),
                segments=data.draw(st.sampled_from([0, 3])))
    self.check(case, self.IN_PLACE)

  def test_in_place_every_feature(self):
    """Several blocks each way, partial at the ends, a window cutting blocks, GQA 3 over 2
    key heads, segments with fully masked rows, the soft cap, bfloat16."""
    self.check(Case(batch=2, q_len=300, kv_len=400, kv_heads=2, group=3, head_dim=128,
                    dtype=jnp.bfloat16, window=(150, 20), segments=3, soft_cap=3.0),
               self.IN_PLACE)

  def test_in_place_heads_side_by_side(self):
    """Head dim 64, two heads to a 128-lane group: GQA 4 over 4 key heads (key heads shared
    across groups of lanes), partial blocks, a window, segments, the soft cap, bfloat16."""
    self.check(Case(batch=1, q_len=200, kv_len=260, kv_heads=4, group=4, head_dim=64,
                    dtype=jnp.bfloat16, window=(150, 20), segments=3, soft_cap=3.0),
               self.IN_PLACE)

  def test_in_place_where_the_heuristic_takes_it(self):
    """In place at the production shapes on every chip we compile for; heads-major where the
    call needs it (a bias, odd 16-bit head counts, head counts a 128-lane group of heads does
    not divide, head dims neither whole 128 lanes nor a divisor of 128); a config that asks
    in place for a call it cannot take says why."""
    for chip in ("TPU v5e", "TPU v5p", "TPU v6e"):
      for heads, kv_heads, head_dim in ((16, 16, 128), (32, 8, 128), (32, 8, 256), (16, 4, 64)):
        problem = attention_problem(q_len=4096, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
        assert attention_mosaic_tpu.heuristic(problem, hardware.chip(chip)).in_place, (
            chip, heads, kv_heads, head_dim)
    v5e = hardware.chip("TPU v5e")
    for why, problem in (("bias", attention_problem(bias=(1, 1))),
                         ("even", attention_problem(heads=3)),
                         ("multiple of 2", attention_problem(heads=3, head_dim=64)),
                         ("divisor of 128", attention_problem(head_dim=96))):
      assert not attention_mosaic_tpu.heuristic(problem, v5e).in_place
      error = attention_mosaic_tpu.config_error(problem, self.IN_PLACE, v5e)
      assert why in error and "in_place=False" in error
    odd_block = dataclasses.replace(self.IN_PLACE, block_q=144)
    assert "block_q" in attention_mosaic_tpu.config_error(attention_problem(), odd_block, v5e)
    q = jnp.zeros((1, 8, 2, 128), jnp.bfloat16)
    with numerics.kernel_mode(), pytest.raises(ValueError, match="in_place=True, but a bias"):
      jk.flash_attention(q, q, q, bias=jnp.zeros((1, 2, 8, 8)), config=self.IN_PLACE,
                         implementation="mosaic_tpu")

  def test_in_place_reads_heads_in_place(self, tpu_mesh):
    """Compiled for each chip, forward and backward with every mask feature: around the
    kernels nothing writes an array the size of q, k, v, the output or a gradient (no
    transpose, no copy; the (B, T, N) statistics alone are turned), and the in-place kernels
    are the ones that run."""
    b, t, n, kv, h = 2, 1024, 8, 2, 128
    q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b, t, kv, h), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32)
    fn = lambda q, k, v, seg, do: every_feature_vjp("mosaic_tpu")(q, k, v, None, seg, seg, do)
    text = aot_compile(tpu_mesh, fn, q, k, k, seg, q)
    for name in ("jk_attention_fwd_in_place", "jk_attention_dkdv_in_place",
                 "jk_attention_dq_in_place"):
      assert name in text, name
    smallest = b * t * kv * h * 2  # k's bytes
    assert not passes_around_kernels(text, smallest // 4)

  def test_in_place_heads_side_by_side_need_no_copy(self, tpu_mesh):
    """Head dim 64, q, k and v made by products as a model makes them (a (B, T, N, 64)
    argument is laid out T-minor, a relayout for any view): forward and backward compiled
    for each chip, causal GQA, the out projection after; nothing but the products' fusions
    and the kernels writes an array the size of k or larger (no transpose, no copy of the
    saved output, no float32 copy for the backward's delta)."""
    b, t, n, kv, h, d = 2, 1024, 8, 2, 64, 128  # every weight smaller than k

    def loss(x, wq, wk, wv, wo):
      q = (x @ wq).reshape(b, t, n, h)
      k, v = ((x @ w).reshape(b, t, kv, h) for w in (wk, wv))
      out = jk.flash_attention(q, k, v, causal=True, implementation="mosaic_tpu")
      return jnp.sum((out.reshape(b * t, n * h) @ wo).astype(jnp.float32))

    arrays = [(b * t, d), (d, n * h), (d, kv * h), (d, kv * h), (n * h, d)]
    text = aot_compile(tpu_mesh, jax.grad(loss, argnums=range(5)),
                       *(jax.ShapeDtypeStruct(a, jnp.bfloat16) for a in arrays))
    for name in ("fwd", "dkdv", "dq", "delta"):
      assert f"jk_attention_{name}_in_place" in text, name
    assert not passes_around_kernels(text, b * t * kv * h * 2, products=True)

  def test_production_blocks_fit_vmem_at_head_dim_256(self, tpu_mesh):
    """Those blocks, every mask feature, forward and backward, compile for each chip (the
    VMEM the heuristic's 512 x 512 backward needs at head dim 256 fits)."""
    q = jax.ShapeDtypeStruct((1, 1024, 4, 256), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 1024, 1, 256), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 1024), jnp.int32)
    fn = lambda q, k, v, seg, do: every_feature_vjp("mosaic_tpu")(q, k, v, None, seg, seg, do)
    text = aot_compile(tpu_mesh, fn, q, k, k, seg, q)
    assert "jk_attention_dkdv" in text and "jk_attention_dq" in text

  def test_block_traffic_model(self):
    """roofline.attention_traffic, the one model of every flash kernel's bytes: with one block
    a sequence each array moves once; with n query blocks k and v are read n times (all of
    them, or under a causal mask the n (n + 1) / 2 block pairs at or below the diagonal)."""
    b, t, n, h, item = 2, 512, 3, 64, 2
    array, rows = b * n * t * h * item, b * n * t
    once = roofline.attention_traffic(b, t, t, n, n, h, visits=1, block_q=t, block_k=t)
    assert once["fwd"] == 4 * array + 4 * rows  # q, k, v in; o out; the float32 lse
    assert once["dkdv"] == 2 * array + 8 * rows + 4 * array  # q, do, lse, delta; k, v; dk, dv
    assert once["dq"] == 2 * array + 3 * array  # k, v; q, do; dq
    for causal, visits in ((False, 16), (True, 4 * 5 // 2)):
      assert roofline.attention_block_visits(t, t, 128, 128, causal=causal) == visits
      blocks = roofline.attention_traffic(b, t, t, n, n, h, visits=visits, block_q=128,
                                          block_k=128)
      assert blocks["fwd"] == 2 * array + 4 * rows + b * n * visits * 128 * h * item * 2

  @pytest.mark.parametrize("causal", [False, True])
  def test_compiled_cost_counts_the_visited_blocks(self, tpu_mesh, causal):
    """The kernels state what they compute (pl.CostEstimate): the TPU compiler's cost analysis
    of the forward is the two products over the blocks the mask leaves (a causal call's
    diagonal blocks whole: 1 + bq / T over half the full product), and the backward adds its
    five products with the scores recomputed in both of its kernels (14 per 4 of the
    forward's)."""
    import jax.sharding as shd
    b, t, n, h = 1, 2048, 4, 128
    shape = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
    f = lambda q, k, v: jk.flash_attention(q, k, v, causal=causal, implementation="mosaic_tpu")
    sharding = shd.NamedSharding(tpu_mesh, shd.PartitionSpec())
    args = [jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)] * 3

    def flops(fn):
      with jax.set_mesh(tpu_mesh):
        cost = jax.jit(fn).lower(*args).compile().cost_analysis()
      return (cost[0] if isinstance(cost, list) else cost)["flops"]

    forward = roofline.attention_flops(b, t, t, n, h, causal=causal)
    got = flops(f)
    if causal:  # the diagonal's blocks are computed whole
      assert forward < got <= forward * (1 + 1024 / t)
    else:
      assert got == pytest.approx(forward, rel=1e-3)  # and the few FLOPs around the kernel
    ct = jnp.ones(shape.shape, shape.dtype)
    grads = flops(lambda q, k, v: jax.vjp(f, q, k, v)[1](ct))
    backward = grads - got  # the vjp's program runs the forward too
    if causal:  # its own blocks (the backward's may differ from the forward's)
      assert 14 / 4 * forward < backward <= 14 / 4 * forward * (1 + 1024 / t)
    else:
      assert backward == pytest.approx(14 / 4 * forward, rel=1e-3)
