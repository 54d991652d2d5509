"""Softmax cross-entropy, on logits and fused with the output projection: every backend against
the float64 oracle, forward and backward; ignored, masked and out-of-range rows; memory."""

from __future__ import annotations

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, given, settings, strategies as st
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxkernels as jk
from jaxkernels import _mosaic_gpu, _triton
from jaxkernels.ops.cross_entropy import api, reference
from jaxkernels.ops.cross_entropy import mosaic_gpu as ce_mosaic_gpu
from jaxkernels.ops.cross_entropy import mosaic_tpu as ce_mosaic_tpu
from jaxkernels.ops.cross_entropy import triton as ce_triton
from tests import cases, numerics
from tests.conftest import aot_compile, cuda_lowering

IGNORE = -100
# Each backend's drawn test is its own (hypothesis wants one executor a test function).
DRAWN = settings(max_examples=numerics.draws(4), deadline=None,
                 phases=(Phase.explicit, Phase.generate))


def _reduced(loss, labels, reduction, ignore_index):
  if reduction == "none":
    return loss
  if reduction == "sum":
    return jnp.sum(loss)
  kept = labels != ignore_index if ignore_index is not None else jnp.ones(labels.shape, bool)
  return jnp.sum(loss) / jnp.maximum(jnp.sum(kept), 1).astype(loss.dtype)


def _inputs(shape, vocab, dtype, *tags, ignored=0.2):
  gen = numerics.rng("cross_entropy", shape, vocab, jnp.dtype(dtype).name, *tags)
  logits = numerics.normal(gen, (*shape, vocab), dtype, 3.0)
  labels = jnp.asarray(gen.integers(0, vocab, shape), jnp.int32)
  labels = jnp.where(jnp.asarray(gen.random(shape) < ignored), IGNORE, labels)
  return gen, logits, labels


