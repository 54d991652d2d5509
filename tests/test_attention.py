"""flash_attention: the reference against jax.nn.dot_product_attention, every kernel against the
float64 oracle by the numerics rule (output, log-sum-exp and every gradient) over shapes and
mask features drawn by hypothesis, fully masked rows, re-runs, lowering, and bad input."""

from __future__ import annotations

import dataclasses
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

import jaxkernels as jk
from jaxkernels import _triton, hardware, roofline, testing
from jaxkernels.ops.attention import reference
from jaxkernels.ops.attention import mosaic_gpu as attention_mosaic_gpu
from jaxkernels.ops.attention import mosaic_tpu as attention_mosaic_tpu
from jaxkernels.ops.attention import triton as attention_triton
from jaxkernels.ops.attention.common import Window, key_blocks, query_blocks, visible
from tests import cases, numerics
from tests.conftest import aot_compile, cuda_lowering

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@chex.dataclass(frozen=True)
class Case:
  """One call: shapes, dtype and mask features."""

  batch: int
  q_len: int
  kv_len: int
  kv_heads: int
  group: int
  head_dim: int
  dtype: object = jnp.float32
  causal: bool = False
  window: object = None
  soft_cap: object = None
  bias: object = None  # None, or the bias's (Bb, Nb) broadcast pattern
  bias_dtype: object = None  # None: the inputs' dtype
  segments: int = 0  # segment ids drawn from [0, segments)
  return_lse: bool = True

  @property
  def heads(self):
    return self.kv_heads * self.group

  def kwargs(self):
    return dict(causal=self.causal, local_window_size=self.window,
                logits_soft_cap=self.soft_cap, return_lse=self.return_lse)


def _draw(case: Case, *labels):
  gen = numerics.rng(repr(case), *labels)
  b, t, s, n, kv, h = (case.batch, case.q_len, case.kv_len, case.heads, case.kv_heads,
                       case.head_dim)
  q = numerics.normal(gen, (b, t, n, h), case.dtype)
  k = numerics.normal(gen, (b, s, kv, h), case.dtype)
  v = numerics.normal(gen, (b, s, kv, h), case.dtype)
  bias = None
  if case.bias is not None:
    bb, nb = case.bias
    bias = numerics.normal(gen, (bb, nb, t, s), case.bias_dtype or case.dtype)
  seg = kv_seg = None
  if case.segments:
    # Sorted, as packed sequences are; a query segment missing from the keys leaves its rows
    # fully masked.
    seg = jnp.asarray(np.sort(gen.integers(0, case.segments, (b, t))), jnp.int32)
    kv_seg = jnp.asarray(np.sort(gen.integers(0, case.segments, (b, s))), jnp.int32)
  do = numerics.normal(gen, (b, t, n, h), case.dtype)
  dlse = numerics.normal(gen, (b, t, n), jnp.float32)
  return (q, k, v, bias), (seg, kv_seg), (do, dlse)


def _reference(case: Case, seg, kv_seg):
  def make(compute_dtype):
    def fn(q, k, v, bias=None):
      out = reference.attention(q, k, v, bias=bias, q_segments=seg, kv_segments=kv_seg,
                                window=Window.of(case.causal, case.window),
                                scale=case.head_dim ** -0.5, soft_cap=case.soft_cap,
                                return_lse=case.return_lse, compute_dtype=compute_dtype)
      return out
    return fn
  return make


def _every_feature_vjp(implementation: str):
  """(q, k, v, bias or None, seg, kv_seg, do) -> the gradients of one call with every mask
  feature on (causal, window, segments, soft cap, and the bias where one is given): what the
  lowering and AOT tests compile."""
  def fn(q, k, v, bias, seg, kv_seg, do):
    op = functools.partial(jk.flash_attention, segment_ids=seg, kv_segment_ids=kv_seg,
                           causal=True, logits_soft_cap=30.0, local_window_size=(64, 0),
                           implementation=implementation)
    if bias is None:
      return jax.vjp(op, q, k, v)[1](do)
    return jax.vjp(lambda q, k, v, b: op(q, k, v, bias=b), q, k, v, bias)[1](do)
  return fn


def _problem(*, q_len=512, heads=4, kv_heads=2, head_dim=128, bias=None,
             dtype=jnp.bfloat16):
  """An attention Problem, as dispatch builds it, for the heuristics' tests."""
  from jaxkernels.ops.attention import api
  return api.Problem(batch=1, q_len=q_len, kv_len=q_len, heads=heads, kv_heads=kv_heads,
                     head_dim=head_dim, dtype=jnp.dtype(dtype), window=Window(None, None),
                     soft_cap=False, bias=bias, segments=False)


def _passes_around_kernels(text: str, at_least: int, products: bool = False) -> list[str]:
  """The compiled entry computation's instructions (before its root) that write an array of
  ``at_least`` bytes or more: passes over memory around the kernels. Custom calls, views and
  asynchronous copies and slices (-start, -done: an array moved between memory spaces, a
  prefetch into VMEM, in its own layout) are not passes; with ``products``, nor is a
  product's own output fusion."""
  from bench import tpu_predicted
  entry = text[text.index("ENTRY"):]
  found = []
  for line in entry[:entry.index("ROOT")].splitlines():
    op = re.search(r"=\s*(\(.*?\)|\S+)\s+([a-z][\w-]*)\(", line)
    if op is None or op.group(2).endswith(("-start", "-done")) or op.group(2) in (
        "custom-call", "parameter", "bitcast", "get-tuple-element", "tuple", "constant"):
      continue
    if products and "dot_general" in line and "kind=kOutput" in line:
      continue
    if tpu_predicted._type_bytes(op.group(1)) >= at_least:
      found.append(line[:200])
  return found


