"""matmul: every backend against the float64 oracle (forward and gradients), errors, the
config checks, transformations, TPU AOT compiles and CUDA lowering. The gated product:
test_matmul_glu.py; fp8 and block scales: test_matmul_fp8.py; Mosaic GPU's schedules:
test_matmul_schedules.py."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkernels as jk
from jaxkernels import _mosaic_gpu, hardware
from jaxkernels.ops.matmul import mosaic_gpu, mosaic_tpu, triton
from jaxkernels.ops.matmul.common import Problem
from bench import shapes
from tests import numerics
from tests.conftest import aot_compile, cuda_lowering
from tests.matmul_cases import A, B, EPILOGUES, TRITON_SMALL, MatmulTest, inputs, reference


class TestXla(MatmulTest):
  IMPL = "xla"


class TestTriton(MatmulTest):
  IMPL = "triton"
  CONFIG = TRITON_SMALL

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
# Bad input
# --------------------------------------------------------------------------- #


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