class CrossEntropyTest:
  IMPL = "xla"
  DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)  # drawn: what the backend takes
  MASKED_VOCAB, RANGE_VOCAB = 40, 30  # the masked-rows and out-of-range tests' classes

  def check(self, logits, labels, dtype, reduction="none", config=None, **options):
    gen = numerics.rng("ct", logits.shape, reduction)
    out_shape = labels.shape if reduction == "none" else ()
    ct = numerics.normal(gen, out_shape, jnp.float32)
    fn = lambda z: jk.softmax_cross_entropy(z, labels, reduction=reduction,
                                            implementation=self.IMPL, config=config, **options)
    ignore = options.get("ignore_index")
    ref = lambda cd: lambda z: _reduced(
        reference.softmax_cross_entropy(z, labels, compute_dtype=cd, **options)[0], labels,
        reduction, ignore)
    got = cases.check("softmax_cross_entropy", self.IMPL, fn, ref, (logits,), ct, dtype=dtype,
                      reduction=logits.shape[-1],
                      support=((logits, labels), {"reduction": reduction, **options}))
    chex.assert_shape(got[0], out_shape)
    chex.assert_type(got[0], jnp.float32)
    return got

  def check_drawn(self, data):
    """Odd row counts and vocabularies, every dtype and option, ignored rows, reductions."""
    shape = (data.draw(st.integers(1, 3)), data.draw(st.integers(1, 13)))
    vocab = data.draw(st.sampled_from([1, 7, 128, 301, 1000]))
    dtype = data.draw(st.sampled_from(self.DTYPES))
    options = dict(label_smoothing=data.draw(st.sampled_from([0.0, 0.1])),
                   z_loss=data.draw(st.sampled_from([0.0, 1e-3])),
                   ignore_index=data.draw(st.sampled_from([None, IGNORE])))
    reduction = data.draw(st.sampled_from(api.REDUCTIONS))
    _, logits, labels = _inputs(shape, vocab, dtype, "drawn",
                                ignored=0.2 if options["ignore_index"] is not None else 0.0)
    self.check(logits, labels, dtype, reduction, **options)

  def test_masked_and_ignored_rows(self):
    """Classes masked with -inf take no share; an ignored row gives 0 and zero gradients, even
    one whose logits are all -inf (no NaN anywhere)."""
    _, logits, labels = _inputs((6,), self.MASKED_VOCAB, jnp.float32, "masked", ignored=0.0)
    logits = logits.at[1, 20:].set(-jnp.inf).at[4].set(-jnp.inf)
    labels = labels.at[1].set(5).at[4].set(IGNORE)
    loss, (dz,) = self.check(logits, labels, jnp.float32, ignore_index=IGNORE)
    assert float(loss[4]) == 0.0 and np.all(np.asarray(dz[4]) == 0)
    assert np.all(np.asarray(dz[1, 20:]) == 0) and np.all(np.isfinite(np.asarray(dz)))

  @pytest.mark.parametrize("label_smoothing,z_loss", [(0.0, 0.0), (0.1, 0.0), (0.1, 1e-3)])
  def test_one_class(self, label_smoothing, z_loss):
    """One class: the loss and its gradient are 0 for any logit, smoothed or not (the rule
    judges an all-zero leaf against the inputs' scale); with a z-loss, its share alone. The
    loss comes out exactly 0, and so does a kernel's gradient (its terms kept apart)."""
    for dtype in self.DTYPES:
      _, logits, labels = _inputs((2, 5), 1, dtype, "one class", ignored=0.0)
      loss, (dz,) = self.check(logits, labels, dtype, label_smoothing=label_smoothing,
                               z_loss=z_loss)
      if not z_loss:
        assert np.all(np.asarray(loss) == 0.0)
        if self.IMPL != "xla":  # the reference's autodiff adds its terms in its own order
          assert np.all(np.asarray(dz, np.float32) == 0.0)

  @pytest.mark.parametrize("axis, where", [(1, None), (1, "tokens"), ((1, 2), "tokens"),
                                           (0, "classes"), ((0, 2), "classes")])
  def test_optax_axis_and_where(self, axis, where):
    """optax's ``axis`` (an int, or a tuple whose classes a label indexes flat) and ``where``
    (the tokens that count, or the classes each token takes in), as optax documents them:
    the per-token losses and their gradient are optax's; the mean is over the tokens that
    count."""
    import optax

    gen = numerics.rng("optax form", self.IMPL, axis, where)
    shape = (5, 6, 7)
    axes = (axis,) if isinstance(axis, int) else axis
    tokens = tuple(d for d in range(3) if d not in axes)
    classes = int(np.prod([shape[d] for d in axes]))
    logits = numerics.normal(gen, shape, jnp.float32, 2.0)
    labels = jnp.asarray(gen.integers(0, classes, [shape[d] for d in tokens]), jnp.int32)
    mask = None
    if where == "tokens":
      mask = jnp.asarray(gen.random(labels.shape) < 0.6)
    elif where == "classes":
      mask = jnp.asarray(gen.random(shape) < 0.6)
    ours = lambda z, reduction: jk.softmax_cross_entropy(
        z, labels, axis=axis, where=mask, reduction=reduction, implementation=self.IMPL)
    theirs = lambda z: optax.softmax_cross_entropy_with_integer_labels(z, labels, axis=axis,
                                                                        where=mask)
    if where == "classes" and self.IMPL != "xla":  # XLA's path alone: a kernel named refuses
      with numerics.kernel_mode(), pytest.raises(ValueError, match=(
          f"implementation='{self.IMPL}' cannot serve this call: a where shaped like logits")):
        ours(logits, "none")
      return
    with numerics.kernel_mode(), numerics.served_by(self.IMPL, ["softmax_cross_entropy"]):
      got = jax.value_and_grad(lambda z: jnp.sum(ours(z, "none") ** 2))(logits)
      mean = ours(logits, "mean")
    want = jax.value_and_grad(lambda z: jnp.sum(theirs(z) ** 2))(logits)
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
    counted = np.ones(labels.shape, bool) if mask is None else np.asarray(
        mask if where == "tokens" else jnp.any(mask, axis=axes))
    chex.assert_trees_all_close(mean, jnp.sum(theirs(logits)) / counted.sum(), rtol=1e-5)

  def test_out_of_range_label_is_nan(self):
    _, logits, labels = _inputs((4,), self.RANGE_VOCAB, jnp.float32, "range", ignored=0.0)
    labels = labels.at[2].set(self.RANGE_VOCAB).at[3].set(-1)
    with numerics.kernel_mode():
      loss = jk.softmax_cross_entropy(logits, labels, reduction="none", implementation=self.IMPL)
    loss = np.asarray(loss)
    assert np.all(np.isfinite(loss[:2])) and np.all(np.isnan(loss[2:]))