def _delta_rtol(case: Case, reference_, primals, ct) -> list[float]:
  """The flash backward's float32 rounding where every query sees one key, which autodiff's
  baseline does not share.

  The kernel forms ds = p (dp - delta) with delta = rowsum(o * do) computed ahead and dp a dot
  product of do and v: two sums of the same head_dim terms in different orders. With one
  visible key (p = 1) they cancel exactly in autodiff's arithmetic (ds is the lse's cotangent
  alone) but leave about sqrt(head_dim) eps sum_h |do_h| (|v_h| + |o_h|) here (two sums of
  head_dim roundings, the rule's own sqrt(n) model of a float32 sum), carried into dq and dk through
  k and q and the scale. Where every row is such a row, that is the whole error of dq and dk,
  relative to values the cancellation made small: an H200 drew 4.9e-6 where the rule allowed
  3.4e-6 (1 query, 1 key, head_dim 16). Elsewhere the rows with more keys set dq's and dk's
  scale and the rule's own floor covers this; 0 there.

  One a floating leaf of what the check judges (the output, the lse where returned, then the
  gradients of q, k, v and a bias): this bound for dq and dk, 0 for the others."""
  leaves = [0.0] * ((2 if case.return_lse else 1) + len(primals))
  if case.dtype != jnp.float32 or not (case.kv_len == 1 or case.window == (0, 0)):
    return leaves
  q, k, v = (np.abs(np.asarray(a, np.float64)) for a in primals[:3])
  do = np.abs(np.asarray(ct[0] if case.return_lse else ct, np.float64))
  out, grads = testing.evaluate(reference_, jnp.float64, primals, ct)
  out = out[0] if case.return_lse else out
  largest = min(np.max(np.abs(g)) for g in grads[:2])
  if largest == 0:
    return leaves
  terms = np.max(np.sum(do * (np.max(v) + np.abs(out)), axis=-1))  # the worst row's sums
  # sqrt(head_dim) eps x terms, times the scale head_dim ** -0.5 and |q| or |k|.
  absolute = testing.F32_EPS * terms * max(np.max(q), np.max(k))
  dq = len(leaves) - len(primals)  # the first gradient's leaf
  leaves[dq] = leaves[dq + 1] = float(absolute / largest)
  return leaves


class AttentionTest:
  IMPL = "xla"

  def op(self, case: Case, seg, kv_seg, config=None):
    def fn(q, k, v, bias=None):
      return jk.flash_attention(q, k, v, bias=bias, segment_ids=seg, kv_segment_ids=kv_seg,
                                implementation=self.IMPL, config=config, **case.kwargs())
    return fn

  def check(self, case: Case, config=None):
    (q, k, v, bias), (seg, kv_seg), (do, dlse) = _draw(case)
    primals = (q, k, v) if bias is None else (q, k, v, bias)
    reference_ = _reference(case, seg, kv_seg)
    # A query that sees nothing has lse -inf; its cotangent there is 0 (the reference's -inf
    # is the kernels' too).
    if case.return_lse:
      _, lse = reference_(jnp.float32)(*primals)
      ct = (do, jnp.where(jnp.isfinite(lse), dlse, 0.0))
    else:
      ct = do
    got = cases.check("flash_attention", self.IMPL, self.op(case, seg, kv_seg, config),
                      reference_, primals, ct, dtype=case.dtype,
                      reduction=max(case.kv_len, case.q_len, case.head_dim),
                      pointwise_rtol=_delta_rtol(case, reference_, primals, ct),
                      support=((q, k, v), dict(bias=bias, segment_ids=seg,
                                               kv_segment_ids=kv_seg, **case.kwargs())))
    chex.assert_shape(got[0][0] if case.return_lse else got[0],
                      (case.batch, case.q_len, case.heads, case.head_dim))
    return got

  DTYPES = DTYPES  # what the kernels take (Mosaic TPU: no float16)
  HEAD_DIMS = (16, 24, 32)  # drawn (Mosaic GPU: multiples of 64)
  BIASES = (None, (1, 1), "full", (1, "N"))
  SMALL_HEAD_DIM = 16  # the feature tests' head dim and dtype
  FEATURE_DTYPE = jnp.float32

  def check_drawn(self, data):
    """Odd T and S, T != S, GQA ratios, every mask feature and their combinations."""
    window = data.draw(st.sampled_from([None, 3, (0, 0), (5, 2), (0, 7)]))
    case = Case(batch=data.draw(st.integers(1, 2)), q_len=data.draw(st.integers(1, 70)),
                kv_len=data.draw(st.integers(1, 70)), kv_heads=data.draw(st.integers(1, 2)),
                group=data.draw(st.sampled_from([1, 2, 3])),
                head_dim=data.draw(st.sampled_from(self.HEAD_DIMS)),
                dtype=data.draw(st.sampled_from(self.DTYPES)), causal=data.draw(st.booleans()),
                window=window,
                soft_cap=data.draw(st.sampled_from([None, 2.5])),
                bias=data.draw(st.sampled_from(self.BIASES)),
                segments=data.draw(st.sampled_from([0, 2, 3])))
    b, n = case.batch, case.heads
    if case.bias == "full":
      case = case.replace(bias=(b, n))
    elif case.bias == (1, "N"):
      case = case.replace(bias=(1, n))
    self.check(case)

  # No shrinking: an example costs seconds interpreted; a failure prints the case it drew. The
  # base class's test runs once per implementation (each subclass an executor).
  @settings(max_examples=numerics.draws(2), deadline=None, phases=(Phase.explicit, Phase.generate),
            suppress_health_check=[HealthCheck.differing_executors])
  @given(data=st.data())
  def test_drawn(self, data):
    self.check_drawn(data)

  # Model head dims (the drawn tests take small ones); every dtype is drawn there too.
  @pytest.mark.parametrize("head_dim,dtype", [(64, jnp.bfloat16), (96, jnp.float32)])
  def test_head_dims(self, dtype, head_dim):
    self.check(Case(batch=1, q_len=40, kv_len=33, kv_heads=1, group=2, head_dim=head_dim,
                    dtype=dtype, causal=True))

  def test_fully_masked_rows(self):
    """Queries that see no key (past the keys' end under a (0, 0) window; a segment the keys
    lack) get 0 and zero gradients, and their log-sum-exp is -inf; no NaN anywhere."""
    case = Case(batch=1, q_len=24, kv_len=10, kv_heads=1, group=2, head_dim=self.SMALL_HEAD_DIM,
                dtype=self.FEATURE_DTYPE, window=(0, 0))
    (out, lse), (dq, dk, dv) = self.check(case)
    assert np.all(np.asarray(out[:, 10:]) == 0) and np.all(np.asarray(dq[:, 10:]) == 0)
    assert np.all(np.isneginf(np.asarray(lse[:, 10:])))
    assert np.all(np.isfinite(np.asarray(out[:, :10]))) and np.all(np.isfinite(dk))

  def test_a_bias_of_minus_infinity_masks(self):
    """A mask given as a bias of -inf: the keys it hides get zero gradients, a query it hides
    wholly 0 and zero gradients, the bias's gradient is 0 wherever it is -inf, and no NaN
    anywhere (each backward kernel reads the bias)."""
    case = Case(batch=1, q_len=24, kv_len=20, kv_heads=1, group=2, head_dim=self.SMALL_HEAD_DIM,
                dtype=self.FEATURE_DTYPE)
    (q, k, v, _), _, _ = _draw(case)
    hidden = jnp.zeros((24, 20), bool).at[:, 10:].set(True).at[20:].set(True)
    bias = jnp.where(hidden, -jnp.inf, 0.0).astype(q.dtype)[None, None]
    attend = lambda q, k, v, b: jk.flash_attention(q, k, v, bias=b, implementation=self.IMPL)
    with numerics.kernel_mode():
      out = attend(q, k, v, bias)
      dq, dk, dv, dbias = jax.grad(lambda *a: jnp.sum(attend(*a).astype(jnp.float32)),
                                   (0, 1, 2, 3))(q, k, v, bias)
    f32 = lambda a: np.asarray(a, np.float32)
    for name, a in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv), ("dbias", dbias)):
      assert np.all(np.isfinite(f32(a))), name
    assert np.all(f32(out[:, 20:]) == 0) and np.all(f32(dq[:, 20:]) == 0)
    assert np.all(f32(dk[:, 10:]) == 0) and np.all(f32(dv[:, 10:]) == 0)
    assert np.all(f32(dbias)[0, 0][np.asarray(hidden)] == 0)
    assert np.any(f32(dbias)[0, 0][~np.asarray(hidden)] != 0)

  def test_segments_without_common_ids(self):
    case = Case(batch=2, q_len=20, kv_len=20, kv_heads=1, group=1, head_dim=self.SMALL_HEAD_DIM,
                dtype=self.FEATURE_DTYPE, segments=3)
    (q, k, v, _), _, _ = _draw(case)
    seg = jnp.zeros((2, 20), jnp.int32).at[1].set(1)
    kv_seg = jnp.zeros((2, 20), jnp.int32).at[1].set(2)  # batch 1 sees nothing
    with numerics.kernel_mode():
      out, grads = jax.value_and_grad(lambda q: jnp.sum(jk.flash_attention(
          q, k, v, segment_ids=seg, kv_segment_ids=kv_seg, implementation=self.IMPL)))(q)
      y = jk.flash_attention(q, k, v, segment_ids=seg, kv_segment_ids=kv_seg,
                             implementation=self.IMPL)
    assert np.all(np.asarray(y[1]) == 0) and np.all(np.asarray(grads[1]) == 0)
    assert np.isfinite(float(out))

  def test_extra_batch_dims_and_broadcast_bias(self):
    h = self.SMALL_HEAD_DIM
    case = Case(batch=1, q_len=12, kv_len=17, kv_heads=2, group=2, head_dim=h,
                dtype=self.FEATURE_DTYPE)
    (q, k, v, _), _, _ = _draw(case)
    q, k, v = (jnp.stack([a, 2 * a]).reshape(2, 1, *a.shape[1:]) for a in (q, k, v))
    bias = jnp.linspace(-1, 1, 17)  # one bias per key, broadcast over everything else
    with numerics.kernel_mode(), numerics.served_by(self.IMPL, ["flash_attention"]):
      got = jk.flash_attention(q, k, v, bias=bias, implementation=self.IMPL)
    chex.assert_shape(got, q.shape)
    numerics.assert_matches(got, lambda cd: jax.vmap(lambda q, k, v: reference.attention(
        q, k, v, bias=bias, scale=h ** -0.5, compute_dtype=cd)), (q, k, v), dtype=case.dtype,
        reduction=max(case.kv_len, h))


