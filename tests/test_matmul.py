"""matmul: every backend against the float64 oracle (forward and gradients), dispatch, errors,
TPU AOT compiles, CUDA lowering, and the tuning cache."""

from __future__ import annotations

import dataclasses
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkernels as jk
from jaxkernels import _activations, _mosaic_gpu, hardware
from jaxkernels.ops.matmul import api as matmul_api
from jaxkernels.ops.matmul import mosaic_gpu, mosaic_tpu, triton
from jaxkernels.ops.matmul import reference as matmul_reference
from jaxkernels.ops.matmul.common import Problem
from bench import shapes
from tests import cases, numerics
from tests.conftest import aot_compile, cuda_lowering

EPILOGUES = (  # (activation, bias, residual)
    (None, False, False), ("gelu", True, True), ("gelu_tanh", True, False),
    ("silu", False, True), ("relu", True, True))


def reference(activation, has_bias, has_residual):
  """The spec computed in ``compute_dtype`` throughout (float64: the oracle; the input dtype:
  the naive baseline whose error sets the tolerance)."""
  def make(cd):
    def fn(a, b, *rest):
      rest = list(rest)
      bias = rest.pop(0) if has_bias else None
      residual = rest.pop(0) if has_residual else None
      return matmul_reference.in_dtype(cd, a, b, bias=bias, residual=residual,
                                       activation=activation)
    return fn
  return make


def inputs(shape, dtype, has_bias, has_residual, *labels):
  """a (..., M, K), b (K, N) scaled so that a @ b ~ N(0, 1): activations stay where their
  accuracy is documented."""
  *lead, m, n, k = shape
  gen = numerics.rng("matmul", shape, jnp.dtype(dtype).name, has_bias, has_residual, *labels)
  s = k ** -0.25
  primals = [numerics.normal(gen, (*lead, m, k), dtype, s), numerics.normal(gen, (k, n), dtype, s)]
  if has_bias:
    primals.append(numerics.normal(gen, (n,), dtype, 0.5))
  if has_residual:
    primals.append(numerics.normal(gen, (*lead, m, n), dtype))
  return primals, numerics.normal(gen, (*lead, m, n), dtype)


class MatmulTest:
  IMPL = "xla"
  CONFIG = None  # small tiles, so that edges, K tails and many programs are all exercised

  def op(self, activation, has_bias, has_residual, config=None):
    def fn(a, b, *rest):
      rest = list(rest)
      bias = rest.pop(0) if has_bias else None
      residual = rest.pop(0) if has_residual else None
      return jk.matmul(a, b, bias=bias, residual=residual, activation=activation,
                       implementation=self.IMPL, config=config or self.CONFIG)
    return fn

  def check(self, shape, dtype, epilogue, grads=True):
    activation, has_bias, has_residual = epilogue
    primals, ct = inputs(shape, dtype, has_bias, has_residual, activation)
    cases.check("matmul", self.IMPL, self.op(activation, has_bias, has_residual),
                reference(activation, has_bias, has_residual), primals, ct, dtype=dtype,
                reduction=max(math.prod(shape[:-2]), shape[-1]),
                pointwise_rtol=_activations.RTOL, support=(primals[:2], {}), grads=grads)

  # M, N, K: one odd size each, none a multiple of any block; a batched a; K < one block. Each
  # with every epilogue compiled; interpreted, a cross through the first shape and gelu + bias +
  # residual (numerics.grid).
  @pytest.mark.parametrize("shape,epilogue", numerics.grid(
      shapes.MATMUL_ODD, EPILOGUES, center=(shapes.MATMUL_ODD[0], EPILOGUES[1])))
  def test_float32(self, shape, epilogue):
    self.check(shape, jnp.float32, epilogue)

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  @pytest.mark.parametrize("epilogue", EPILOGUES[:2], ids=lambda e: "-".join(map(str, e)))
  def test_low_precision(self, dtype, epilogue):
    self.check((3, 33, 140, 72), dtype, epilogue)

  def test_out_dtype(self):
    primals, _ = inputs((40, 50, 60), jnp.bfloat16, False, False)
    with numerics.kernel_mode():
      numerics.must_serve(jk.supports("matmul", self.IMPL, *primals, out_dtype=jnp.float32))
      y = jk.matmul(*primals, out_dtype=jnp.float32, implementation=self.IMPL,
                    config=self.CONFIG)
    assert y.dtype == jnp.float32
    want = np.asarray(primals[0], np.float64) @ np.asarray(primals[1], np.float64)
    # bf16 operands are exact in float32 products; only the float32 sums round.
    np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=1e-5 * np.abs(want).max())


class TestXla(MatmulTest):
  IMPL = "xla"


class TestTriton(MatmulTest):
  IMPL = "triton"
  CONFIG = triton.Config(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4,
                         num_stages=2)

  def test_heuristic_config(self):
    self.check((70, 300, 200), jnp.float32, EPILOGUES[1])


class TestMosaicTpu(MatmulTest):
  IMPL = "mosaic_tpu"
  # block_m 16 (bf16 sublanes), 128-lane blocks: N and K tails are partial blocks.
  CONFIG = mosaic_tpu.Config(block_m=16, block_n=128, block_k=128)

  @pytest.mark.parametrize("shape", [(40, 200, 300)])
  @pytest.mark.parametrize("epilogue", EPILOGUES[:2], ids=lambda e: "-".join(map(str, e)))
  def test_float32(self, shape, epilogue):
    self.check(shape, jnp.float32, epilogue)

  @pytest.mark.parametrize("dtype", [jnp.bfloat16])
  @pytest.mark.parametrize("epilogue", EPILOGUES[1:2], ids=lambda e: "-".join(map(str, e)))
  def test_low_precision(self, dtype, epilogue):
    self.check((2, 24, 260, 130), dtype, epilogue)

  def test_int8_scaled(self):
    gen = numerics.rng("int8")
    a = jnp.asarray(gen.integers(-127, 128, (40, 300)), jnp.int8)
    b = jnp.asarray(gen.integers(-127, 128, (300, 200)), jnp.int8)
    a_scale = jnp.asarray(gen.uniform(0.5, 2, 40), jnp.float32) / 127
    b_scale = jnp.asarray(gen.uniform(0.5, 2, 200), jnp.float32) / 127
    bias = numerics.normal(gen, (200,), jnp.float32)
    with numerics.kernel_mode():
      y = jk.matmul(a, b, a_scale=a_scale, b_scale=b_scale, bias=bias, activation="silu",
                    out_dtype=jnp.float32, implementation="mosaic_tpu",
                    # int8 packs 32 rows a sublane tile: blocks of M come in 32s
                    config=dataclasses.replace(self.CONFIG, block_m=32))
    acc = np.asarray(a, np.int64) @ np.asarray(b, np.int64)  # exact in int32 as well
    z = acc * np.asarray(a_scale, np.float64)[:, None] * np.asarray(b_scale, np.float64) + \
        np.asarray(bias, np.float64)
    want = z / (1 + np.exp(-z))
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


