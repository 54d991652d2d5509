"""flash_attention: the reference against jax.nn.dot_product_attention, the XLA path and
Triton's kernels against the float64 oracle by the numerics rule (output, log-sum-exp and every
gradient) over shapes and mask features drawn by hypothesis, fully masked rows, re-runs,
lowering, and bad input. Hopper's and TPU's kernels: tests/test_attention_mosaic.py; decode:
tests/test_decode.py."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

import jaxkernels as jk
from jaxkernels.ops.attention import triton as attention_triton
from jaxkernels.ops.attention.common import Window, key_blocks, query_blocks, visible
from tests import numerics
from tests.attention_cases import AttentionTest, Case, draw_case, every_feature_vjp
from tests.conftest import cuda_lowering


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
    text = cuda_lowering(every_feature_vjp("triton"), q, k, k, bias, seg, kv_seg, q)
    for name in ("jk_attention_fwd", "jk_attention_dkdv", "jk_attention_dq",
                 "jk_attention_dbias"):
      assert f'name = "{name}"' in text, name
    # A bias broadcast over the heads: the dbias kernel sums them in a loop (its index
    # arithmetic once failed to lower there).
    bias = jax.ShapeDtypeStruct((1, 1, 200, 300), jnp.bfloat16)
    assert 'name = "jk_attention_dbias"' in cuda_lowering(
        every_feature_vjp("triton"), q, k, k, bias, seg, kv_seg, q)


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
    (q, k, v, _), (seg, kv_seg), (do, _) = draw_case(case)
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