class TestAttentionXla(AttentionTest):
  IMPL = "xla"

  # The reference itself: fewer draws (the kernels' classes draw the same features).
  @settings(max_examples=1, deadline=None, phases=(Phase.explicit, Phase.generate),
            suppress_health_check=[HealthCheck.differing_executors])
  @given(data=st.data())
  def test_drawn(self, data):
    self.check_drawn(data)


class TestAttentionTriton(AttentionTest):
  IMPL = "triton"

  def test_block_edges(self):
    """Small blocks: partial query and key blocks, windows whose edges fall inside blocks and
    across them, several masked and unmasked runs a walk."""
    config = attention_triton.Config(block_q=16, block_k=16, num_warps=4, num_stages=1,
                                     bwd_block_q=16, bwd_block_k=32, bwd_num_warps=4,
                                     bwd_num_stages=1)
    self.check(Case(batch=1, q_len=70, kv_len=61, kv_heads=1, group=2, head_dim=16,
                    window=(20, 9), bias=(1, 2), segments=2), config)

  def test_lowers_for_cuda(self):
    q = jax.ShapeDtypeStruct((2, 200, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 300, 2, 128), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 8, 200, 300), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 200), jnp.int32)
    kv_seg = jax.ShapeDtypeStruct((2, 300), jnp.int32)
    text = cuda_lowering(_every_feature_vjp("triton"), q, k, k, bias, seg, kv_seg, q)
    for name in ("jk_attention_fwd", "jk_attention_dkdv", "jk_attention_dq",
                 "jk_attention_dbias"):
      assert f'name = "{name}"' in text, name
    # A bias broadcast over the heads: the dbias kernel sums them in a loop (its index
    # arithmetic once failed to lower there).
    bias = jax.ShapeDtypeStruct((1, 1, 200, 300), jnp.bfloat16)
    assert 'name = "jk_attention_dbias"' in cuda_lowering(
        _every_feature_vjp("triton"), q, k, k, bias, seg, kv_seg, q)


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
    (q, k, v, _), _, (do, _) = _draw(case, "transformations")
    reference_ = _reference(case, None, None)
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
    text = cuda_lowering(_every_feature_vjp("mosaic_gpu"), q, k, k, None, seg, kv_seg, q)
    assert text.count("custom_call @mosaic_gpu") == 3, text.count("custom_call @mosaic_gpu")
    for name in ("jk_attention_fwd_mgpu", "jk_attention_dq_mgpu", "jk_attention_dkdv_mgpu"):
      assert name in text, name
    bias = jax.ShapeDtypeStruct((1, 8, 200, 300), jnp.float32)
    text = cuda_lowering(_every_feature_vjp("mosaic_gpu"), q, k, k, bias, seg, kv_seg, q)
    assert text.count("custom_call @mosaic_gpu") == 4, text.count("custom_call @mosaic_gpu")
    for name in ("jk_attention_fwd_mgpu", "jk_attention_dq_mgpu", "jk_attention_dkdv_mgpu",
                 "jk_attention_dbias_mgpu"):
      assert name in text, name
    assert "triton" not in text
    for h, segments in ((192, (seg, kv_seg)), (256, (None, None))):
      q, k = (jax.ShapeDtypeStruct(a.shape[:3] + (h,), a.dtype) for a in (q, k))
      text = cuda_lowering(_every_feature_vjp("mosaic_gpu"), q, k, k, bias, *segments, q)
      calls = text.count("custom_call @mosaic_gpu")
      assert calls == 4, (h, calls)
    # Head dims not whole 64-column tiles: q, k, v padded (XLA pads), the same four kernels.
    for h in (96, 200):
      q, k = (jax.ShapeDtypeStruct(a.shape[:3] + (h,), a.dtype) for a in (q, k))
      text = cuda_lowering(_every_feature_vjp("mosaic_gpu"), q, k, k, bias, None, None, q)
      assert text.count("custom_call @mosaic_gpu") == 4 and "triton" not in text, h