class TestMosaicGpu(MatmulTest):
  """The Mosaic GPU interpreter runs the real kernel (warpgroups, barriers, TMA, wgmma) on the
  CPU, but not TMA's out-of-bounds handling: these shapes keep M, N, K within whole CTA tiles
  after the wrapper's padding, and fp8 hangs it (jax 0.10.2). Odd shapes and fp8 are checked
  on the GPU machine (`python -m bench matmul --only checks`, results in results/), and
  lowered for CUDA below."""

  IMPL = "mosaic_gpu"
  CONFIG = mosaic_gpu.Config(tile_m=64, tile_n=64, tile_k=64, stages=2)

  @pytest.mark.parametrize("shape", [(64, 128, 128)])
  @pytest.mark.parametrize("epilogue", EPILOGUES[1:2], ids=lambda e: "-".join(map(str, e)))
  def test_float32(self, shape, epilogue):
    pytest.skip("mosaic_gpu serves 16-bit and fp8 operands; float32 goes to triton")

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  @pytest.mark.parametrize("epilogue", EPILOGUES[:2], ids=lambda e: "-".join(map(str, e)))
  def test_low_precision(self, dtype, epilogue):
    self.check((64, 128, 128), dtype, epilogue, grads=False)

  @pytest.mark.parametrize("epilogue", EPILOGUES[2:], ids=lambda e: "-".join(map(str, e)))
  def test_epilogues(self, epilogue):
    self.check((128, 128, 64), jnp.bfloat16, epilogue, grads=False)

  def test_out_dtype(self):
    pytest.skip("covered by test_low_precision's bfloat16 output; the interpreter is slow")

  # The GPU check's odd shapes (bench matmul --only checks), one of them batched.
  @pytest.mark.parametrize("shape", [shapes.MATMUL_CHECKS[0], (2, *shapes.MATMUL_CHECKS[1]),
                                     shapes.MATMUL_CHECKS[2]])
  @pytest.mark.parametrize("epilogue", EPILOGUES, ids=lambda e: "-".join(map(str, e)))
  def test_odd_shapes(self, shape, epilogue):
    """Ragged M, N and K (TMA zero-fills and clips; C's past-the-end pieces skipped), every
    epilogue, and the gradients: the backward's two products read A and B transposed in place.
    Compiled only: the interpreter has no TMA edge handling and no TransposeTransform."""
    if not numerics.COMPILED:
      pytest.skip("ragged edges and transposes: compiled only (JAXKERNELS_TEST_COMPILED)")
    self.check(shape, jnp.bfloat16, epilogue)

  SCHEDULE_SHAPES = None  # CTA tiles test_cta_shapes takes (None: all of them)

  @pytest.mark.parametrize("shape", mosaic_gpu.CTA_SHAPES, ids=lambda s: "x".join(map(str, s)))
  def test_cta_shapes(self, shape, monkeypatch):
    """Each CTA tile the heuristic may choose, 2 x 2 tiles of it on two SMs, bias + residual,
    in this class's schedule (ping-pong: the warpgroup tile, one per split)."""
    tile_m, tile_n, split = shape
    if not (numerics.COMPILED or numerics.SLOW) and shape not in INTERPRETED_CTA_SHAPES:
      pytest.skip("interpreted (~10 s a tile), a square, a wide and a split tile; every tile "
                  "compiled in the GPU check; JAXKERNELS_TEST_SLOW=1 runs it here")
    if self.SCHEDULE_SHAPES is not None and shape not in self.SCHEDULE_SHAPES:
      pytest.skip("the cooperative schedule's class takes every tile; this one a square and "
                  "a wide one (the suite's time)")
    if not self.CONFIG.cooperative and split == "m":
      pytest.skip("ping-pong tiles do not split: the 'n' case covers this tile")
    config = dataclasses.replace(self.CONFIG, tile_m=tile_m, tile_n=tile_n, tile_k=64,
                                 split=split)
    shape = (2 * config.cta_m, 2 * config.cta_n, 128)
    p = Problem(*shape, dtype=jnp.dtype(jnp.bfloat16), out_dtype=jnp.dtype(jnp.bfloat16),
                activation="relu", has_bias=True, has_residual=True)  # EPILOGUES[-1]
    if mosaic_gpu.config_error(p, config, None):  # 128 x 384 takes 2 stages here
      config = dataclasses.replace(config, stages=2)
    monkeypatch.setattr(_mosaic_gpu, "num_sms", lambda: 2)
    monkeypatch.setattr(self, "CONFIG", config)
    self.check(shape, jnp.bfloat16, EPILOGUES[-1], grads=False)


# The CTA tiles CI interprets (the GPU check compiles every one).
INTERPRETED_CTA_SHAPES = ((64, 64, "n"), (128, 192, "n"), (128, 192, "m"))


class TestMosaicGpuPingpong(TestMosaicGpu):
  """The ping-pong schedule, on two SMs so that every CTA walks several tiles, handed to its
  two compute warpgroups in turn, through a ring whose slots wrap around mid-tile (K steps
  not a multiple of ``stages``); the interpreter also fails a kernel that leaves a barrier
  phase unobserved. Transposed operands (the backward's products) fail in the interpreter
  for both schedules (jax 0.10.2: no TransposeTransform); they are checked on the GPU
  machine (`python -m bench matmul --only schedules`)."""

  CONFIG = mosaic_gpu.Config(tile_m=64, tile_n=64, tile_k=64, stages=3, schedule="pingpong")
  SCHEDULE_SHAPES = ((64, 64, "n"), (128, 192, "n"), (128, 192, "m"))

  @pytest.fixture(autouse=True)
  def _two_sms(self, monkeypatch):
    monkeypatch.setattr(_mosaic_gpu, "num_sms", lambda: 2)

  def test_several_tiles(self):
    """4 or 8 tiles a CTA, 5 K steps each over 3 slots: the ring wraps mid-tile and runs on
    from one tile into the next; bias+gelu+residual through the epilogue's per-parity
    vectors and buffers."""
    self.check((256, 256, 320), jnp.bfloat16, EPILOGUES[1], grads=False)


class TestMosaicGpuRing(TestMosaicGpuPingpong):
  """The cooperative schedule on the kernel's own ring (``ring=True``): both compute
  warpgroups read every slot, each keeping one K step's wgmma in flight, and the ring runs on
  across tiles and wraps mid-tile."""

  CONFIG = mosaic_gpu.Config(tile_m=64, tile_n=64, tile_k=64, stages=3, ring=True)


# --------------------------------------------------------------------------- #
# matmul(glu=True): the gated product
# --------------------------------------------------------------------------- #


def glu_reference(activation, has_bias, has_residual):
  """y = activation(z[..., :N]) * z[..., N:] + residual, z = a @ b + bias, in compute_dtype."""
  def make(cd):
    def fn(a, b, *rest):
      rest = list(rest)
      bias = rest.pop(0) if has_bias else None
      residual = rest.pop(0) if has_residual else None
      return matmul_reference.in_dtype(cd, a, b, bias=bias, residual=residual,
                                       activation=activation, glu=True)
    return fn
  return make


def glu_inputs(shape, dtype, has_bias, has_residual, *labels):
  """a (..., M, K), b (K, 2N) [gate | up], as ``inputs`` scales them; the cotangent (..., M, N)."""
  *lead, m, n, k = shape
  primals, _ = inputs((*lead, m, 2 * n, k), dtype, has_bias, False, "glu", *labels)
  gen = numerics.rng("matmul-glu", shape, jnp.dtype(dtype).name, *labels)
  if has_residual:
    primals.append(numerics.normal(gen, (*lead, m, n), dtype))
  return primals, numerics.normal(gen, (*lead, m, n), dtype)


def _glu_check(shape, dtype, case, *, implementation, config=None, grads=True,
               composed=False):
  """``composed``: the product is written in ``dtype`` and glu reads it back (where no kernel
  fuses the gate). Then one element of y carries three roundings at unit gain (its gate's and
  its up's in z, and its own: 3 u), which a max-norm over a few hundred elements can show
  whole where the naive baseline's largest element was lucky (an H200 drew 1.8 u against a
  baseline's 0.85 u): that is the per-element bound, not twice the baseline's."""
  activation, has_bias, has_residual = case
  pointwise_rtol = _activations.RTOL
  if composed:
    pointwise_rtol = max(pointwise_rtol, 3 * float(jnp.finfo(dtype).eps) / 2)
  primals, ct = glu_inputs(shape, dtype, has_bias, has_residual, activation, implementation)

  def fn(a, b, *rest):
    rest = list(rest)
    return jk.matmul(a, b, bias=rest.pop(0) if has_bias else None,
                     residual=rest.pop(0) if has_residual else None, activation=activation,
                     glu=True, implementation=implementation, config=config)

  cases.check("matmul", implementation, fn, glu_reference(*case), primals, ct, dtype=dtype,
              reduction=max(math.prod(shape[:-2]), shape[-1]), pointwise_rtol=pointwise_rtol,
              support=(primals[:2], {}), grads=grads)


