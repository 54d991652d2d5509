"""flash_attention's test cases and their checks, shared by the kernel classes of
tests/test_attention.py (XLA, Triton) and tests/test_attention_mosaic.py (Mosaic GPU, Mosaic
TPU): a drawn case, its float64 oracle, the numerics rule with attention's derived delta
bound, and the base class every kernel's class runs."""

from __future__ import annotations

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

import jaxkernels as jk
from jaxkernels import testing
from jaxkernels.ops.attention import reference
from jaxkernels.ops.attention.common import Window
from tests import cases, numerics

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


def draw_case(case: Case, *labels):
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


def case_reference(case: Case, seg, kv_seg):
  def make(compute_dtype):
    def fn(q, k, v, bias=None):
      out = reference.attention(q, k, v, bias=bias, q_segments=seg, kv_segments=kv_seg,
                                window=Window.of(case.causal, case.window),
                                scale=case.head_dim ** -0.5, soft_cap=case.soft_cap,
                                return_lse=case.return_lse, compute_dtype=compute_dtype)
      return out
    return fn
  return make


def every_feature_vjp(implementation: str):
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


def attention_problem(*, q_len=512, heads=4, kv_heads=2, head_dim=128, bias=None,
             dtype=jnp.bfloat16):
  """An attention Problem, as dispatch builds it, for the heuristics' tests."""
  from jaxkernels.ops.attention import api
  return api.Problem(batch=1, q_len=q_len, kv_len=q_len, heads=heads, kv_heads=kv_heads,
                     head_dim=head_dim, dtype=jnp.dtype(dtype), window=Window(None, None),
                     soft_cap=False, bias=bias, segments=False)


def passes_around_kernels(text: str, at_least: int, products: bool = False) -> list[str]:
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


def delta_rtol(case: Case, reference_, primals, ct) -> list[float]:
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
    (q, k, v, bias), (seg, kv_seg), (do, dlse) = draw_case(case)
    primals = (q, k, v) if bias is None else (q, k, v, bias)
    reference_ = case_reference(case, seg, kv_seg)
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
                      pointwise_rtol=delta_rtol(case, reference_, primals, ct),
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
    (q, k, v, _), _, _ = draw_case(case)
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
    (q, k, v, _), _, _ = draw_case(case)
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
    (q, k, v, _), _, _ = draw_case(case)
    q, k, v = (jnp.stack([a, 2 * a]).reshape(2, 1, *a.shape[1:]) for a in (q, k, v))
    bias = jnp.linspace(-1, 1, 17)  # one bias per key, broadcast over everything else
    with numerics.kernel_mode(), numerics.served_by(self.IMPL, ["flash_attention"]):
      got = jk.flash_attention(q, k, v, bias=bias, implementation=self.IMPL)
    chex.assert_shape(got, q.shape)
    numerics.assert_matches(got, lambda cd: jax.vmap(lambda q, k, v: reference.attention(
        q, k, v, bias=bias, scale=h ** -0.5, compute_dtype=cd)), (q, k, v), dtype=case.dtype,
        reduction=max(case.kv_len, h))