class TestAttentionVariants(chex.TestCase):
  """Under jit and not (chex.variants), every implementation gives bitwise the same output and
  gradients on a re-run."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("xla", "triton", "mosaic_tpu", "mosaic_gpu")
  def test_rerun_bitwise(self, implementation):
    mosaic_gpu = implementation == "mosaic_gpu"  # 16-bit, head dims of multiples of 64
    if mosaic_gpu:
      numerics.slow_when_interpreted(78)
    case = Case(batch=1, q_len=33, kv_len=40, kv_heads=1, group=2,
                head_dim=64 if mosaic_gpu else 16,
                dtype=jnp.bfloat16 if mosaic_gpu else jnp.float32, causal=True, segments=2)
    (q, k, v, _), (seg, kv_seg), (do, _) = _draw(case)
    with numerics.kernel_mode():
      support = jk.supports("flash_attention", implementation, q, k, v)
    if not support:
      self.skipTest(support.reason)
    fn = self.variant(lambda q, k, v: jax.vjp(lambda q, k, v: jk.flash_attention(
        q, k, v, causal=True, segment_ids=seg, kv_segment_ids=kv_seg,
        implementation=implementation), q, k, v))
    with numerics.kernel_mode():
      (out1, vjp1), (out2, vjp2) = fn(q, k, v), fn(q, k, v)
      first, second = (out1, vjp1(do)), (out2, vjp2(do))
    chex.assert_trees_all_equal(first, second)


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
    text = aot_compile(tpu_mesh, _every_feature_vjp("mosaic_tpu"), q, k, k, bias, seg, kv_seg, q)
    for name in ("jk_attention_fwd", "jk_attention_dkdv", "jk_attention_dq",
                 "jk_attention_dbias"):
      assert name in text, name


  def test_production_blocks_at_head_dim_256(self):
    """The heuristic's heads-major production blocks (512 query rows; backward 512 x 512) at
    head dim 256, GQA, plain and causal, forward and every gradient against the reference:
    they were 128-row blocks there, memory-bound (bench/NOTES.md tpu-splash-2)."""
    numerics.slow_when_interpreted(20)
    config = attention_mosaic_tpu.heuristic(_problem(q_len=1024, heads=2, kv_heads=1,
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
        problem = _problem(q_len=4096, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
        assert attention_mosaic_tpu.heuristic(problem, hardware.chip(chip)).in_place, (
            chip, heads, kv_heads, head_dim)
    v5e = hardware.chip("TPU v5e")
    for why, problem in (("bias", _problem(bias=(1, 1))), ("even", _problem(heads=3)),
                         ("multiple of 2", _problem(heads=3, head_dim=64)),
                         ("divisor of 128", _problem(head_dim=96))):
      assert not attention_mosaic_tpu.heuristic(problem, v5e).in_place
      error = attention_mosaic_tpu.config_error(problem, self.IN_PLACE, v5e)
      assert why in error and "in_place=False" in error
    odd_block = dataclasses.replace(self.IN_PLACE, block_q=144)
    assert "block_q" in attention_mosaic_tpu.config_error(_problem(), odd_block, v5e)
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
    fn = lambda q, k, v, seg, do: _every_feature_vjp("mosaic_tpu")(q, k, v, None, seg, seg, do)
    text = aot_compile(tpu_mesh, fn, q, k, k, seg, q)
    for name in ("jk_attention_fwd_in_place", "jk_attention_dkdv_in_place",
                 "jk_attention_dq_in_place"):
      assert name in text, name
    smallest = b * t * kv * h * 2  # k's bytes
    assert not _passes_around_kernels(text, smallest // 4)

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
    assert not _passes_around_kernels(text, b * t * kv * h * 2, products=True)

  def test_production_blocks_fit_vmem_at_head_dim_256(self, tpu_mesh):
    """Those blocks, every mask feature, forward and backward, compile for each chip (the
    VMEM the heuristic's 512 x 512 backward needs at head dim 256 fits)."""
    q = jax.ShapeDtypeStruct((1, 1024, 4, 256), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 1024, 1, 256), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 1024), jnp.int32)
    fn = lambda q, k, v, seg, do: _every_feature_vjp("mosaic_tpu")(q, k, v, None, seg, seg, do)
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