def _no_composition(monkeypatch):
  """Makes the composed path (the product, then ``glu``) fail: the gated kernel must serve."""
  def composed(*args, **kwargs):
    raise AssertionError("matmul(glu=True) composed the product and glu; the kernel should fuse")
  monkeypatch.setattr(matmul_api, "_gate", composed)


GLU_CASES = (("silu", False, False), ("gelu", True, True), ("gelu_tanh", False, True))


@pytest.mark.parametrize("implementation", ["xla", "triton", "mosaic_tpu"])
@pytest.mark.parametrize("case", GLU_CASES, ids=lambda e: "-".join(map(str, e)))
def test_glu_composed(implementation, case):
  """Where no kernel fuses the gate, the product and then glu (on the same implementation),
  forward and gradients, batched a, odd sizes, bias over [gate | up], residual after. XLA's
  path composes too (the product written in bfloat16, then glu's reference): the same three
  roundings (seed 1071158654 drew 2.5 u on one element, over twice the naive baseline's
  1.2 u, within the 3 u bound)."""
  _glu_check((2, 19, 24, 70), jnp.bfloat16, case, implementation=implementation,
             composed=True)


@pytest.mark.parametrize("config", [
    mosaic_gpu.Config(tile_m=64, tile_n=128, tile_k=64, stages=3, ring=True, split="n"),
    mosaic_gpu.Config(tile_m=64, tile_n=128, tile_k=64, stages=3, ring=True, split="m"),
    mosaic_gpu.Config(tile_m=64, tile_n=128, tile_k=64, stages=2, schedule="pingpong")],
    ids=["ring-n", "ring-m", "pingpong"])
def test_glu_fused_mosaic_gpu(config, monkeypatch):
  """One Mosaic GPU kernel: each warpgroup multiplies A by the gate's and the up's blocks into
  two accumulators and writes y from them, on two SMs (several tiles a CTA, the ring wrapping
  mid-tile: 5 K steps). Forward only in the interpreter (the backward's transposed products
  do not interpret); gradients compiled."""
  monkeypatch.setattr(_mosaic_gpu, "num_sms", lambda: 2)
  _no_composition(monkeypatch)
  _glu_check((256, 256, 320), jnp.bfloat16, GLU_CASES[0], implementation="mosaic_gpu",
             config=config, grads=numerics.COMPILED)


@pytest.mark.parametrize("shape", [(1000, 192, 520), (2, 300, 128, 64)])
def test_glu_fused_odd_rows(shape, monkeypatch):
  """Ragged M (the last row tiles clipped), the heuristic's config, forward and gradients:
  compiled only (TMA edges and the backward's transposes)."""
  if not numerics.COMPILED:
    pytest.skip("ragged edges and transposes: compiled only (JAXKERNELS_TEST_COMPILED)")
  _no_composition(monkeypatch)
  _glu_check(shape, jnp.bfloat16, GLU_CASES[0], implementation="mosaic_gpu")


def test_glu_dispatch_and_errors():
  """What fuses, what composes, and what is refused, with the reason named."""
  chip = hardware.chip_for("NVIDIA H100 80GB HBM3")
  bf = jnp.dtype(jnp.bfloat16)
  p = Problem(m=16384, n=2 * 2816, k=1024, dtype=bf, out_dtype=bf, activation="silu", glu=True)
  config = mosaic_gpu.heuristic(p, chip)
  assert config.on_ring and mosaic_gpu.config_error(p, config, chip) is None
  assert p.out_n % (config.cta_n // 2) == 0
  assert "glu" in p.key() and "glu" not in dataclasses.replace(p, glu=False).key()
  assert "glu runs on the kernel's own ring" in mosaic_gpu.config_error(
      p, mosaic_gpu.Config(stages=2), chip)
  narrow = mosaic_gpu.Config(tile_m=64, tile_n=64, ring=True)
  assert "halves of 32, which must be a multiple of the 64-element" in \
      mosaic_gpu.config_error(p, narrow, chip)
  wide = mosaic_gpu.Config(tile_m=64, tile_n=256, ring=True, stages=2)
  ragged = dataclasses.replace(p, n=2 * 2880)
  assert "y's 2880 columns in whole CTA tiles of 256" in mosaic_gpu.config_error(ragged, wide,
                                                                                  chip)
  assert "plain 16-bit product" in mosaic_gpu.unsupported(dataclasses.replace(p, has_bias=True),
                                                          chip)
  assert "multiple of 64" in mosaic_gpu.unsupported(dataclasses.replace(p, n=2 * 100), chip)
  assert "does not fuse glu" in triton.unsupported(p, chip)
  assert "does not fuse glu" in mosaic_tpu.unsupported(p, chip)
  a, b = jnp.zeros((4, 8), jnp.bfloat16), jnp.zeros((8, 15), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"glu=True takes b as \[gate \| up\].*must be even, "
                     r"got b shape \(8, 15\)"):
    jk.matmul(a, b, activation="silu", glu=True)
  with pytest.raises(ValueError, match="glu=True gates the up half with activation"):
    jk.matmul(a, B, glu=True)
  with pytest.raises(ValueError, match=r"residual must have the shape .*\(4, 8\)"):
    jk.matmul(a, B, activation="silu", glu=True, residual=jnp.zeros((4, 16), jnp.bfloat16))
  # A config the gated kernel cannot take is named at the dispatch.
  with pytest.raises(ValueError, match="glu runs on the kernel's own ring"):
    jax.eval_shape(lambda a, b: jk.matmul(a, b, activation="silu", glu=True,
                                          implementation="mosaic_gpu",
                                          config=mosaic_gpu.Config(stages=2)),
                   jax.ShapeDtypeStruct((256, 64), jnp.bfloat16),
                   jax.ShapeDtypeStruct((64, 256), jnp.bfloat16))


def test_glu_cuda_lowering():
  """The gated kernel through Mosaic GPU's compiler passes at the 350m model's MLP shape
  (forward and gradients: one fused kernel, glu's backward, two products), and on ragged rows
  with 64-column y tiles."""
  bf = jnp.bfloat16
  a, b = jax.ShapeDtypeStruct((16384, 1024), bf), jax.ShapeDtypeStruct((1024, 5632), bf)

  def grads(a, b):
    loss = lambda a, b: jnp.sum(jk.matmul(a, b, activation="silu", glu=True,
                                          implementation="mosaic_gpu").astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1))(a, b)

  text = cuda_lowering(grads, a, b)
  assert text.count("mosaic_gpu") >= 3 and "jk_glu" in text
  text = cuda_lowering(lambda a, b: jk.matmul(a, b, activation="gelu", glu=True,
                                              implementation="mosaic_gpu"),
                       jax.ShapeDtypeStruct((1000, 520), bf), jax.ShapeDtypeStruct((520, 384), bf))
  assert "mosaic_gpu" in text and "jk_glu" not in text


@pytest.mark.parametrize("shape,padded", [((33, 1025), (40, 1100)), ((17, 513), (17, 520)),
                                          ((1, 1), (8, 64)), ((40, 1100), (40, 1100))])
def test_crop(shape, padded):
  """The copy that cuts Mosaic GPU's padded C, odd rows and columns included, bit-exact."""
  gen = np.random.default_rng(3)
  y = numerics.normal(gen, padded, jnp.bfloat16)
  got = mosaic_gpu.crop(y, *shape, interpret=True)
  assert got.shape == shape
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(y[:shape[0], :shape[1]], np.float32))
  too_many = (padded[0] + 1, 1)
  with pytest.raises(ValueError, match=re.escape(f"at least {too_many}, got shape {padded}")):
    mosaic_gpu.crop(y, *too_many)