class TestCrossEntropyXla(CrossEntropyTest):
  IMPL = "xla"

  @DRAWN
  @given(data=st.data())
  def test_drawn(self, data):
    self.check_drawn(data)


class TestCrossEntropyTriton(CrossEntropyTest):
  IMPL = "triton"

  @DRAWN
  @given(data=st.data())
  def test_drawn(self, data):
    self.check_drawn(data)

  @pytest.mark.parametrize("vocab,dtype", [(300, jnp.float32), (301, jnp.bfloat16)])
  def test_online_path(self, vocab, dtype):
    """Rows wider than a config's chunk: the online walk, unrolled, a partial row block, and
    (301: rows off a 16-byte vector boundary) the flat view with its head and tail."""
    _, logits, labels = _inputs((5,), vocab, dtype, "online")
    logits = logits.at[2, 64:].set(-jnp.inf)
    labels = labels.at[2].set(3)
    config = ce_triton.Config(block_rows=2, block_cols=64, num_warps=4, bwd_block_rows=2,
                              bwd_num_warps=4, unroll=2, bwd_unroll=3)
    self.check(logits, labels, dtype, "none", config, label_smoothing=0.1, z_loss=1e-3,
               ignore_index=IGNORE)

  @pytest.mark.parametrize("width", [50257, 128256])
  def test_lowers_for_cuda(self, width):
    z = jax.ShapeDtypeStruct((64, width), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((64,), jnp.int32)
    fn = lambda z, y: jax.grad(lambda z: jk.softmax_cross_entropy(
        z, y, z_loss=1e-4, label_smoothing=0.1, ignore_index=IGNORE,
        implementation=self.IMPL))(z)
    text = cuda_lowering(fn, z, labels)
    assert 'name = "jk_cross_entropy_fwd"' in text and 'name = "jk_cross_entropy_bwd"' in text


class TestCrossEntropyMosaicTpu(CrossEntropyTest):
  IMPL = "mosaic_tpu"
  DTYPES = (jnp.float32, jnp.bfloat16)  # no float16 on TPUs

  @DRAWN
  @given(data=st.data())
  def test_drawn(self, data):
    self.check_drawn(data)

  def test_vocabulary_blocks(self):
    """A vocabulary in blocks (the running statistics across grid steps), the last one
    partial, a partial row block."""
    _, logits, labels = _inputs((20,), 300, jnp.float32, "blocks")
    config = ce_mosaic_tpu.Config(block_rows=8, block_cols=128, vmem_limit_bytes=1 << 24)
    self.check(logits, labels, jnp.float32, "none", config, label_smoothing=0.1, z_loss=1e-3,
               ignore_index=IGNORE)

  def test_aot_compiles(self, tpu_mesh):
    z = jax.ShapeDtypeStruct((256, 32000), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((256,), jnp.int32)
    fn = lambda z, y: jax.grad(lambda z: jk.softmax_cross_entropy(
        z, y, z_loss=1e-4, implementation=self.IMPL))(z)
    text = aot_compile(tpu_mesh, fn, z, labels)
    assert "jk_cross_entropy_fwd" in text and "jk_cross_entropy_bwd" in text
    # Fused with the projection: the chunks' matmuls and row kernels in one compiled program.
    x, w = jax.ShapeDtypeStruct((2048, 256), jnp.bfloat16), jax.ShapeDtypeStruct((256, 32000),
                                                                                 jnp.bfloat16)
    linear = jax.grad(lambda x, w, y: jk.linear_softmax_cross_entropy(
        x, w, y, implementation=self.IMPL), argnums=(0, 1))
    text = aot_compile(tpu_mesh, linear, x, w, jax.ShapeDtypeStruct((2048,), jnp.int32))
    assert "jk_cross_entropy_fwd" in text and "jk_cross_entropy_bwd" in text


class TestCrossEntropyMosaicGpu(CrossEntropyTest):
  """Vocabularies of whole 128-element vectors (the widths the kernels take), interpreted with
  three CTAs (each a host thread): every CTA walks several rows, each row several tiles, the
  last one past the row where the tiles do not divide it (the bulk copy's zeros masked)."""

  IMPL = "mosaic_gpu"
  # The base tests' vocabularies (1, 30, 40, optax's 6-7) are not whole vectors: the kernels
  # refuse them by name (test_unsupported_vocabulary_names_why). The masked-rows and
  # out-of-range tests run at 256; the one-class and optax tests have no such width.
  MASKED_VOCAB = RANGE_VOCAB = 256
  test_one_class = test_optax_axis_and_where = None

  @pytest.fixture(autouse=True)
  def _three_ctas(self, monkeypatch):
    if not numerics.COMPILED:
      monkeypatch.setattr(_mosaic_gpu, "num_sms", lambda: 3)

  # 6144: three chunks of 2048, two a tile (the last tile half past the row); 1280: one chunk
  # of 1280 (two-element vectors); 768 in float16 beside.
  @pytest.mark.parametrize("shape,vocab,dtype,tile", [
      ((7,), 6144, jnp.bfloat16, 2), ((2, 3), 1280, jnp.float32, 1),
      ((5,), 768, jnp.float16, 1)], ids=["ragged-tiles", "two-element-vectors", "float16"])
  def test_rows(self, shape, vocab, dtype, tile):
    _, logits, labels = _inputs(shape, vocab, dtype, "mosaic_gpu")
    config = ce_mosaic_gpu.Config(tile=tile, stages=2, ctas_per_sm=1, bwd_tile=tile,
                                  bwd_stages=2, bwd_ctas_per_sm=1)
    self.check(logits, labels, dtype, "none", config, label_smoothing=0.1, z_loss=1e-3,
               ignore_index=IGNORE)

  def test_unsupported_vocabulary_names_why(self):
    z = jnp.ones((2, 50257), jnp.bfloat16)
    with numerics.kernel_mode():
      supported = jk.supports("softmax_cross_entropy", "mosaic_gpu", z, jnp.zeros(2, jnp.int32))
    assert not supported and "the logits' last dimension is 50257" in supported.reason

  @pytest.mark.parametrize("width", [32000, 128256])
  def test_lowers_for_cuda(self, width):
    """Llama 2's and Llama 3's vocabularies (two-element vectors; 128256's last tile past the
    row), every option, forward and backward through Mosaic GPU's passes; and the fused
    linear loss's rows."""
    z = jax.ShapeDtypeStruct((64, width), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((64,), jnp.int32)
    fn = lambda z, y: jax.value_and_grad(lambda z: jk.softmax_cross_entropy(
        z, y, z_loss=1e-4, label_smoothing=0.1, ignore_index=IGNORE,
        implementation=self.IMPL))(z)
    text = cuda_lowering(fn, z, labels)
    assert text.count("@mosaic_gpu_v2(") == 2 and _triton.CUSTOM_CALL not in text
    x, w = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16), jax.ShapeDtypeStruct((128, width),
                                                                               jnp.bfloat16)
    linear = jax.value_and_grad(lambda x, w, y: jk.linear_softmax_cross_entropy(
        x, w, y, implementation=self.IMPL), argnums=(0, 1))
    text = cuda_lowering(linear, x, w, jax.ShapeDtypeStruct((256,), jnp.int32))
    assert "jk_cross_entropy_fused_mgpu" in text and "jk_cross_entropy_bwd_mgpu" not in text


class TestLinearCrossEntropy:
  """x @ w's cross-entropy in chunks of tokens (a partial last chunk), against the reference
  that holds the whole logits: loss and both gradients, every reduction."""

  def check(self, impl, reduction, dtype=jnp.float32, chunk_size=16, config=None, vocab=257,
            **options):
    """A reduced loss is one number, and the rule's baseline for one number (the naive
    low-precision loss's error) is one draw of rounding luck: there the per-token losses
    (reduction "none", the same chunks' logits) are checked by the rule, the reduced loss must
    be their reduction to float32 rounding, and its gradients (the fused path's) are checked
    by the rule as the per-token losses' gradients for the cotangent the reduction spreads."""
    gen, _, labels = _inputs((3, 11), vocab, jnp.float32, "linear", reduction, ignored=0.2)
    x = numerics.normal(gen, (3, 11, 48), dtype)
    w = numerics.normal(gen, (48, vocab), dtype, 0.3)
    out_shape = labels.shape if reduction == "none" else ()
    ct = numerics.normal(gen, out_shape, jnp.float32)
    loss = lambda reduction: lambda x, w: jk.linear_softmax_cross_entropy(
        x, w, labels, reduction=reduction, chunk_size=chunk_size, implementation=impl,
        config=config, ignore_index=IGNORE, **options)
    with numerics.kernel_mode():
      out, vjp = jax.vjp(loss(reduction), x, w)
      grads = vjp(ct)
      per_token = loss("none")(x, w)
    chex.assert_shape(out, out_shape)
    chex.assert_trees_all_equal_dtypes(grads, (x, w))
    if reduction != "none":
      chex.assert_trees_all_close(out, _reduced(per_token, labels, reduction, IGNORE),
                                  rtol=8 * numerics.F32_EPS * 33 ** 0.5, atol=0)
      kept = labels != IGNORE
      spread = jnp.where(kept, 1.0 / (jnp.sum(kept) if reduction == "mean" else 1), 0.0)
      ct = ct * spread
    ref = lambda cd: lambda x, w: reference.linear_softmax_cross_entropy(
        x, w, labels, compute_dtype=cd, ignore_index=IGNORE, **options)[0]
    numerics.assert_matches((per_token, grads), ref, (x, w), ct, dtype=dtype, reduction=vocab)

  @pytest.mark.parametrize("reduction", api.REDUCTIONS)
  @pytest.mark.parametrize("impl", ["xla", "triton"])
  def test_matches_reference(self, impl, reduction):
    self.check(impl, reduction, label_smoothing=0.1, z_loss=1e-3)

  def test_bfloat16(self):
    self.check("triton", "mean", jnp.bfloat16)

  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
  def test_fused_online(self, dtype):
    """The loss and its gradient in one Triton launch (the gradient written over the logits),
    on the online walk: 257 columns off a vector boundary (the flat view), unrolled."""
    config = ce_triton.Config(block_rows=2, block_cols=64, num_warps=4, bwd_block_rows=2,
                              bwd_num_warps=4, unroll=2, bwd_unroll=3)
    self.check("triton", "sum", dtype, config=config, label_smoothing=0.1, z_loss=1e-3)

  @pytest.mark.parametrize("reduction", ["mean", "none"])
  def test_mosaic_gpu(self, reduction, monkeypatch):
    """On the Mosaic GPU rows (256 columns: whole vectors), three CTAs interpreted: reduced,
    the loss and its gradient in one launch that walks each row twice (tiles of one chunk, a
    row's two passes in one pipeline); per token, the forward and then the backward."""
    if not numerics.COMPILED:
      monkeypatch.setattr(_mosaic_gpu, "num_sms", lambda: 3)
    config = ce_mosaic_gpu.Config(tile=1, stages=3, ctas_per_sm=1, bwd_tile=1, bwd_stages=3,
                                  bwd_ctas_per_sm=1)
    self.check("mosaic_gpu", reduction, jnp.bfloat16, config=config, vocab=256,
               label_smoothing=0.1, z_loss=1e-3)

  def test_lowers_for_cuda(self):
    """Reduced, the loss and gradient of a chunk are one kernel."""
    x = jax.ShapeDtypeStruct((4096, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((256, 50257), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((4096,), jnp.int32)
    fn = jax.grad(lambda x, w, y: jk.linear_softmax_cross_entropy(
        x, w, y, implementation="triton"), argnums=(0, 1))
    text = cuda_lowering(fn, x, w, labels)
    assert 'name = "jk_cross_entropy_fused"' in text

  def test_memory_is_a_chunk(self):
    """The compiled loss-and-gradient holds a chunk's logits, not the whole (tokens, V) array:
    its temporaries under a quarter of the full logits' float32 bytes."""
    tokens, dim, vocab = 4096, 64, 8192
    x = jax.ShapeDtypeStruct((tokens, dim), jnp.float32)
    w = jax.ShapeDtypeStruct((dim, vocab), jnp.float32)
    labels = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    grad = lambda fn: jax.jit(jax.grad(fn, argnums=(0, 1))).lower(x, w, labels).compile()
    ours = grad(lambda x, w, y: jk.linear_softmax_cross_entropy(
        x, w, y, chunk_size=256, implementation="xla"))
    full = grad(lambda x, w, y: jnp.mean(
        reference.linear_softmax_cross_entropy(x, w, y)[0]))
    logits_bytes = tokens * vocab * 4
    ours_temp = ours.memory_analysis().temp_size_in_bytes
    assert ours_temp < logits_bytes / 4, (ours_temp, logits_bytes)
    assert full.memory_analysis().temp_size_in_bytes >= logits_bytes  # the check can fail


@pytest.mark.cpu_only
def test_supports_the_linear_loss():
  """supports() asks the fused loss's row kernels about a chunk's logits, validating the call
  as the op does (it once answered "unknown op")."""
  x = jnp.ones((300, 64), jnp.bfloat16)
  w = jnp.ones((64, 1000), jnp.bfloat16)
  labels = jnp.zeros((300,), jnp.int32)
  with jk.interpret_mode("triton"):
    assert jk.supports("linear_softmax_cross_entropy", "triton", x, w, labels)
  with numerics.kernel_mode():  # a chunk's logits (300, 1000): not whole 128-element vectors
    no = jk.supports("linear_softmax_cross_entropy", "mosaic_gpu", x, w, labels)
  assert not no and "the logits' last dimension is 1000" in no.reason
  with pytest.raises(ValueError, match=r"w must be \(D, V\) with D = x's last dimension 64"):
    jk.supports("linear_softmax_cross_entropy", "triton", x, w[:5], labels)


def test_sharded_rows():
  """Logits split over the batch on a mesh of 8 host devices: the row kernels run per shard,
  the per-token loss stays split, the mean is the whole batch's."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  _, logits, labels = _inputs((8, 4), 128, jnp.float32, "sharded")
  spec = P(("data", "model"), None)
  z = jax.device_put(logits, NamedSharding(mesh, P(*spec, None)))
  y = jax.device_put(labels, NamedSharding(mesh, spec))
  with jk.interpret_mode("triton"), warnings.catch_warnings():
    warnings.simplefilter("error", jk.ShardingWarning)
    loss = jax.jit(lambda z, y: jk.softmax_cross_entropy(
        z, y, reduction="none", ignore_index=IGNORE))(z, y)
    mean = jax.jit(lambda z, y: jk.softmax_cross_entropy(z, y, ignore_index=IGNORE))(z, y)
  assert loss.sharding.spec == spec
  want = reference.softmax_cross_entropy(logits, labels, ignore_index=IGNORE)[0]
  chex.assert_trees_all_close(loss, want, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(mean, _reduced(want, labels, "mean", IGNORE), atol=1e-5)


@pytest.mark.cpu_only
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_sharded_linear(reduction):
  """The fused loss with x and the labels split over the batch (w replicated): each shard runs
  its tokens, the mean is the whole batch's, and dw sums the shards' (the same numbers as on
  one device)."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  gen, _, labels = _inputs((8, 4), 40, jnp.float32, "sharded linear")
  x, w = numerics.normal(gen, (8, 4, 16), jnp.float32), numerics.normal(gen, (16, 40), jnp.float32)
  spec = P(("data", "model"), None)
  fn = lambda x, w, y: jnp.sum(jk.linear_softmax_cross_entropy(
      x, w, y, reduction=reduction, ignore_index=IGNORE, chunk_size=8))
  want = jax.value_and_grad(fn, argnums=(0, 1))(x, w, labels)  # one device, XLA's path
  with numerics.kernel_mode("triton"), numerics.served_by("triton"):
    got = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(
        jax.device_put(x, NamedSharding(mesh, P(*spec, None))),
        jax.device_put(w, NamedSharding(mesh, P())),
        jax.device_put(labels, NamedSharding(mesh, spec)))
  assert got[1][0].sharding.spec[0] == ("data", "model")  # dx stays split as x was
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)


class TestCrossEntropyErrors:
  Z = jnp.zeros((2, 5))
  Y = jnp.zeros((2,), jnp.int32)

  @pytest.mark.parametrize("kwargs,error,match", [
      (dict(labels=jnp.zeros((2,))), TypeError, "labels must have an integer dtype"),
      (dict(labels=jnp.zeros((3,), jnp.int32)), ValueError,
       r"labels must have the shape of logits without its last axis, \(2,\)"),
      (dict(label_smoothing=1.0), ValueError, r"label_smoothing must be a float in \[0, 1\)"),
      (dict(z_loss=-1.0), ValueError, "z_loss must be a finite float >= 0"),
      (dict(ignore_index=1.5), ValueError, "ignore_index must be None or a Python int"),
      (dict(reduction="avg"), ValueError, r"reduction='avg' is not one of \('mean'"),
      (dict(logits=jnp.zeros((2, 0))), ValueError, "logits must have at least one class"),
      (dict(axis=1.0), TypeError, r"axis must be an int or a tuple of ints, got 1.0"),
      (dict(axis=2), ValueError, r"axis 2 is out of range for logits of rank 2"),
      (dict(axis=(1, -1)), ValueError, r"axis \(1, -1\) repeats an axis"),
      (dict(where=jnp.ones((2,))), TypeError, "where must be a boolean array, got float32"),
      (dict(where=jnp.ones((5,), bool)), ValueError,
       r"where must be shaped like labels \(2,\) or like logits \(2, 5\), got \(5,\)"),
      (dict(where=jnp.ones((2, 5), bool), label_smoothing=0.1), ValueError,
       "a where shaped like logits .* takes no label_smoothing"),
  ])
  def test_softmax_cross_entropy(self, kwargs, error, match):
    args = dict(logits=self.Z, labels=self.Y)
    args.update(kwargs)
    with pytest.raises(error, match=match):
      jk.softmax_cross_entropy(args.pop("logits"), args.pop("labels"), **args)

  def test_linear(self):
    x, y = jnp.zeros((2, 4)), self.Y
    with pytest.raises(ValueError, match=r"w must be \(D, V\) with D = x's last dimension 4"):
      jk.linear_softmax_cross_entropy(x, jnp.zeros((3, 5)), y)
    with pytest.raises(ValueError, match="chunk_size must be None or an int >= 1, got 0"):
      jk.linear_softmax_cross_entropy(x, jnp.zeros((4, 5)), y, chunk_size=0)
    with pytest.raises(ValueError, match=r"labels must have the shape of x without its last"):
      jk.linear_softmax_cross_entropy(x, jnp.zeros((4, 5)), jnp.zeros((3,), jnp.int32))