@pytest.mark.cpu_only  # on a GPU jax.nn's float32 products round to tf32
def test_reference_is_jax_nn():
  """Where every query sees a key, the reference is jax.nn.dot_product_attention's answer:
    causal with T != S (top-left aligned), windows, GQA and a bias."""
  gen = numerics.rng("jax.nn")
  q = numerics.normal(gen, (2, 37, 4, 16), jnp.float32)
  k = numerics.normal(gen, (2, 53, 2, 16), jnp.float32)
  v = numerics.normal(gen, (2, 53, 2, 16), jnp.float32)
  bias = numerics.normal(gen, (1, 4, 37, 53), jnp.float32)
  for causal, window in ((False, None), (True, None), (False, (5, 3)), (True, (7, 7)),
                         (False, 4)):
    want = jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=causal,
                                        local_window_size=window, implementation="xla")
    got = jk.flash_attention(q, k, v, bias=bias, causal=causal, local_window_size=window,
                             implementation="xla")
    chex.assert_trees_all_close(got, want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_unbatched_inputs_and_vmap_over_the_only_batch_dim(impl):
  """(T, N, H) without a batch dim, as jax.nn.dot_product_attention takes it (it once raised
  "q must have rank >= 4"): the batched call's answer, gradient and log-sum-exp, and vmap over
  the only batch dim; decode with (S, K, H) caches and a scalar length."""
  gen = numerics.rng("unbatched", impl)
  q = numerics.normal(gen, (2, 24, 4, 16), jnp.float32)
  k = numerics.normal(gen, (2, 30, 2, 16), jnp.float32)
  bias = numerics.normal(gen, (4, 24, 30), jnp.float32)
  call = functools.partial(jk.flash_attention, causal=True, bias=bias, return_lse=True,
                           implementation=impl)
  with numerics.kernel_mode():
    want, want_lse = call(q, k, k)
    grad = jax.grad(lambda q: call(q, k[0], k[0])[0].sum())(q[0])
    want_grad = jax.grad(lambda q: call(q, k, k)[0][0].sum())(q)[0]
    got, lse = call(q[0], k[0], k[0])
    mapped, mapped_lse = jax.vmap(call)(q, k, k)
    decoded = jk.decode_attention(q[0, :1], k[0], k[0], lengths=20, implementation=impl)
    want_decoded = jk.decode_attention(q[:1, :1], k[:1], k[:1], lengths=jnp.array([20]),
                                       implementation=impl)[0]
  chex.assert_shape((got, lse, decoded), ((24, 4, 16), (24, 4), (1, 4, 16)))
  # One computation, programs of two shapes: each sums over the 30 keys and 16 head dims in an
  # order its own shape gets (XLA's fusions), so each result may round apart by up to
  # (S + H) float32 units of its terms (values and softmax weights are under 4 here). The
  # gradient did, by 1.4e-6 at 0.11 on one seed (3 units of 4; the fixed 1e-6 failed).
  bound = 4 * (30 + 16) * numerics.F32_EPS
  chex.assert_trees_all_close((got, lse, grad), (want[0], want_lse[0], want_grad), atol=bound,
                              rtol=bound)
  chex.assert_trees_all_close((mapped, mapped_lse), (want, want_lse), atol=bound, rtol=bound)
  chex.assert_trees_all_close(decoded, want_decoded, atol=bound, rtol=bound)


# CI: the reference and one kernel backend; Mosaic TPU's under SLOW (16 s interpreted).
@pytest.mark.parametrize("impl", ["xla", "triton", pytest.param("mosaic_tpu",
                                                                marks=pytest.mark.slow)])
def test_under_numpy_rank_promotion_raise(impl):
  """With jax.numpy_rank_promotion("raise") (JAX's strict mode, which some codebases set
  globally), every mask feature forward and backward, and decode: the reference's mask once
  broadcast a (T, S) plane against (B, K, G, T, S) segments, decode's combine a (splits, ...)
  stack against its maximum."""
  if impl == "mosaic_tpu" and jax.default_backend() != "cpu":
    pytest.skip("mosaic_tpu runs here interpreted, on the CPU")
  gen = numerics.rng("rank promotion", impl)
  q = numerics.normal(gen, (2, 16, 4, 16), jnp.float32)
  k = numerics.normal(gen, (2, 16, 2, 16), jnp.float32)
  segments = jnp.array([[0] * 8 + [1] * 8, [0] * 5 + [1] * 11], jnp.int32)
  features = (dict(causal=True, segment_ids=segments),
              dict(local_window_size=(4, 0), segment_ids=segments),
              dict(bias=numerics.normal(gen, (16, 16), jnp.float32), causal=True),
              dict(local_window_size=3, logits_soft_cap=5.0))
  # The flag changes no value, only whether a broadcast may add dimensions: that it runs is
  # the test (each call once, not against a run without the flag: half the time).
  with numerics.kernel_mode(), jax.numpy_rank_promotion("raise"):
    got = [jax.value_and_grad(lambda q: jk.flash_attention(
        q, k, k, implementation=impl, **kw).sum())(q) for kw in features]
    got_decode = jk.decode_attention(q[:, :2], k, k, lengths=jnp.array([9, 16]),
                                     implementation=impl)
  chex.assert_tree_all_finite((got, got_decode))
  chex.assert_shape([g for _, g in got] + [got_decode], [q.shape] * 4 + [(2, 2, 4, 16)])


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_under_jax_debug_infs(impl):
  """jax.debug_infs(True) checks every primitive's output op by op (and a jitted call's
  outputs): masked attention once wrote -inf for the hidden logits on XLA's path, and
  attention_fn built its mask's bias from -inf, so every causal call raised. Now an inf appears
  only where the contract puts one (the log-sum-exp of a row that sees nothing). Values as
  without the flag; attention_fn's fully masked row 0. The kernels' own insides are opaque
  compiled, not when interpreted (an interpreter runs their body op by op): compiled only."""
  if impl != "xla" and not numerics.COMPILED:
    pytest.skip("interpreted kernels run their bodies op by op: debug_infs sees their -inf "
                "initial maxima; the GPU check runs this compiled")
  import jaxkernels.flax as jkf

  gen = numerics.rng("debug infs", impl)
  q = numerics.normal(gen, (2, 16, 4, 16), jnp.float32)
  k = numerics.normal(gen, (2, 16, 2, 16), jnp.float32)
  segments = jnp.array([[0] * 8 + [1] * 8, [0] * 5 + [1] * 11], jnp.int32)
  mask = jnp.tril(jnp.ones((16, 16), bool)).at[3].set(False)  # row 3 sees nothing
  calls = [
      lambda q: jk.flash_attention(q, k, k, causal=True, implementation=impl),
      lambda q: jk.flash_attention(q, k, k, local_window_size=(3, 0), segment_ids=segments,
                                   implementation=impl),
      lambda q: jk.flash_attention(q, k, k, causal=True, return_lse=True,
                                   implementation=impl)[1],
      lambda q: jkf.attention_fn(q, k, k, mask=mask[None, None], implementation=impl),
  ]
  with numerics.kernel_mode():
    want = [jax.value_and_grad(lambda q: jnp.sum(call(q)))(q) for call in calls]
    with jax.debug_infs(True):
      got = [jax.value_and_grad(lambda q: jnp.sum(call(q)))(q) for call in calls]
      decoded = jk.decode_attention(q[:, :2], k, k, lengths=jnp.array([9, 16]),
                                    implementation=impl)
      masked_out = calls[-1](q)
  chex.assert_trees_all_close(got, want, atol=0, rtol=0)
  chex.assert_tree_all_finite((got, decoded))
  assert not np.any(np.asarray(masked_out[:, 3]))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), row0=st.integers(0, 80), block=st.sampled_from([4, 16]),
       n_keys=st.integers(1, 90), left=st.sampled_from([None, 0, 3, 17]),
       right=st.sampled_from([None, 0, 5, 30]))