def test_mosaic_gpu_wave_model():
  """The heuristic leaves 128 x 256 tiles where they fill their waves and takes fuller waves
  where they do not (3072^3: 2.2 waves of 128 x 256 against 2.9 of 128 x 192)."""
  chip = hardware.chip_for("NVIDIA H200")
  bf = jnp.dtype(jnp.bfloat16)
  problem = lambda m, n, k: Problem(m=m, n=n, k=k, dtype=bf, out_dtype=bf)
  cta = lambda p: (lambda c: (c.cta_m, c.cta_n))(mosaic_gpu.heuristic(p, chip))
  assert cta(problem(8192, 8192, 8192)) == cta(problem(4096, 4096, 4096)) == (128, 256)
  assert cta(problem(3072, 3072, 3072)) == cta(problem(1536, 1536, 1536)) == (128, 192)
  assert cta(problem(1024, 1024, 1024)) == (64, 128)  # 128 tiles: the most SMs at work
  # 6528^3: 128 x 256 tiles make 10.05 waves, 256 x 192 ones 6.7.
  assert cta(problem(6528, 6528, 6528)) == (256, 192)
  # 4224 x 640: 128 x 256 tiles make 33 x 3 = 99 (0.75 waves); 256 x 128 ones 17 x 5 = 85.
  tall = problem(4224, 640, 4096)
  chosen = mosaic_gpu.heuristic(tall, chip)
  for tile_m, tile_n, split in mosaic_gpu.CTA_SHAPES:
    other = mosaic_gpu.Config(tile_m=tile_m, tile_n=tile_n, split=split)
    assert mosaic_gpu.predicted_seconds(tall, chosen, 132) <= \
        mosaic_gpu.predicted_seconds(tall, other, 132) / (1 - mosaic_gpu.WAVE_MARGIN)


def _lowered(p: Problem, config) -> str:
  """Mosaic GPU's kernel for ``p`` lowered for CUDA: bias and residual with a 16-bit problem,
  a_scale and b_scale with an fp8 one (the shapes' ragged edges included)."""
  fp8 = p.has_scales
  m, n, k = p.m, p.n, p.k

  def fn(a, b, v, r, s):
    return mosaic_gpu.matmul(a, b, bias=None if fp8 else v, residual=None if fp8 else r,
                             a_scale=s if fp8 else None, b_scale=v if fp8 else None,
                             problem=p, config=config)
  return cuda_lowering(fn, jax.ShapeDtypeStruct((m, k), p.dtype),
                       jax.ShapeDtypeStruct((k, n), p.dtype),
                       jax.ShapeDtypeStruct((n,), jnp.float32),
                       jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
                       jax.ShapeDtypeStruct((m,), jnp.float32))


