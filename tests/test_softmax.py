"""softmax: every backend against the float64 oracle, forward and backward; masked rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkernels as jk
from bench import shapes
from jaxkernels import _mosaic_gpu, _triton, hardware
from jaxkernels.ops.softmax import reference
from jaxkernels.ops.softmax import mosaic_gpu as softmax_mosaic_gpu
from jaxkernels.ops.softmax import triton as softmax_triton
from jaxkernels.ops.softmax.api import Problem
from tests import cases, numerics
from tests.conftest import aot_compile, cuda_lowering

SMALL = (*shapes.SMALL_ROWS, shapes.ODD_ROWS[-1])


def _reference(axis=-1):
  return lambda cd: lambda x: reference.softmax(x, axis=axis, compute_dtype=cd)


def _pointwise_rtol(x, ct, dtype, axis=-1):
  """[y's, dx's]: the bounds every kernel meets whatever the baseline drew, as fractions of each
  leaf's largest element. y: its one rounding to the output dtype, u (its unit roundoff) of
  |y_i|. dx = y (g - s), s = sum(g y), from y in the output dtype (what the backward reads, as
  the reference's vjp does): y's rounding costs u |dx_i| through y_i and y_i u sum|g y|
  through s; dx's own rounding u |dx_i|. On a small array the naive baseline's max error is
  one element's and may land well under these roundings (a (6, 5) bf16 case: baseline 2.4e-3,
  kernel 6.6e-3 = 1.7u, under this bound's 2u+)."""
  u = float(jnp.finfo(dtype).eps) / 2
  with jax.enable_x64(True):
    y = np.asarray(jax.jit(lambda x: reference.softmax(x, axis=axis))(  # one program
        jnp.asarray(np.asarray(x, np.float64))))
  g = np.asarray(ct, np.float64)
  dx = y * (g - np.sum(g * y, axis=axis, keepdims=True))
  bound = u * (2 * np.abs(dx) + y * np.sum(np.abs(g * y), axis=axis, keepdims=True))
  return [u, float(np.max(bound) / max(np.max(np.abs(dx)), 1e-300))]


class SoftmaxTest:
  IMPL = "xla"
  REFUSES = {}  # dtype -> words of this backend's reason for refusing it (cases.check's refused)
  # Shapes of the single-shape tests; a kernel class whose widths are restricted (Mosaic GPU:
  # whole 128-element vectors) draws its own.
  AXIS_SHAPE, VMAP_SHAPE, MASKED_SHAPE = (4, 37, 5), (4, 6, 40), (6, 40)

  def op(self, axis=-1, config=None):
    return lambda x: jk.softmax(x, axis=axis, implementation=self.IMPL, config=config)

  def inputs(self, shape, dtype, *labels):
    gen = numerics.rng(type(self).__name__, shape, jnp.dtype(dtype).name, *labels)
    return numerics.normal(gen, shape, dtype, 3.0), numerics.normal(gen, shape, dtype)

  def check(self, x, ct, dtype, axis=-1, config=None):
    return cases.check("softmax", self.IMPL, self.op(axis, config), _reference(axis), (x,), ct,
                       dtype=dtype, reduction=x.shape[axis],
                       pointwise_rtol=_pointwise_rtol(x, ct, dtype, axis),
                       support=((x,), {"axis": axis}),
                       refused=self.REFUSES.get(jnp.dtype(x.dtype)))

  @pytest.mark.parametrize("shape", SMALL + shapes.BATCHED)
  def test_float32(self, shape):
    self.check(*self.inputs(shape, jnp.float32), jnp.float32)

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  def test_low_precision(self, dtype):
    self.check(*self.inputs((64, 384), dtype), dtype)

  def test_axis(self):
    x, ct = self.inputs(self.AXIS_SHAPE, jnp.float32, "axis")
    self.check(x, ct, jnp.float32, axis=1)

  def test_jit_vmap(self):
    x, _ = self.inputs(self.VMAP_SHAPE, jnp.float32, "vmap")
    with numerics.kernel_mode():
      got = jax.jit(jax.vmap(self.op(), in_axes=1, out_axes=1))(x)
    assert max(numerics.errors(got, reference.softmax(x))) < 8 * numerics.F32_EPS

  def test_masked_rows(self):
    """Fully masked rows give zeros and zero gradients; partly masked rows ignore the mask."""
    x, ct = self.inputs(self.MASKED_SHAPE, jnp.float32, "masked")
    x = x.at[1].set(-jnp.inf).at[4, :25].set(-jnp.inf)
    (y, (dx,)) = self.check(x, ct, jnp.float32)
    assert np.all(np.asarray(y[1]) == 0) and np.all(np.asarray(dx[1]) == 0)
    assert np.all(np.asarray(y[4, :25]) == 0)
    assert np.all(np.isfinite(np.asarray(dx)))


class TestSoftmaxXla(SoftmaxTest):
  IMPL = "xla"


class TestSoftmaxMosaicGpu(SoftmaxTest):
  """Rows of whole 128-element vectors, interpreted with three CTAs (each a host thread): every
  CTA walks several row blocks, some one fewer. On request only until timed on a GPU."""

  IMPL = "mosaic_gpu"
  AXIS_SHAPE, VMAP_SHAPE, MASKED_SHAPE = (4, 128, 5), (4, 6, 128), (6, 256)

  @pytest.fixture(autouse=True)
  def _three_ctas(self, monkeypatch):
    if not numerics.COMPILED:
      monkeypatch.setattr(_mosaic_gpu, "num_sms", lambda: 3)

  # (37, 384): pieces of 192, one-element vectors, an odd row count; (2, 3, 1024): batched
  # rows.
  @pytest.mark.parametrize("shape", [(37, 384), (2, 3, 1024), (130, 2048)])
  def test_float32(self, shape):
    self.check(*self.inputs(shape, jnp.float32), jnp.float32)

  @pytest.mark.parametrize("per_cta", [0, 3])
  def test_two_rows_a_step(self, per_cta):
    """rows=2: two rows' statistics in flight, outputs side by side; at 37 rows (odd) the
    kernel takes one a step. A persistent grid (per_cta 0; the heuristic's for rows too wide
    for several CTAs an SM) and runs of three blocks a CTA, the last one shorter."""
    config = softmax_mosaic_gpu.Config(stages=2, ctas_per_sm=1, rows=2, bwd_stages=2,
                                       bwd_ctas_per_sm=1, bwd_rows=2, per_cta=per_cta,
                                       bwd_per_cta=per_cta)
    for shape in ((6, 512), (37, 256)):
      self.check(*self.inputs(shape, jnp.float32), jnp.float32, config=config)

  def test_rows_wider_than_registers(self, monkeypatch):
    """Rows too wide to hold in registers are read from shared memory at each use (and
    exponentiated twice): the walk for 8192-column rows and wider."""
    monkeypatch.setattr(_mosaic_gpu, "RESIDENT_FLOATS", 1)
    self.check(*self.inputs((2, 3, 1024), jnp.float32), jnp.float32)

  def test_heuristic_walks(self):
    """Runs of RUN rows a CTA (hardware-scheduled) where four CTAs' rings fit an SM, one row a
    CTA where runs would leave SMs idle; rows too wide for that take a persistent grid
    (notes/mgpurows.md mgpu-rows-2). Each fits the chip."""
    chip = hardware.chip("H200")
    for rows, cols, want in ((16384, 4096, softmax_mosaic_gpu.RUN), (200, 4096, 1),
                             (16384, 16384, 0)):
      problem = Problem.of(jax.ShapeDtypeStruct((rows, cols), jnp.bfloat16), 1)
      config = softmax_mosaic_gpu.heuristic(problem, chip)
      assert (config.per_cta, config.bwd_per_cta) == (want, want), (cols, config)
      assert softmax_mosaic_gpu.config_error(problem, config, chip) is None

  def test_too_wide_rows_name_why(self):
    x = jnp.ones((2, 65536), jnp.bfloat16)
    with numerics.kernel_mode():
      supported = jk.supports("softmax", "mosaic_gpu", x)
    assert not supported and "online softmax takes rows this wide" in supported.reason

  def test_lowers_for_cuda(self):
    x = jax.ShapeDtypeStruct((256, 4096), jnp.bfloat16)
    text = cuda_lowering(lambda x, dy: jax.vjp(self.op(), x)[1](dy), x, x)
    assert text.count("@mosaic_gpu_v2(") == 2 and _triton.CUSTOM_CALL not in text


class TestSoftmaxTriton(SoftmaxTest):
  IMPL = "triton"

  @pytest.mark.parametrize("unroll,prefetch", [(1, False), (3, False), (3, True)])
  def test_online_path(self, unroll, prefetch):
    """Rows wider than one register pass: the online softmax, with a fully masked row, a row
    masked past its first chunk and a partial row block; unrolled 3 chunks a step, the last
    step's third chunk lies wholly past the row's end."""
    x, ct = self.inputs((5, 300), jnp.float32, "online")
    x = x.at[2].set(-jnp.inf).at[3, 64:].set(-jnp.inf)
    config = softmax_triton.Config(block_rows=2, block_cols=64, num_warps=4, bwd_block_rows=2,
                                   bwd_num_warps=4, unroll=unroll, bwd_unroll=unroll,
                                   prefetch=prefetch)
    y, (dx,) = self.check(x, ct, jnp.float32, config=config)
    assert np.all(np.asarray(y[2]) == 0) and np.all(np.isfinite(np.asarray(dx)))

  @pytest.mark.parametrize("flat", [True, False])
  @pytest.mark.parametrize("dtype,shape,block_cols,unroll,prefetch", [
      (jnp.float32, (5, 301), 64, 1, False),  # 301 = 75 vectors of 4 + 1: rows off alignment
      (jnp.bfloat16, (5, 300), 64, 3, False),  # a multiple of 4, not of 8
      (jnp.float16, (7, 257), 32, 2, True),
      (jnp.bfloat16, (9, 13), 4, 1, False),  # bodies of one vector, edges on both sides
      (jnp.bfloat16, (6, 5), 4, 2, False),  # rows shorter than a vector: no body at all
  ])
  def test_online_unaligned_rows(self, dtype, shape, block_cols, unroll, prefetch, flat,
                                 monkeypatch):
    """Rows whose width is not a multiple of a 16-byte vector: through the flat view, each row's
    body is walked from a vector boundary and its head and tail are loaded apart; past
    FLAT_MAX_ELEMENTS (here lowered to the array's size), by (row, column) as aligned rows are.
    With a fully masked row, a row masked from its middle and a partial row block."""
    if not flat:
      monkeypatch.setattr(softmax_triton, "FLAT_MAX_ELEMENTS", shape[0] * shape[1])
    x, ct = self.inputs(shape, dtype, "unaligned")
    x = x.at[1].set(-jnp.inf).at[shape[0] - 1, shape[1] // 2:].set(-jnp.inf)
    config = softmax_triton.Config(block_rows=2, block_cols=block_cols, num_warps=4,
                                   bwd_block_rows=2, bwd_num_warps=4, unroll=unroll,
                                   bwd_unroll=unroll, prefetch=prefetch)
    y, (dx,) = self.check(x, ct, dtype, config=config)
    assert np.all(np.asarray(y[1]) == 0) and np.all(np.isfinite(np.asarray(dx, np.float32)))

  def test_online_heuristic(self):
    """Past _triton.ONE_PASS_COLS the heuristic takes one row a program, unrolled chunks."""
    x = jax.ShapeDtypeStruct((1024, 65536), jnp.bfloat16)
    config = softmax_triton.heuristic(Problem.of(x, 1), None)  # axis as validated: >= 0
    assert config.block_cols < 65536 and config.block_rows == config.bwd_block_rows == 1
    assert config.unroll > 1 and config.bwd_unroll > 1

  @pytest.mark.parametrize("width", [70000, 50257])
  def test_lowers_for_cuda(self, width):
    x = jax.ShapeDtypeStruct((64, width), jnp.bfloat16)
    text = cuda_lowering(lambda x, dy: jax.vjp(self.op(), x)[1](dy), x, x)
    assert 'name = "jk_softmax_fwd"' in text and 'name = "jk_softmax_bwd"' in text


class TestSoftmaxMosaicTpu(SoftmaxTest):
  IMPL = "mosaic_tpu"
  REFUSES = {jnp.dtype(jnp.float16): cases.NO_TPU_FLOAT16}

  def test_aot_compiles(self, tpu_mesh):
    for (rows, cols), dtype in (((1024, 4096), jnp.bfloat16), ((37, 200), jnp.float32)):
      x = jax.ShapeDtypeStruct((rows, cols), dtype)
      text = aot_compile(tpu_mesh, lambda x, dy: jax.vjp(self.op(), x)[1](dy), x, x)
      assert "jk_softmax_fwd" in text and "jk_softmax_bwd" in text


class TestSoftmaxErrors:
  def test_axis_range(self):
    with pytest.raises(ValueError, match="axis=2 is out of range for an array of rank 2"):
      jk.softmax(jnp.ones((2, 3)), axis=2)

  def test_axis_type(self):
    with pytest.raises(TypeError, match="axis must be an int"):
      jk.softmax(jnp.ones((2, 3)), axis=(0, 1))

  def test_integer(self):
    with pytest.raises(TypeError, match="x must have a floating dtype"):
      jk.softmax(jnp.ones((2, 3), jnp.int32))