def test_block_runs_cover_the_mask(rows, row0, block, n_keys, left, right):
  """key_blocks' runs: every visible pair lies in a visited block, the unmasked run's blocks
  are visible whole, and the same from the keys' side (query_blocks)."""
  window = Window(left, right)
  q = np.arange(row0, row0 + rows)[:, None]
  j = np.arange(n_keys)[None, :]
  mask = visible(q, j, window)
  mask = np.ones((rows, n_keys), bool) if mask is None else np.asarray(mask)
  first, full_first, full_end, end = (int(x) for x in key_blocks(row0, rows, block, n_keys,
                                                                  window))
  assert first <= full_first <= full_end <= end
  blocks = np.arange(n_keys) // block
  assert not np.any(mask[:, (blocks < first) | (blocks >= end)])
  full = (blocks >= full_first) & (blocks < full_end)
  assert np.all(mask[:, full])
  assert full_first == full_end or full_end * block <= n_keys  # the unmasked run's keys exist
  k0 = row0  # the same walk from the keys' side: keys [k0, k0 + rows) against n_keys queries
  first, full_first, full_end, end = (int(x) for x in query_blocks(k0, rows, block, n_keys,
                                                                    window))
  kmask = visible(np.arange(n_keys)[:, None], np.arange(k0, k0 + rows)[None, :], window)
  kmask = np.ones((n_keys, rows), bool) if kmask is None else np.asarray(kmask)
  assert not np.any(kmask[(blocks < first) | (blocks >= end)])
  assert np.all(kmask[(blocks >= full_first) & (blocks < full_end)])


@pytest.mark.cpu_only  # on a GPU a kernel serves the call
def test_falls_back_with_a_warning_on_cpu():
  q = jnp.ones((1, 8, 2, 16))
  with pytest.warns(jk.FallbackWarning, match="no Pallas kernel runs on cpu: every op runs "
                    "its XLA reference"):
    jk.flash_attention(q, q, q, causal=True)


def test_residuals_are_saved_under_checkpoint_names():
  """The forward's output and log-sum-exp carry names that remat policies select: saving
  them, the backward runs no second forward kernel; saving nothing, it does."""
  q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)

  def loss(q, k, v):
    return jnp.sum(jk.flash_attention(q, k, v, causal=True, implementation="triton")
                   .astype(jnp.float32))

  def lowered(policy):
    return cuda_lowering(jax.value_and_grad(jax.checkpoint(loss, policy=policy),
                                            argnums=(0, 1, 2)), q, q, q)

  fwd = 'name = "jk_attention_fwd"'
  saved = lowered(jax.checkpoint_policies.save_only_these_names("attention_out",
                                                                "attention_lse"))
  assert saved.count(fwd) == 1
  assert lowered(jax.checkpoint_policies.nothing_saveable).count(fwd) == 2