@pytest.mark.parametrize("shape", mosaic_gpu.CTA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_mosaic_gpu_cta_shapes_lower(shape):
  """Each CTA tile the heuristic may choose through Mosaic GPU's compiler passes (which the
  interpreter skips), on a ragged shape: bf16 with gelu + bias + residual, and fp8 with
  scales (128-deep K steps)."""
  tile_m, tile_n, split = shape
  m, n, k = 1000, 1030, 520
  for dtype, act in ((jnp.bfloat16, "gelu"), (jnp.float8_e4m3fn, None)):
    fp8 = act is None
    p = Problem(m=m, n=n, k=k, dtype=jnp.dtype(dtype), out_dtype=jnp.dtype(jnp.bfloat16),
                activation=act, has_bias=not fp8, has_residual=not fp8, has_scales=fp8)
    chip = hardware.chip_for("NVIDIA H200")
    config = mosaic_gpu.fitted(p, mosaic_gpu.tile_config(p, shape), chip)
    assert (config.tile_m, config.tile_n, config.split, config.tile_k) == (*shape, 64 + 64 * fp8)
    assert mosaic_gpu.config_error(p, config, chip) is None

    assert "mosaic_gpu" in _lowered(p, config)


@pytest.mark.parametrize("tiles,k_steps,ctas", [(3, 5, 2), (7, 4, 3), (1, 17, 132), (435, 58, 132),
                                                  (5, 1, 4), (800, 80, 132)])
@pytest.mark.parametrize("wave", [True, False])
def test_stream_k_plan(tiles, k_steps, ctas, wave):
  """Stream-K's runs (``StreamK``) cover every K step of the cut tiles once; each tile's
  first step lies in its owner's run, and the runs after the owner's that hold its other steps
  are exactly ``cta + 1 .. last_run(tile)``, each beginning there (so each CTA hands over at
  most one partial, first thing). Whole tiles fill whole waves, one wave fewer than there are
  when tiles are left over (``stream_k_wave``), or all of them."""
  k = k_steps
  problem = Problem(m=tiles * 64, n=64, k=k * 64, dtype=jnp.dtype(jnp.bfloat16),
                    out_dtype=jnp.dtype(jnp.bfloat16))
  config = mosaic_gpu.Config(tile_m=64, tile_n=64, tile_k=64, split="m", stream_k=True,
                             stream_k_wave=wave)
  plan = mosaic_gpu.StreamK.plan(problem, config, ctas)
  assert config.cta_m == 128 and plan.whole + plan.cut == math.ceil(tiles / 2)
  tiles = plan.whole + plan.cut
  assert plan.whole % ctas == 0
  assert plan.whole == (tiles if tiles % ctas == 0 else max(tiles // ctas - wave, 0) * ctas)
  start = [int(plan.start(r)) for r in range(ctas + 1)]
  owner_of, covered = {}, []
  for r in range(ctas):
    for step in range(start[r], start[r + 1]):
      covered.append(step)
      tile, k_step = divmod(step, k)
      if k_step == 0:
        owner_of[tile] = r
      else:  # a run that does not begin the tile holds its steps only where the run begins
        assert step == start[r] or (step - 1) // k == tile
  assert covered == list(range(plan.steps))
  for tile, owner in owner_of.items():
    helpers = [r for r in range(ctas) if r != owner and
               any(tile * k <= s < (tile + 1) * k for s in range(start[r], start[r + 1]))]
    assert helpers == list(range(owner + 1, int(plan.last_run(tile)) + 1))
    assert all(tile * k < start[r] < (tile + 1) * k for r in helpers)


def test_stream_k_heuristic_and_lowering(monkeypatch):
  """The heuristic cuts the last wave where it stays part-empty after whole waves and the
  model, with cut tiles slower the larger the operands, predicts a gain: 3712^3 (3.3 waves of
  128 x 256 tiles) and 5120^3 (6.06), not 4096^3 (3.9) or 8192^3 (15.5), nor below two waves
  (1536^3, where the hand-over ran 50% slower). Stream-K then lowers for CUDA on a ragged
  shape with gelu + bias + residual and for fp8 with scales. The interpreter has no
  semaphores (jax 0.10.2), so its numerics are checked on the GPU machine (`python -m bench
  matmul --only streamk`: 49 checks, results/)."""
  chip = hardware.chip_for("NVIDIA H200")
  bf = jnp.dtype(jnp.bfloat16)
  pick = lambda s: mosaic_gpu.heuristic(Problem(m=s, n=s, k=s, dtype=bf, out_dtype=bf), chip)
  assert pick(3712).stream_k and pick(5120).stream_k
  assert not any(pick(s).stream_k for s in (4096, 8192, 1536, 6144))
  assert (pick(5120).epi_tile_m, pick(5120).stages) == (64, 4)  # whole-tile pieces: ring-slow
  with pytest.raises(ValueError, match="stream_k=True needs the cooperative schedule"):
    mosaic_gpu.Config(schedule="pingpong", stream_k=True)
  monkeypatch.setattr(_mosaic_gpu, "num_sms", lambda: 132)
  m, n, k = 1000, 1030, 520  # 4 x 6 CTA tiles of 256 x 192, 9 K steps each: 132 runs of 1-2
  for dtype, act in ((jnp.bfloat16, "gelu"), (jnp.float8_e4m3fn, None)):
    fp8 = act is None
    p = Problem(m=m, n=n, k=k, dtype=jnp.dtype(dtype), out_dtype=bf, activation=act,
                has_bias=not fp8, has_residual=not fp8, has_scales=fp8)
    config = mosaic_gpu.fitted(p, dataclasses.replace(
        mosaic_gpu.tile_config(p, (128, 192, "m")), stream_k=True), chip)

    assert "mosaic_gpu" in _lowered(p, config)


@pytest.mark.parametrize("m,k,n", [(192, 320, 128), (300, 1000, 260)])
def test_stream_k(monkeypatch, m, k, n):
  """Stream-K on two SMs: runs that end one tile and begin the next, owners adding partials.
  Under the interpreter, which has no semaphores, a stream-K config walks the same tiles whole
  on the same ring: the product is still right either way (bf16 output: within its rounding).
  Ragged edges (the second shape) only compiled: the interpreter has no TMA edge handling."""
  if (m, k, n) != (192, 320, 128) and not numerics.COMPILED:
    pytest.skip("ragged edges: compiled only (JAXKERNELS_TEST_COMPILED on a Hopper GPU)")
  monkeypatch.setattr(_mosaic_gpu, "num_sms", lambda: 2)
  gen = numerics.rng("stream-k", m, k, n)
  a = numerics.normal(gen, (m, k), jnp.bfloat16)
  b = numerics.normal(gen, (k, n), jnp.bfloat16)
  config = mosaic_gpu.Config(tile_m=64, tile_n=64, tile_k=64, stages=3, stream_k=True)
  with numerics.kernel_mode():
    numerics.must_serve(jk.supports("matmul", "mosaic_gpu", a, b))
    y = jk.matmul(a, b, implementation="mosaic_gpu", config=config)
  want = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  assert np.abs(np.asarray(y, np.float64) - want).max() <= 2 ** -8 * np.abs(want).max()


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("shape", [(3, 100, 1027, 130), (257, 383, 129)])
def test_mosaic_gpu_fp8(dtype, shape):
  """fp8 with per-row and per-column scales on odd shapes (B transposed to K-major by the
  wrapper, K padded to whole 128-deep steps). Compiled only: the interpreter hangs on fp8."""
  if not numerics.COMPILED:
    pytest.skip("the Mosaic GPU interpreter hangs on fp8 (jax 0.10.2): compiled only")
  *lead, m, k, n = shape
  gen = numerics.rng("mosaic-gpu-fp8", shape, jnp.dtype(dtype).name)
  a = numerics.normal(gen, (*lead, m, k), dtype)
  b = numerics.normal(gen, (k, n), dtype)
  a_scale = jnp.asarray(gen.uniform(0.5, 2, (*lead, m)), jnp.float32)
  b_scale = jnp.asarray(gen.uniform(0.5, 2, n), jnp.float32)
  numerics.must_serve(jk.supports("matmul", "mosaic_gpu", a, b, a_scale=a_scale,
                                  b_scale=b_scale))
  y = jk.matmul(a, b, a_scale=a_scale, b_scale=b_scale, implementation="mosaic_gpu")
  want = (np.asarray(a, np.float64) @ np.asarray(b, np.float64)
          * np.asarray(a_scale, np.float64)[..., None] * np.asarray(b_scale, np.float64))
  _assert_fp8_product(y, want, k)


def test_mosaic_gpu_padding():
  """Only TMA's alignment pads A, B and C; a residual, read piece by piece through C's
  buffers, pads C so that no piece starts past its end."""
  bf = jnp.dtype(jnp.bfloat16)
  shapes = lambda size, **kw: mosaic_gpu.padded_shapes(
      Problem(m=size, n=size, k=size, dtype=bf, out_dtype=bf, **kw), mosaic_gpu.Config())
  assert shapes(4224) == ((4224, 4224),) * 3  # 16.5 CTA tiles of 256 columns: no padding
  assert shapes(8193) == ((8200, 8256),) * 3  # rows to 8, rows of 128 bytes
  # 64 x 64 pieces: the last CTA tile's would start past 8200 rows and 8256 columns.
  assert shapes(8193, has_residual=True)[2] == (8320, 8448)
  assert shapes(6, has_residual=True) == ((8, 64), (8, 64), (128, 256))


def test_fp8_triton_and_reference():
  gen = numerics.rng("fp8-triton")
  a = numerics.normal(gen, (3, 20, 70), jnp.float8_e5m2)
  b = numerics.normal(gen, (70, 50), jnp.float8_e5m2)
  a_scale = jnp.asarray(gen.uniform(0.5, 2, (3, 20)), jnp.float32)
  want = np.einsum("bmk,kn->bmn", np.asarray(a, np.float64), np.asarray(b, np.float64)) * \
      np.asarray(a_scale, np.float64)[..., None]
  for impl in ("xla", "triton"):
    with numerics.kernel_mode():
      y = jk.matmul(a, b, a_scale=a_scale, implementation=impl,
                    config=triton.Config(block_m=16, block_n=32, block_k=32, num_warps=4,
                                         num_stages=2) if impl == "triton" else None)
    assert y.dtype == jnp.bfloat16
    # bf16 output: 2^-8 relative. Compiled, the tensor cores also round the fp8 products' sum
    # to about 14 bits as they accumulate (DeepSeek-V3 report, 3.3.2, measured on Hopper): a
    # random walk of sqrt(K) such roundings of the running sum.
    atol = (2 ** -14 * math.sqrt(70) if numerics.COMPILED else 1e-6) * np.abs(want).max()
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2 ** -8, atol=atol)
  with jk.interpret_mode(), pytest.raises(TypeError,
                                          match="no gradient through a float8_e5m2 matmul"):
    jax.grad(lambda s: jk.matmul(a, b, a_scale=s, implementation="triton",
                                 config=TestTriton.CONFIG).astype(jnp.float32).sum())(
        jnp.float32(1.0))


# --------------------------------------------------------------------------- #
# Block-scaled fp8: MXFP8 (1x32), DeepSeek-V3 (1x128 activations, 128x128 weights)
# --------------------------------------------------------------------------- #

# (a_scale's block (rows, K), b_scale's block (K, N)): None is per tensor, "row"/"col" per row
# of a and per column of b (repeated over the other's blocks).
BLOCK_SCHEMES = {
    "mxfp8": ((1, 32), (32, 1)),
    "deepseek": ((1, 128), (128, 128)),
    "a blocks, b per column": ((1, 64), "col"),
    "a per tensor, b blocks": (None, (256, 64)),
}


def _block_scaled_case(gen, lead, m, k, n, scheme, dtype=jnp.float8_e4m3fn):
  """fp8 a, b and scales of ``scheme``, from bf16 values with outlier rows and columns (whose
  blocks the scales exist for), with the float64 product they stand for."""
  a_block, b_block = BLOCK_SCHEMES[scheme]
  scale = lambda shape: jnp.asarray(gen.uniform(0.25, 4, shape), jnp.float32)
  a = numerics.normal(gen, (*lead, m, k), dtype)
  b = numerics.normal(gen, (k, n), dtype)
  a_scale = (scale(()) if a_block is None else
             scale((*lead, m // a_block[0], k // a_block[1])))
  b_scale = scale((n,)) if b_block == "col" else scale((k // b_block[0], n // b_block[1]))
  a64 = np.asarray(a, np.float64) * (np.repeat(np.asarray(a_scale, np.float64), a_block[1], -1)
                                     if a_block else np.asarray(a_scale, np.float64))
  b64 = np.asarray(b, np.float64) * (np.asarray(b_scale, np.float64) if b_block == "col" else
                                     np.repeat(np.repeat(np.asarray(b_scale, np.float64),
                                                         b_block[0], 0), b_block[1], 1))
  return a, b, a_scale, b_scale, a64 @ b64


def _assert_fp8_product(y, want, k):
  """bf16 output: 2^-8 relative. Compiled, the tensor cores round the fp8 products' running sum
  to about 14 bits (test_fp8_triton_and_reference): a random walk of sqrt(K) such roundings,
  each block's sum scaled; interpreted or on XLA, float32 sums (2^-24 a term)."""
  rtol, walk = matmul_reference.fp8_accuracy(k, tensor_cores=numerics.COMPILED)
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=rtol,
                             atol=walk * np.abs(want).max())


@pytest.mark.parametrize("scheme", sorted(BLOCK_SCHEMES))
def test_block_scales(scheme):
  """Block scales on the backend's default (the XLA reference on the CPU, the Mosaic GPU kernel
  on Hopper) and on XLA, with leading dimensions and a bias + gelu epilogue after the scaled
  sum, against the float64 product of the dequantized operands."""
  gen = numerics.rng("block-scales", scheme)
  lead, m, k, n = (2,), 72, 512, 384
  a, b, a_scale, b_scale, want = _block_scaled_case(gen, lead, m, k, n, scheme)
  bias = numerics.normal(gen, (n,), jnp.float32)
  z = want + np.asarray(bias, np.float64)
  want_y = 0.5 * z * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
  for impl in (None, "xla"):
    y = jk.matmul(a, b, a_scale=a_scale, b_scale=b_scale, bias=bias, activation="gelu",
                  implementation=impl)
    chex.assert_shape(y, (*lead, m, n))
    chex.assert_type(y, jnp.bfloat16)
    _assert_fp8_product(y, want_y, k)


@pytest.mark.parametrize("scheme", ["mxfp8", "deepseek"])
def test_block_scales_on_mosaic_gpu(scheme):
  """The Hopper kernel at ragged M (and its ring over several tiles); compiled only (the
  interpreter hangs on fp8: test_mosaic_gpu_block_scales_interpreted runs the same main loop
  on bfloat16)."""
  if not numerics.COMPILED:
    pytest.skip("the Mosaic GPU interpreter hangs on fp8 (jax 0.10.2): compiled only")
  gen = numerics.rng("block-scales-mgpu", scheme)
  a, b, a_scale, b_scale, want = _block_scaled_case(gen, (), 1000, 1024, 768, scheme)
  numerics.must_serve(jk.supports("matmul", "mosaic_gpu", a, b, a_scale=a_scale,
                                  b_scale=b_scale))
  y = jk.matmul(a, b, a_scale=a_scale, b_scale=b_scale, implementation="mosaic_gpu")
  _assert_fp8_product(y, want, 1024)


@pytest.mark.parametrize("block_k, block_n, tile_k, stages", [(64, 1, 64, 3), (128, 128, 64, 2)])
def test_mosaic_gpu_block_scales_interpreted(block_k, block_n, tile_k, stages, monkeypatch):
  """The block-scaled main loop in the interpreter, on bfloat16 operands (its fp8 hangs): two
  SMs, so that each CTA walks several tiles through a ring that wraps mid-tile; a 128-deep block
  in two 64-deep K steps (its scales repeated by the wrapper); b scales per column, or one per
  128 x 128 block (a CTA tile's one scale, handed over along its rows); bias + relu after the
  sum; float32 out."""
  monkeypatch.setattr(_mosaic_gpu, "num_sms", lambda: 2)
  gen = numerics.rng("block-scales-interpreted", block_k)
  m, k, n = 256, 5 * block_k if block_k == 64 else 384, 256
  a = numerics.normal(gen, (m, k), jnp.bfloat16)
  b = numerics.normal(gen, (k, n), jnp.bfloat16)
  a_scale = jnp.asarray(gen.uniform(0.25, 4, (m, k // block_k)), jnp.float32)
  b_scale = jnp.asarray(gen.uniform(0.25, 4, (k // block_k, n // block_n)), jnp.float32)
  bias = numerics.normal(gen, (n,), jnp.float32)
  p = Problem(m=m, n=n, k=k, dtype=jnp.dtype(jnp.bfloat16), out_dtype=jnp.dtype(jnp.float32),
              block_k=block_k, block_n=block_n, has_bias=True, activation="relu")
  config = mosaic_gpu.Config(tile_m=64, tile_n=128, tile_k=tile_k, stages=stages, split="m",
                             ring=True)
  assert mosaic_gpu.config_error(p, config, None) is None
  assert mosaic_gpu.heuristic(p, hardware.DEFAULT_GPU).tile_k == tile_k
  y = mosaic_gpu.matmul(a, b, bias=bias, a_scale=a_scale, b_scale=b_scale, problem=p,
                        config=config, interpret=_mosaic_gpu.interpret_params())
  a64 = np.asarray(a, np.float64) * np.repeat(np.asarray(a_scale, np.float64), block_k, 1)
  b64 = np.asarray(b, np.float64) * np.repeat(np.repeat(np.asarray(b_scale, np.float64),
                                                        block_k, 0), block_n, 1)
  want = np.maximum(a64 @ b64 + np.asarray(bias, np.float64), 0)
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-5,
                             atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("block_k", [32, 128, 256])
def test_mosaic_gpu_block_scales_lower_for_cuda(block_k):
  """fp8 block scales 32, 128 and 256 deep (two K steps a block) lower for CUDA, Mosaic GPU's
  layout inference included."""
  a = jax.ShapeDtypeStruct((300, 512), jnp.float8_e4m3fn)
  b = jax.ShapeDtypeStruct((512, 384), jnp.float8_e4m3fn)
  a_scale = jax.ShapeDtypeStruct((300, 512 // block_k), jnp.float32)
  b_scale = jax.ShapeDtypeStruct((512 // block_k, 3), jnp.float32)
  f = lambda a, b, sa, sb: jk.matmul(a, b, a_scale=sa, b_scale=sb, implementation="mosaic_gpu")
  assert "mosaic_gpu" in cuda_lowering(f, a, b, a_scale, b_scale)


def test_block_scales_choose_the_kernel_or_say_why():
  """Which kernels take a block-scaled product: mosaic_gpu for fp8 blocks a multiple of 32
  deep (to 128, then multiples of 128); the others say they scale only in their epilogue."""
  chip = hardware.DEFAULT_GPU
  f8 = jnp.dtype(jnp.float8_e4m3fn)
  problem = lambda bk: Problem(m=256, n=256, k=768, dtype=f8, out_dtype=jnp.dtype(jnp.bfloat16),
                               block_k=bk, block_n=128)
  for bk in (32, 64, 128, 256, 384):
    assert mosaic_gpu.unsupported(problem(bk), chip) is None, bk
    config = mosaic_gpu.heuristic(problem(bk), chip)
    assert mosaic_gpu.config_error(problem(bk), config, chip) is None
    assert (config.tile_m, config.tile_n, config.split, config.tile_k) == (64, 128, "m",
                                                                           min(bk, 128))
  for bk in (16, 48, 192):
    assert "block scales a multiple of 32" in mosaic_gpu.unsupported(problem(bk), chip)
  assert "epilogue only" in triton.unsupported(problem(128), chip)
  wide = mosaic_gpu.Config(tile_m=128, tile_n=128, tile_k=128, stages=2, split="m", ring=True)
  assert "two accumulators" in mosaic_gpu.config_error(problem(128), wide, chip)


@pytest.mark.parametrize("kwargs, match", [
    (dict(a_scale=jnp.ones((4, 3)), b_scale=jnp.ones((2, 16))), "disagree on K's blocks"),
    (dict(a_scale=jnp.ones((4, 3))), r"K=8 is not a whole number of the scales' 3 blocks"),
    (dict(b_scale=jnp.ones((2, 3))), r"N=16 is not a whole number of b_scale's 3 blocks"),
    (dict(a_scale=jnp.ones((4, 2, 1))), r"a_scale must have shape \(\), \(4,\) \(per row\)"),
    (dict(b_scale=jnp.ones((2, 2, 2))), r"b_scale must have shape \(\), \(16,\) \(per column\)"),
])
def test_bad_block_scales(kwargs, match):
  a, b = A.astype(jnp.float8_e4m3fn), B.astype(jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match=match):
    jk.matmul(a, b, **kwargs)


def test_quantize_blocks_and_per_tensor():
  """Each block's largest magnitude maps to the dtype's largest value (a power of two at most
  that under power_of_two); dequantized, every element is within half an fp8 ulp of its block's
  scale times its value; an all-zero block gets scale 1."""
  gen = numerics.rng("quantize")
  x = numerics.normal(gen, (2, 64, 256), jnp.float32)
  x = x.at[0, 3].multiply(1000.0).at[1, :, 7].set(0.0)  # an outlier row, a zero column
  x = x.at[1, :32, :32].set(0.0)  # an all-zero (32, 32) block
  for dtype, block, pow2 in ((jnp.float8_e4m3fn, (1, 128), False),
                             (jnp.float8_e4m3fn, (32, 32), False),
                             (jnp.float8_e5m2, (32, 1), True), (jnp.int8, None, False)):
    q, scale = jk.quantize(x, dtype=dtype, block=block, power_of_two=pow2)
    chex.assert_type(q, dtype)
    chex.assert_shape(scale, () if block is None else (2, 64 // block[0], 256 // block[1]))
    full = np.asarray(scale, np.float64) if block is None else np.repeat(np.repeat(
        np.asarray(scale, np.float64), block[0], -2), block[1], -1)
    x64, q64 = np.asarray(x, np.float64), np.asarray(q, np.float64)
    top = float(jnp.iinfo(dtype).max if dtype == jnp.int8 else jnp.finfo(dtype).max)
    assert np.abs(q64).max() <= top
    # Relative spacing of the dtype's values (int8: absolute half a unit).
    if dtype == jnp.int8:
      assert np.abs(q64 * full - x64).max() <= 0.5 * full.max() * (1 + 1e-6)
    else:
      ulp = 2.0 ** -jnp.finfo(dtype).nmant
      normal_min = float(jnp.finfo(dtype).smallest_normal)
      bound = 0.5 * ulp * np.abs(x64) + 0.5 * normal_min * ulp * full
      assert np.all(np.abs(q64 * full - x64) <= bound * (1 + 1e-6))
    if pow2:
      assert np.all(np.log2(np.asarray(scale)) == np.round(np.log2(np.asarray(scale))))
    if block == (32, 32):
      assert float(scale[1, 0, 0]) == 1.0
  with pytest.raises(ValueError, match=r"block \(3, 128\) must divide"):
    jk.quantize(x, block=(3, 128))
  with pytest.raises(TypeError, match="dtype must be one of"):
    jk.quantize(x, dtype=jnp.bfloat16)


def test_block_scales_beat_per_tensor_on_outliers():
  """What block scales are for: activation rows 1e5 times the others (past e4m3's 2^15 between
  its largest and its smallest normal value), quantized per tensor, flush the ordinary rows into
  subnormals; in 1 x 128 blocks each row keeps its 3 bits. Each product's error against the
  float64 product of the unquantized values, median over rows."""
  gen = numerics.rng("block-outliers")
  m, k, n = 128, 512, 256
  a = numerics.normal(gen, (m, k), jnp.float32).at[::16].multiply(1e5)
  b = numerics.normal(gen, (k, n), jnp.float32, k ** -0.5)
  want = np.asarray(a, np.float64) @ np.asarray(b, np.float64)

  def row_error(a_block, b_block):
    a8, sa = jk.quantize(a, block=a_block)
    b8, sb = jk.quantize(b, block=b_block)
    y = np.asarray(jk.matmul(a8, b8, a_scale=sa, b_scale=sb, out_dtype=jnp.float32), np.float64)
    return np.median(np.linalg.norm(y - want, axis=1) / np.linalg.norm(want, axis=1))

  blocks = row_error((1, 128), (128, 128))
  # e4m3's 3 mantissa bits, rounding to nearest in both operands: ~2^-4 / sqrt(3) * sqrt(2).
  assert blocks <= 0.06
  assert row_error(None, None) >= 5 * blocks


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #

A = jnp.zeros((4, 8), jnp.bfloat16)
B = jnp.zeros((8, 16), jnp.bfloat16)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(b=jnp.zeros((7, 16), jnp.bfloat16)), ValueError, r"a \(4, 8\) and b \(7, 16\) disagree on K"),
    (dict(a=jnp.zeros((8,), jnp.bfloat16)), ValueError, r"a must have rank >= 2, got shape \(8,\)"),
    (dict(b=jnp.zeros((1, 8, 16), jnp.bfloat16)), ValueError, r"b must be \(K, N\), rank 2"),
    (dict(bias=jnp.zeros((15,), jnp.bfloat16)), ValueError, r"bias must have shape \(16,\)"),
    (dict(residual=jnp.zeros((4, 15), jnp.bfloat16)), ValueError, r"residual must have the shape"),
    (dict(b=jnp.zeros((8, 16), jnp.float32)), TypeError, "a and b must share a dtype"),
    (dict(a=jnp.zeros((4, 8), jnp.int32), b=jnp.zeros((8, 16), jnp.int32)), TypeError,
     "a has dtype int32"),
    (dict(activation="tanh"), ValueError, "activation='tanh' is not one of"),
    (dict(out_dtype=jnp.int8), TypeError, "out_dtype must be one of"),
    (dict(a_scale=jnp.float32(2)), ValueError, "a_scale dequantizes fp8/int8 operands"),
    (dict(precision="high"), TypeError, "precision must be None or a jax.lax.Precision"),
    pytest.param(dict(implementation="mosaic_tpu", out_dtype=jnp.float16), ValueError,
                 "mosaic_tpu does not write float16", marks=pytest.mark.cpu_only),
    (dict(implementation="cuda"), ValueError, "implementation='cuda' is not one of"),
])
def test_bad_input(kwargs, error, match):
  args = dict(a=A, b=B)
  args.update(kwargs)
  with jk.interpret_mode(), pytest.raises(error, match=match):
    jk.matmul(args.pop("a"), args.pop("b"), **args)


@pytest.mark.parametrize("context,want", [(None, "DEFAULT"), ("highest", "HIGHEST"),
                                           ("float32", "HIGHEST"), ("tensorfloat32", "HIGH")])
def test_default_matmul_precision_reaches_the_kernels(context, want):
  """precision=None means what jax.default_matmul_precision says, as for XLA's own products: on
  a GPU a float32 model under "highest" once ran its products in tf32 (6e-4 off XLA's)."""
  a = jnp.ones((64, 64), jnp.float32)
  with jk.interpret_mode("triton"), jax.default_matmul_precision(context):
    text = str(jax.make_jaxpr(lambda a, b: jk.matmul(a, b, implementation="triton"))(a, a))
  assert set(re.findall(r"precision=\(Precision\.(\w+)", text)) == {want}


def test_unsupported_dtype_combination_names_the_backend():
  a8, b8 = jnp.zeros((4, 8), jnp.int8), jnp.zeros((8, 16), jnp.int8)
  with jk.interpret_mode(), pytest.raises(ValueError, match="triton takes bfloat16, float16, "
                                          "float32 or fp8 operands, got int8"):
    jk.matmul(a8, b8, implementation="triton")
  with jk.interpret_mode():
    support = jk.supports("matmul", "mosaic_gpu", A.astype(jnp.float32), B.astype(jnp.float32))
  assert not support and "float32" in support.reason


def test_config_checks():
  with pytest.raises(ValueError, match="block_m=24 must be a power of two"):
    triton.Config(block_m=24, block_n=32, block_k=32)
  with pytest.raises(ValueError, match="tile_m=96 must be a multiple of 64"):
    mosaic_gpu.Config(tile_m=96)
  with jk.interpret_mode(), pytest.raises(TypeError, match="config for implementation='triton'"):
    jk.matmul(A, B, implementation="triton", config=mosaic_gpu.Config())
  big = mosaic_gpu.Config(tile_m=128, tile_n=256, stages=8)
  p = Problem(m=4096, n=4096, k=4096, dtype=jnp.dtype(jnp.bfloat16),
              out_dtype=jnp.dtype(jnp.bfloat16))
  assert "shared memory" in mosaic_gpu.config_error(p, big, hardware.DEFAULT_GPU)
  # Warpgroup halves of B's 192-wide block would start mid swizzle tile: named, not a
  # compiler error, when a user hands the config in.
  odd = mosaic_gpu.Config(tile_m=128, tile_n=96, epi_tile_n=32)
  with pytest.raises(ValueError, match=re.escape(
      "split='n' cuts the CTA's 192-wide block into warpgroup halves of 96, which must be a "
      "multiple of its 64-element swizzle tile")):
    jax.eval_shape(lambda a, b: jk.matmul(a, b, implementation="mosaic_gpu", config=odd),
                   jax.ShapeDtypeStruct((256, 64), jnp.bfloat16),
                   jax.ShapeDtypeStruct((64, 384), jnp.bfloat16))
  # B stored transposed is cut along its rows: any multiple of 32 will do.
  q = dataclasses.replace(p, trans_b=True)
  assert mosaic_gpu.config_error(q, odd, hardware.DEFAULT_GPU) is None
  # Every backend's user config is checked at the dispatch, before its compiler sees it.
  a, b = jax.ShapeDtypeStruct((300, 200), jnp.bfloat16), jax.ShapeDtypeStruct((200, 260),
                                                                               jnp.bfloat16)
  deep = triton.Config(block_m=256, block_n=256, block_k=128, num_stages=8)
  with jk.interpret_mode(), pytest.raises(ValueError, match=re.escape(
      f"config={deep} cannot run 300x200 @ 200x260 bfloat16 on implementation='triton': 8 "
      "stages of 256x128 and 128x256 blocks need 1048576 bytes of shared memory")):
    jax.eval_shape(lambda a, b: jk.matmul(a, b, implementation="triton", config=deep), a, b)
  ragged = mosaic_tpu.Config(block_m=100, block_n=256, block_k=200)
  with jk.interpret_mode(), pytest.raises(ValueError, match=re.escape(
      "on implementation='mosaic_tpu': block_m=100 must be a multiple of 16 or the whole "
      "m=300")):
    jax.eval_shape(lambda a, b: jk.matmul(a, b, implementation="mosaic_tpu", config=ragged),
                   a, b)


def test_zero_sized():
  with numerics.kernel_mode():
    y = jk.matmul(jnp.zeros((0, 8), jnp.float32), jnp.ones((8, 3), jnp.float32),
                  implementation="triton")
  assert y.shape == (0, 3)


def test_jit_vmap_checkpoint():
  primals, ct = inputs((24, 40, 36), jnp.float32, True, False)
  fn = lambda a, b, bias: jk.matmul(a, b, bias=bias, activation="silu", implementation="triton",
                                    config=TestTriton.CONFIG)
  want = reference("silu", True, False)(jnp.float32)(*primals)
  with numerics.kernel_mode():
    got = jax.jit(fn)(*primals)
    batched = jax.vmap(fn, in_axes=(0, None, None))(jnp.stack([primals[0]] * 2), *primals[1:])
    g1 = jax.grad(lambda *p: jnp.sum(jax.checkpoint(fn)(*p) * ct))(*primals)
    g2 = jax.grad(lambda *p: jnp.sum(fn(*p) * ct))(*primals)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(batched[1], want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(g1, g2, rtol=1e-6)


# --------------------------------------------------------------------------- #
# Compiles: TPU (real compiler, AOT) and CUDA (lowering)
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype, shape", [
    (jnp.bfloat16, (1024, 2048, 4096)), (jnp.bfloat16, (1000, 700, 1030)),
    (jnp.float32, (512, 384, 640)), (jnp.int8, (2048, 2048, 4096))])
def test_tpu_aot_compile(tpu_mesh, dtype, shape):
  """The heuristic config for each shape compiles for v5e, v5p and v6e, forward and backward."""
  m, n, k = shape
  a = jax.ShapeDtypeStruct((m, k), dtype)
  b = jax.ShapeDtypeStruct((k, n), dtype)
  if dtype == jnp.int8:
    fn = lambda a, b: jk.matmul(a, b, a_scale=jnp.float32(0.1), activation="gelu",
                                implementation="mosaic_tpu")
  else:
    bias = jax.ShapeDtypeStruct((n,), dtype)
    def fn(a, b, bias):
      loss = lambda a, b, bias: jnp.sum(jk.matmul(a, b, bias=bias, activation="gelu",
                                                  implementation="mosaic_tpu").astype(jnp.float32))
      return jax.grad(loss, argnums=(0, 1, 2))(a, b, bias)
    text = aot_compile(tpu_mesh, fn, a, b, bias)
    assert text.count("jk_matmul") >= 3  # forward, dA, dB
    return
  assert "jk_matmul" in aot_compile(tpu_mesh, fn, a, b)


def test_cuda_lowering():
  bf = jnp.bfloat16
  shapes = (jax.ShapeDtypeStruct((1000, 520), bf), jax.ShapeDtypeStruct((520, 1030), bf),
            jax.ShapeDtypeStruct((1030,), bf))
  for impl in ("triton", "mosaic_gpu"):
    def fn(a, b, bias, impl=impl):
      loss = lambda a, b, bias: jnp.sum(jk.matmul(a, b, bias=bias, activation="gelu",
                                                  implementation=impl).astype(jnp.float32))
      return jax.grad(loss, argnums=(0, 1, 2))(a, b, bias)
    text = cuda_lowering(fn, *shapes)
    marker = "jk_matmul" if impl == "triton" else "mosaic_gpu"
    assert text.count(marker) >= 3, impl
    if impl == "mosaic_gpu":  # the epilogue's 1/x: one MUFU.RCP, not rcp.approx's range fix-ups
      assert "rcp.approx.ftz.f32" in text and "rcp.approx.f32" not in text
      assert "jk_crop" in text  # 1030 columns: C is padded, then cut by the copy kernel
  # 4224 = 16.5 CTA tiles of 256 columns: the last tile's second warpgroup starts at C's end
  # and is not stored, so nothing is padded or cut.
  odd_tiles = jax.ShapeDtypeStruct((4224, 4224), bf)
  text = cuda_lowering(lambda a, b: jk.matmul(a, b, implementation="mosaic_gpu"), odd_tiles,
                       odd_tiles)
  assert "mosaic_gpu" in text and "jk_crop" not in text and "stablehlo.pad" not in text
  f8 = jax.ShapeDtypeStruct((256, 512), jnp.float8_e4m3fn)
  text = cuda_lowering(lambda a, b: jk.matmul(a, b, b_scale=jnp.float32(2),
                                              implementation="mosaic_gpu"), f8,
                       jax.ShapeDtypeStruct((512, 384), jnp.float8_e4m3fn))
  assert "mosaic_gpu" in text
