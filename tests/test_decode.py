"""decode_attention on every implementation against its reference (fused into the float64
oracle), its errors, and empty calls."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkernels as jk
from jaxkernels import _triton
from jaxkernels.ops.attention import reference
from tests import cases, numerics
from tests.attention_cases import DTYPES
from tests.conftest import aot_compile, cuda_lowering


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