class TestAttentionErrors:
  q = jnp.ones((2, 8, 4, 16))
  k = jnp.ones((2, 10, 2, 16))

  @pytest.mark.parametrize("kwargs,error,match", [
      (dict(k=jnp.ones((2, 10, 2, 32))), ValueError, "same shape"),
      (dict(k=jnp.ones((2, 10, 2, 32)), v=jnp.ones((2, 10, 2, 32))), ValueError, "same head dim"),
      (dict(k=jnp.ones((2, 10, 3, 16)), v=jnp.ones((2, 10, 3, 16))), ValueError,
       r"q's heads \(4\) must be a multiple of k's heads \(3\)"),
      (dict(q=jnp.ones((8, 16))), ValueError, "q must have rank >= 3"),
      (dict(q=jnp.ones((2, 8, 4, 300)), k=jnp.ones((2, 10, 2, 300)),
            v=jnp.ones((2, 10, 2, 300))), ValueError, "head dim 300 is not supported"),
      (dict(segment_ids=jnp.zeros((2, 9), jnp.int32)), ValueError,
       r"segment_ids must have shape \(2, 8\)"),
      (dict(segment_ids=jnp.zeros((2, 8))), TypeError, "segment_ids must have an integer dtype"),
      (dict(segment_ids=jnp.zeros((2, 8), jnp.int32)), ValueError, "T=8 and S=10 differ"),
      (dict(kv_segment_ids=jnp.zeros((2, 10), jnp.int32)), ValueError, "needs segment_ids"),
      (dict(local_window_size=-1), ValueError, "local_window_size must be >= 0"),
      (dict(local_window_size=(3, -2)), ValueError, "local_window_size must be >= 0"),
      (dict(local_window_size=(1, 2, 3)), TypeError, "local_window_size must be an int or"),
      (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap must be a finite float > 0"),
      (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap must be a finite float > 0"),
      (dict(bias=jnp.ones((3, 4, 8, 10))), ValueError, "bias of shape .* does not broadcast"),
      (dict(bias=jnp.ones((8, 11))), ValueError, "bias of shape .* does not broadcast"),
      (dict(implementation="cuda"), ValueError, "implementation='cuda' is not one of"),
      (dict(causal=1), TypeError, "causal must be a bool"),
      (dict(scale=float("nan")), ValueError, "scale must be finite"),
  ])
  def test_bad_input(self, kwargs, error, match):
    args = dict(q=self.q, k=self.k, v=self.k)
    args.update({name: kwargs.pop(name) for name in ("q", "k", "v") if name in kwargs})
    with pytest.raises(error, match=match):
      jk.flash_attention(args["q"], args["k"], args["v"], **kwargs)

  def test_v_dtype(self):
    with pytest.raises(TypeError, match="one dtype"):
      jk.flash_attention(self.q, self.k, self.k.astype(jnp.bfloat16))

  def test_config_type(self):
    with jk.interpret_mode(), pytest.raises(TypeError, match="config for implementation"):
      jk.flash_attention(self.q, self.k, self.k, implementation="triton", config=object())


# --------------------------------------------------------------------------- #
# decode_attention
# --------------------------------------------------------------------------- #


class DecodeTest:
  IMPL = "xla"

  def check(self, batch, tq, kv_heads, group, s, h, dtype, *, soft_cap=None, window=None,
            lengths=None, config=None, traced=False):
    gen = numerics.rng("decode", batch, tq, kv_heads, group, s, h, jnp.dtype(dtype).name,
                       soft_cap, window)
    n = kv_heads * group
    q = numerics.normal(gen, (batch, tq, n, h), dtype)
    k = numerics.normal(gen, (batch, s, kv_heads, h), dtype)
    v = numerics.normal(gen, (batch, s, kv_heads, h), dtype)
    if lengths is None:  # the shortest cache (only the new queries), the full one, and between
      lengths = np.concatenate([[tq, s], gen.integers(tq, s + 1, max(batch - 2, 0))])[:batch]
    lengths = jnp.asarray(lengths, jnp.int32)
    call = lambda q, k, v, n: jk.decode_attention(
        q, k, v, lengths=n, logits_soft_cap=soft_cap, local_window_size=window,
        implementation=self.IMPL, config=config)
    run = jax.jit(call) if traced else call  # traced: the lengths too

    def ref(cd):
      return lambda q, k, v: reference.decode(q, k, v, lengths, scale=h ** -0.5,
                                              soft_cap=soft_cap, window_left=window,
                                              compute_dtype=cd)
    # (supports asks with the shapes it reads: a traced call's lengths may be past the cache)
    got = cases.check("decode_attention", self.IMPL, lambda q, k, v: run(q, k, v, lengths), ref,
                      (q, k, v), None, dtype=dtype, reduction=max(s, h), grads=False,
                      support=((q, k, v), {"lengths": jnp.minimum(lengths, s)}))
    chex.assert_shape(got, q.shape)
    return q, k, v, lengths

  @pytest.mark.parametrize("dtype", DTYPES)
  def test_one_query_gqa(self, dtype):
    self.check(4, 1, 2, 4, 300, 64, dtype)

  def test_several_queries_window_cap(self):
    self.check(3, 4, 2, 2, 200, 32, jnp.float32, soft_cap=3.0, window=50)

  def test_mqa_odd_head_dim(self):
    self.check(2, 2, 1, 6, 77, 24, jnp.bfloat16)

  def test_a_length_past_the_cache_sees_all_of_it(self):
    """Known lengths past the cache are refused (TestDecodeErrors); traced ones cannot be
    checked, and see the whole cache as the reference does: never a read past its end."""
    self.check(2, 1, 1, 2, 50, 32, jnp.float32, lengths=[57, 20], traced=True)

  def test_gradient_is_the_references(self):
    q, k, v, lengths = self.check(2, 1, 1, 2, 40, 16, jnp.float32)
    with numerics.kernel_mode():
      got = jax.grad(lambda q, k, v: jnp.sum(jk.decode_attention(
          q, k, v, lengths=lengths, implementation=self.IMPL) ** 2), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda q, k, v: jnp.sum(reference.decode(
        q, k, v, lengths, scale=0.25) ** 2), argnums=(0, 1, 2))(q, k, v)
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)


class TestDecodeXla(DecodeTest):
  IMPL = "xla"

  @pytest.mark.cpu_only  # on a GPU jax.nn's float32 products round to tf32
  def test_one_query_is_jax_nn_with_lengths(self):
    q, k, v, lengths = self.check(3, 1, 2, 2, 50, 16, jnp.float32)
    want = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                        implementation="xla")
    got = jk.decode_attention(q, k, v, lengths=lengths, implementation="xla")
    chex.assert_trees_all_close(got, want, atol=2e-6, rtol=2e-6)


class TestDecodeTriton(DecodeTest):
  IMPL = "triton"

  def test_chunks_past_the_length(self):
    """More chunks than some sequences have keys: their partials see nothing and drop out."""
    from jaxkernels.ops.attention import triton_decode
    config = triton_decode.Config(block_k=16, splits=8, num_warps=4, num_stages=1)
    self.check(3, 2, 1, 3, 130, 32, jnp.float32, lengths=[2, 17, 130], config=config)

  def test_lowers_for_cuda(self):
    q = jax.ShapeDtypeStruct((8, 1, 32, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((8, 4096, 8, 128), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((8,), jnp.int32)
    text = cuda_lowering(lambda q, k, v, n: jk.decode_attention(
        q, k, v, lengths=n, implementation="triton"), q, k, k, lengths)
    assert 'name = "jk_decode_attention"' in text


class TestDecodeMosaicGpu(DecodeTest):
  """16-bit inputs at head dims of whole 64s (what the kernel takes; the base tests' float32
  and head dims 16-32 it refuses by name), a group's rows padded to a warpgroup's 64."""

  IMPL = "mosaic_gpu"
  test_one_query_gqa = test_several_queries_window_cap = test_mqa_odd_head_dim = None
  test_a_length_past_the_cache_sees_all_of_it = test_gradient_is_the_references = None

  # (batch, tq, kv heads, group, S, H, dtype, options): S of 200 and 136 not whole blocks of
  # 64 (the last block past the cache, its zeros masked); chunks past a sequence's length;
  # 4 queries of 16 heads: a group's 64 rows, the most the kernel takes.
  @pytest.mark.parametrize("shape,dtype,options", [
      ((2, 1, 2, 4, 200, 64), jnp.bfloat16, {}),
      ((3, 4, 2, 2, 200, 64), jnp.float16, dict(soft_cap=3.0, window=50)),
      ((3, 2, 1, 3, 136, 128), jnp.bfloat16, dict(lengths=[2, 17, 136], splits=8)),
      ((1, 4, 1, 16, 128, 64), jnp.bfloat16, dict(window=7)),
      ((2, 1, 1, 2, 64, 64), jnp.bfloat16, dict(lengths=[70, 20], traced=True)),
  ], ids=["ragged-cache", "window-cap-f16", "chunks-past-length", "64-rows",
          "length-past-cache"])
  def test_decode(self, shape, dtype, options):
    from jaxkernels.ops.attention.mosaic_gpu import decode
    options = dict(options)
    config = decode.Config(block_k=64, splits=options.pop("splits", 2), stages=2)
    self.check(*shape, dtype, config=config, **options)

  @pytest.mark.parametrize("shape,dtype,why", [
      ((1, 1, 2, 2, 64, 64), jnp.float32, "float32 inputs"),
      ((1, 1, 2, 2, 64, 96), jnp.bfloat16, "head dim 96 is not a multiple of 64"),
      ((1, 5, 1, 13, 64, 64), jnp.bfloat16, "65 rows, over a warpgroup's 64"),
      ((1, 1, 2, 2, 300, 64), jnp.bfloat16, "the caches' length 300 is not a multiple of 8"),
  ])
  def test_unsupported_names_why(self, shape, dtype, why):
    b, tq, kv_heads, group, s, h = shape
    q = jnp.ones((b, tq, kv_heads * group, h), dtype)
    k = jnp.ones((b, s, kv_heads, h), dtype)
    with numerics.kernel_mode():
      supported = jk.supports("decode_attention", "mosaic_gpu", q, k, k,
                              lengths=jnp.full((b,), s))
    assert not supported and why in supported.reason

  def test_lowers_for_cuda(self):
    """The bench's shape (Llama 3 8B's heads), with a cap and a window, through Mosaic GPU's
    passes; and at head dim 256."""
    lengths = jax.ShapeDtypeStruct((8,), jnp.int32)
    for h in (128, 256):
      q = jax.ShapeDtypeStruct((8, 1, 32, h), jnp.bfloat16)
      k = jax.ShapeDtypeStruct((8, 4096, 8, h), jnp.bfloat16)
      text = cuda_lowering(lambda q, k, v, n: jk.decode_attention(
          q, k, v, lengths=n, logits_soft_cap=30.0, local_window_size=1024,
          implementation="mosaic_gpu"), q, k, k, lengths)
      assert text.count("@mosaic_gpu_v2(") == 1 and _triton.CUSTOM_CALL not in text


class TestDecodeMosaicTpu(DecodeTest):
  IMPL = "mosaic_tpu"

  def test_chunks_blocks_and_heads_a_block(self):
    """Several chunks a sequence, some past its length, windows that leave blocks behind, and
    16 kv heads of float32 (two blocks of a sublane tile's 8 heads)."""
    from jaxkernels.ops.attention import mosaic_tpu_decode
    config = mosaic_tpu_decode.Config(block_k=32, splits=3, vmem_limit_bytes=16 << 20)
    self.check(3, 2, 16, 2, 130, 64, jnp.float32, lengths=[2, 47, 130], window=40,
               config=config)

  @pytest.mark.parametrize("tpu_mesh", ["v5e", "v5p", "v6e"], indirect=True)
  def test_compiles_for_tpu(self, tpu_mesh):
    q = jax.ShapeDtypeStruct((8, 1, 32, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((8, 32768, 8, 128), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((8,), jnp.int32)
    text = aot_compile(tpu_mesh, lambda q, k, v, n: jk.decode_attention(
        q, k, v, lengths=n, logits_soft_cap=30.0, local_window_size=4096,
        implementation="mosaic_tpu"), q, k, k, lengths)
    assert "jk_decode_attention" in text


class TestDecodeErrors:
  q = jnp.ones((2, 1, 4, 16))
  k = jnp.ones((2, 10, 2, 16))

  @pytest.mark.parametrize("kwargs,error,match", [
      (dict(lengths=None), ValueError, "lengths is required"),
      (dict(lengths=jnp.ones((3,), jnp.int32)), ValueError, r"lengths must have shape \(2,\)"),
      (dict(lengths=jnp.ones((2,))), TypeError, "lengths must have an integer dtype"),
      (dict(lengths=jnp.ones((2,), jnp.int32), local_window_size=-3), ValueError,
       "local_window_size must be >= 0"),
      (dict(lengths=jnp.ones((2,), jnp.int32), local_window_size=(3, 0)), TypeError,
       "local_window_size must be an int"),
      (dict(lengths=jnp.ones((2,), jnp.int32), logits_soft_cap=0), ValueError,
       "logits_soft_cap must be a finite float > 0"),
      (dict(lengths=jnp.array([3, 11])), ValueError,
       r"lengths must be in \[0, 10\] \(the caches' length S\), got 11"),
      (dict(lengths=jnp.array([-1, 4])), ValueError, r"lengths must be in \[0, 10\].*got -1"),
      (dict(lengths=jnp.ones((2,), jnp.int32), scale=float("inf")), ValueError,
       "scale must be finite"),
      (dict(v_cache=jnp.ones((2, 10, 2, 8)), lengths=jnp.ones((2,), jnp.int32)), ValueError,
       r"k_cache and v_cache must have the same shape"),
      (dict(k_cache=jnp.ones((2, 10, 3, 16)), v_cache=jnp.ones((2, 10, 3, 16)),
            lengths=jnp.ones((2,), jnp.int32)), ValueError,
       r"q's heads \(4\) must be a multiple of k_cache's heads \(3\)"),
  ])
  def test_bad_input(self, kwargs, error, match):
    """Each error names decode_attention and its own arguments (flash_attention's checks
    named flash_attention, k and v)."""
    caches = {name: kwargs.pop(name, self.k) for name in ("k_cache", "v_cache")}
    with pytest.raises(error, match="^decode_attention: " + match):
      jk.decode_attention(self.q, caches["k_cache"], caches["v_cache"], **kwargs)

  def test_lengths_under_jit_are_not_read(self):
    """Traced lengths cannot be checked where they are not yet known: no error, no host
    read."""
    out = jax.jit(lambda n: jk.decode_attention(self.q, self.k, self.k, lengths=n))(
        jnp.array([3, 10]))
    chex.assert_shape(out, self.q.shape)


@pytest.mark.parametrize("q_shape,k_len", [((2, 0, 4, 16), 8), ((0, 8, 4, 16), 8),
                                           ((2, 8, 4, 16), 0)])
def test_empty_calls_give_empty_or_zero_results(q_shape, k_len):
  """No query (T = 0, or an empty batch) or no key: the right shapes, zeros and -inf, no
  error (T = 0 once raised a bare ZeroDivisionError from a reshape), zero gradients."""
  q = jnp.ones(q_shape, jnp.float32)
  k = jnp.ones((*q_shape[:-3], k_len, 2, 16), jnp.float32)
  out, lse = jk.flash_attention(q, k, k, causal=True, return_lse=True)
  chex.assert_shape(out, q_shape)
  chex.assert_shape(lse, q_shape[:-1])
  assert not np.any(np.asarray(out)) and np.all(np.asarray(lse) == -np.inf)
  dk = jax.grad(lambda k: jnp.sum(jk.flash_attention(q, k, k)))(k)
  chex.assert_shape(dk, k.shape)
  assert not np.any(np.asarray(dk))
