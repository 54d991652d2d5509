"""bias_activation and glu: every backend against the float64 oracle, forward and backward."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkernels as jk
from bench import shapes
from jaxkernels import _activations, _mosaic_gpu, _triton, hardware
from jaxkernels.ops.elementwise import mosaic_gpu as elementwise_mosaic_gpu
from jaxkernels.ops.elementwise import reference
from jaxkernels.ops.elementwise import triton as elementwise_triton
from jaxkernels.ops.elementwise.api import Problem
from tests import cases, numerics
from tests.conftest import aot_compile, cuda_lowering

ACTIVATIONS = _activations.ACTIVATIONS
SMALL = (*shapes.SMALL_ROWS, (9, 5000))  # and a row wider than one block
# Every shape, every activation: the whole product compiled, a cross through (37, 200) and gelu
# interpreted (numerics.grid).
FLOAT32_GRID = numerics.grid(SMALL + shapes.BATCHED, ACTIVATIONS, center=((37, 200), "gelu"))


def _pointwise_rtol(activation, z, weight):
  """The activations' documented accuracy as a fraction of the largest element of a gradient
  weight * act'(z): values within RTOL relative, slopes within RTOL of max(|slope|, 1), pointwise
  (_activations). Where every slope in the array is small (a one-element array, say), the
  slopes' error is more than RTOL of the largest gradient element: by max(w max(|s|, 1)) /
  max(w |s|)."""
  with jax.enable_x64(True):
    z64 = jnp.asarray(np.asarray(z, np.float64)).ravel()
    slope = np.abs(np.asarray(jax.jit(jax.vmap(jax.grad(  # one program, not one per op
        lambda t: _activations.reference(activation, t))))(z64)))
  w = np.abs(np.asarray(weight, np.float64)).ravel()
  ratio = np.max(w * np.maximum(slope, 1.0)) / max(np.max(w * slope), 1e-300)
  return _activations.RTOL * max(1.0, float(ratio))


class ElementwiseTest:
  IMPL = "xla"
  REFUSES = {}  # dtype -> words of this backend's reason for refusing it (cases.check's refused)
  VMAP_SHAPE = (4, 6, 40)  # a kernel class of restricted widths draws its own

  def bias_activation(self, activation, config=None):
    return lambda x, b: jk.bias_activation(x, b, activation=activation,
                                           implementation=self.IMPL, config=config)

  def glu(self, activation, config=None):
    return lambda g, u: jk.glu(g, u, activation=activation, implementation=self.IMPL,
                               config=config)

  def check(self, op_name, fn, reference_fn, primals, ct, dtype, pointwise_rtol, activation):
    return cases.check(op_name, self.IMPL, fn, reference_fn, primals, ct, dtype=dtype,
                       reduction=primals[0].size // primals[0].shape[-1],
                       pointwise_rtol=pointwise_rtol,
                       support=(primals, {"activation": activation}),
                       refused=self.REFUSES.get(jnp.dtype(primals[0].dtype)))

  def check_bias_activation(self, shape, dtype, activation, *labels, config=None):
    """Draws inputs (labelled ``labels``, else the activation) and checks one call."""
    primals, ct = self.bias_inputs(shape, dtype, *(labels or (activation,)))
    (x, b), dy = primals, ct
    self.check("bias_activation", self.bias_activation(activation, config),
               lambda cd: lambda x, b: reference.bias_activation(x, b, activation=activation,
                                                                 compute_dtype=cd),
               primals, ct, dtype, _pointwise_rtol(activation, x + b, dy), activation)

  def check_glu(self, shape, dtype, activation):
    primals, ct = self.glu_inputs(shape, dtype, activation)
    (gate, up), dy = primals, ct
    self.check("glu", self.glu(activation),
               lambda cd: lambda g, u: reference.glu(g, u, activation=activation,
                                                     compute_dtype=cd),
               primals, ct, dtype, _pointwise_rtol(activation, gate, dy * up), activation)

  def check_glu_packed(self, shape, dtype, activation):
    """glu(x) of x = [gate | up] (``shape`` is one half's) against the reference on the
    halves, forward and the gradient as one array."""
    (gate, up), dy = self.glu_inputs(shape, dtype, activation, "packed")
    n = shape[-1]
    self.check("glu", lambda x: jk.glu(x, activation=activation, implementation=self.IMPL),
               lambda cd: lambda x: reference.glu(x[..., :n], x[..., n:], activation=activation,
                                                  compute_dtype=cd),
               (jnp.concatenate([gate, up], axis=-1),), dy, dtype,
               _pointwise_rtol(activation, gate, dy * up), activation)

  # Activation inputs stay where the activations' accuracy is documented (|z| <= 4).
  def bias_inputs(self, shape, dtype, *labels):
    gen = numerics.rng(type(self).__name__, "bias", shape, jnp.dtype(dtype).name, *labels)
    return ((numerics.normal(gen, shape, dtype, 1.5, bound=3.0),
             numerics.normal(gen, (shape[-1],), jnp.float32, 0.3, bound=1.0)),
            numerics.normal(gen, shape, dtype))

  def glu_inputs(self, shape, dtype, *labels):
    gen = numerics.rng(type(self).__name__, "glu", shape, jnp.dtype(dtype).name, *labels)
    bound = _activations.ACCURATE_RANGE
    return ((numerics.normal(gen, shape, dtype, 1.5, bound=bound),
             numerics.normal(gen, shape, dtype)), numerics.normal(gen, shape, dtype))

  @pytest.mark.parametrize("shape,activation", FLOAT32_GRID)
  def test_bias_activation_float32(self, shape, activation):
    self.check_bias_activation(shape, jnp.float32, activation)

  @pytest.mark.parametrize("shape,activation", FLOAT32_GRID)
  def test_glu_float32(self, shape, activation):
    self.check_glu(shape, jnp.float32, activation)

  @pytest.mark.parametrize("shape", ((1, 1), (37, 200), (2, 5, 129)))
  @pytest.mark.parametrize("activation", ["gelu", "silu"])
  def test_glu_packed_float32(self, shape, activation):
    self.check_glu_packed(shape, jnp.float32, activation)

  def test_glu_packed_bfloat16(self):
    self.check_glu_packed((64, 384), jnp.bfloat16, "silu")

  @pytest.mark.parametrize("dtype,activation", numerics.grid([jnp.bfloat16, jnp.float16],
                                                             ["gelu", "silu"]))
  def test_low_precision(self, dtype, activation):
    self.check_bias_activation((64, 384), dtype, activation)
    self.check_glu((64, 384), dtype, activation)

  def test_jit_vmap(self):
    (x, b), _ = self.bias_inputs(self.VMAP_SHAPE, jnp.float32, "vmap")
    with numerics.kernel_mode():
      got = jax.jit(jax.vmap(self.bias_activation("silu"), in_axes=(1, None), out_axes=1))(x, b)
    want = reference.bias_activation(x, b, activation="silu")
    assert max(numerics.errors(got, want)) < 16 * numerics.F32_EPS


class TestElementwiseXla(ElementwiseTest):
  IMPL = "xla"


class TestElementwiseTriton(ElementwiseTest):
  IMPL = "triton"

  def test_persistent_bias_backward_uneven(self):
    """d(bias) over more row blocks than programs, column blocks narrower than the row."""
    config = elementwise_triton.Config(block_rows=4, block_cols=128, num_warps=4,
                                       bwd_block_rows=2, bwd_num_warps=4, bwd_programs=5)
    self.check_bias_activation((37, 300), jnp.float32, "gelu", "uneven", config=config)

  def test_backward_tiles_apart_from_the_forward(self):
    """The backward's own column block (the heuristic's forward tiles are narrower)."""
    config = elementwise_triton.Config(block_rows=8, block_cols=64, num_warps=4,
                                       bwd_block_rows=2, bwd_block_cols=256, bwd_num_warps=4,
                                       bwd_programs=3)
    self.check_bias_activation((37, 300), jnp.float32, "silu", "uneven", config=config)

  def test_lowers_for_cuda(self):
    x = jax.ShapeDtypeStruct((256, 1000), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((1000,), jnp.float32)
    for activation in ACTIVATIONS:
      text = cuda_lowering(lambda x, b, dy: jax.vjp(self.bias_activation(activation), x, b)[1](dy),
                           x, b, x)
      assert f'name = "jk_bias_{activation}_bwd"' in text
      # The kernels' arithmetic (_triton.MATH): without explicit FMAs XLA's Triton
      # pipeline emits separate multiplies and adds.
      if activation != "relu":
        for instruction in ("fma.rn.f32", "ex2.approx.ftz.f32", "rcp.approx.ftz.f32"):
          assert instruction in text, (activation, instruction)
      text = cuda_lowering(lambda g, u, dy: jax.vjp(self.glu(activation), g, u)[1](dy), x, x, x)
      assert f'name = "jk_glu_{activation}_bwd"' in text


  def test_glu_packed_reads_and_writes_in_place(self):
    """[gate | up] in, d[gate | up] out, each one array: the step around the kernels has no
    slice, pad, concatenation or add of the halves (a copy of each, forward and backward)."""
    x, dy = jnp.ones((64, 512), jnp.bfloat16), jnp.ones((64, 256), jnp.bfloat16)
    with numerics.kernel_mode():
      jaxpr = jax.make_jaxpr(
          lambda x, dy: jax.vjp(lambda x: jk.glu(x, implementation="triton"), x)[1](dy))(x, dy)
    top = {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}
    assert not top & {"slice", "pad", "concatenate", "add_any", "dynamic_slice"}, top
    def forward_and_backward(x, dy):
      y, vjp = jax.vjp(lambda x: jk.glu(x, implementation="triton"), x)
      return y, vjp(dy)

    text = cuda_lowering(
        forward_and_backward,
        jax.ShapeDtypeStruct((256, 2000), jnp.bfloat16),
        jax.ShapeDtypeStruct((256, 1000), jnp.bfloat16))
    assert 'name = "jk_glu_silu_bwd"' in text and 'name = "jk_glu_silu_fwd"' in text


class TestElementwiseMosaicGpu(ElementwiseTest):
  """Rows of whole 128-element vectors, interpreted with three CTAs (each a host thread). On
  request only until timed on a GPU."""

  IMPL = "mosaic_gpu"
  VMAP_SHAPE = (4, 6, 128)

  @pytest.fixture(autouse=True)
  def _three_ctas(self, monkeypatch):
    if not numerics.COMPILED:
      monkeypatch.setattr(_mosaic_gpu, "num_sms", lambda: 3)

  # (37, 384): an odd row count (one row a tile), one chunk; (2, 5, 4096): batched rows, two
  # column chunks (two CTAs each a chunk and one more for rows).
  GRID = numerics.grid(((37, 384), (2, 5, 4096)), ACTIVATIONS, center=((37, 384), "gelu"))

  @pytest.mark.parametrize("shape,activation", GRID)
  def test_bias_activation_float32(self, shape, activation):
    self.check_bias_activation(shape, jnp.float32, activation)

  @pytest.mark.parametrize("shape,activation", GRID)
  def test_glu_float32(self, shape, activation):
    self.check_glu(shape, jnp.float32, activation)

  @pytest.mark.parametrize("shape", ((37, 384), (2, 5, 4096)))
  @pytest.mark.parametrize("activation", ["gelu", "silu"])
  def test_glu_packed_float32(self, shape, activation):
    self.check_glu_packed(shape, jnp.float32, activation)

  @pytest.mark.parametrize("per_cta,bwd_per_cta,bwd_rows", [(0, 0, 0), (3, 3, 0), (0, 3, 1)])
  def test_both_walks(self, per_cta, bwd_per_cta, bwd_rows):
    """A persistent grid (per_cta 0: each CTA a fixed share, d(bias) summed over its row
    blocks), runs of three row blocks a CTA, the last one shorter, at an odd row count (one
    row a tile), and a persistent forward beside a backward in runs of its own one-row tiles
    (bias + erf's gelu's walk) at an even one."""
    config = elementwise_mosaic_gpu.Config(rows=2, stages=2, ctas_per_sm=1, bwd_stages=2,
                                           per_cta=per_cta, bwd_per_cta=bwd_per_cta,
                                           bwd_rows=bwd_rows)
    shape = (37, 384) if not bwd_rows else (38, 384)
    self.check_bias_activation(shape, jnp.float32, "gelu" if bwd_rows else "silu", "walk",
                               config=config)

  def test_backward_chunk(self):
    """Config.bwd_chunk: the backward walks 512-column chunks of a 2048-wide float32 row (the
    forward 2048), d(bias) summed per chunk; a chunk narrower than the row allows is refused
    by name."""
    config = elementwise_mosaic_gpu.Config(rows=1, stages=2, ctas_per_sm=1, bwd_stages=2,
                                           per_cta=2, bwd_per_cta=2, bwd_chunk=512)
    x = jnp.zeros((16, 2048), jnp.float32)
    grids = [elementwise_mosaic_gpu._Grid.of(16, 2048, config, backward, True, x)
             for backward in (False, True)]
    assert [g.row.chunk for g in grids] == [2048, 512], grids
    self.check_bias_activation((16, 2048), jnp.float32, "silu", "chunk", config=config)
    problem = Problem(jax.ShapeDtypeStruct((8, 384), jnp.float32), (), "bias_activation",
                      "silu")
    too_narrow = dataclasses.replace(config, bwd_chunk=128)
    assert "bwd_chunk=128" in elementwise_mosaic_gpu.config_error(problem, too_narrow,
                                                                   hardware.chip("H200"))
    with pytest.raises(ValueError, match="bwd_chunk"):
      dataclasses.replace(config, bwd_chunk=100)

  def test_narrow_chunks(self):
    """The heuristic's runs of several-row tiles (16 rows of 2816 bfloat16 columns: eleven
    256-wide chunks, 2 or 4 rows a tile): bias_activation and packed glu; glu's two inputs
    under SLOW."""
    x = jax.ShapeDtypeStruct((16, 2816), jnp.bfloat16)
    for op in ("bias_activation", "glu"):
      config = elementwise_mosaic_gpu.heuristic(Problem(x, (("x", x),), op, "silu"),
                                                hardware.chip("H200"))
      assert config.per_cta >= 1 and min(config.rows, config.walk(True)[0]) >= 2, config
    self.check_bias_activation(x.shape, x.dtype, "silu")
    self.check_glu_packed(x.shape, x.dtype, "silu")
    if numerics.SLOW or numerics.COMPILED:  # the same walk as packed's, two inputs
      self.check_glu(x.shape, x.dtype, "silu")

  def test_heuristic_walks(self):
    """Runs of RUN tiles a CTA (hardware-scheduled), d(bias)'s backward in longer runs, one
    tile a CTA where runs would leave SMs idle; bias + erf's gelu's forward persistent, its
    backward in runs. Dispatch prefers the kernels only where measured at Triton's time
    (notes/mgpurows.md mgpu-rows-2, mgpu-rows-3)."""
    chip = hardware.chip("H200")
    x = jax.ShapeDtypeStruct((16384, 4096), jnp.bfloat16)
    small = jax.ShapeDtypeStruct((96, 4096), jnp.bfloat16)  # 192 tiles: one a CTA
    for x, op, activation, want in (
        (x, "bias_activation", "silu", (2, 32)), (x, "glu", "silu", (2, 2)),
        (small, "bias_activation", "silu", (1, 1)), (x, "bias_activation", "gelu", (0, 32)),
        (x, "glu", "gelu", (2, 2))):
      problem = Problem(x, (("x", x),), op, activation)
      config = elementwise_mosaic_gpu.heuristic(problem, chip)
      assert (config.per_cta, config.bwd_per_cta) == want, (op, activation, config)
      assert elementwise_mosaic_gpu.config_error(problem, config, chip) is None
      assert elementwise_mosaic_gpu.on_auto(problem) == (
          op == "glu" or activation in ("silu", "relu"))
      if (op, activation) == ("bias_activation", "gelu") and x.shape[0] > 96:
        assert (config.rows, config.walk(True)[0]) == (4, 1), config
      elif x.shape[0] > 96:
        assert (config.rows, config.walk(True)[0]) == (1, 1), config

  def test_heuristic_narrow_chunks(self):
    """Rows whose chunks are narrow (2816 and 11008 columns: 256-wide chunks; 5504: 128) take
    runs of tiles of several rows, each step's inputs RUN_STEP_BYTES (forward, backward);
    one-row tiles of them ran at 1.3-3.3x Triton's time (notes/mgpurows.md mgpu-rows-4). An odd
    row count keeps one row a tile. bias_activation's backward keeps about BIAS_BWD_RUN rows
    a CTA."""
    chip = hardware.chip("H200")
    for (cols, glu_rows, bias_rows), rows in itertools.product(
        [(2816, (2, 2), (4, 2)), (11008, (2, 2), (4, 2)), (5504, (4, 4), (8, 4)),
         (5632, (1, 1), (2, 1)), (1408, (1, 1), (1, 1))], (16384, 16383)):
      x = jax.ShapeDtypeStruct((rows, cols), jnp.bfloat16)
      for op, want in (("glu", glu_rows), ("bias_activation", bias_rows)):
        problem = Problem(x, (("x", x),), op, "silu")
        config = elementwise_mosaic_gpu.heuristic(problem, chip)
        got = (config.rows, config.walk(True)[0])
        assert got == (want if rows % 2 == 0 else (1, 1)), (cols, rows, op, config)
        assert config.per_cta >= 1 and config.bwd_per_cta >= 1, config
        assert elementwise_mosaic_gpu.config_error(problem, config, chip) is None
        if op == "bias_activation" and rows % 2 == 0:
          assert config.bwd_per_cta * got[1] == elementwise_mosaic_gpu.BIAS_BWD_RUN, config

  def test_lowers_for_cuda_packed_in_place(self):
    """[gate | up] read and d[gate | up] written in place by one kernel each, no Triton."""
    def forward_and_backward(x, dy):
      y, vjp = jax.vjp(lambda x: jk.glu(x, implementation="mosaic_gpu"), x)
      return y, vjp(dy)

    text = cuda_lowering(forward_and_backward, jax.ShapeDtypeStruct((256, 8192), jnp.bfloat16),
                         jax.ShapeDtypeStruct((256, 4096), jnp.bfloat16))
    assert text.count("@mosaic_gpu_v2(") == 2 and _triton.CUSTOM_CALL not in text

  def test_reciprocal_is_one_instruction(self):
    """The activations' 1/x as rcp.approx.ftz (inline PTX in the row layout), not the
    approx_math lowering's seven instructions: a fifth of the issue-bound forward's
    (notes/mgpurows.md mgpu-rows-1)."""
    x = jax.ShapeDtypeStruct((256, 4096), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((4096,), jnp.float32)
    for text in (cuda_lowering(self.bias_activation("gelu"), x, b),
                 cuda_lowering(self.glu("silu"), x, x)):
      assert text.count("@mosaic_gpu_v2(") == 1 and "rcp.approx.ftz.f32" in text

  def test_unsupported_width_names_why(self):
    x = jnp.ones((4, 200), jnp.bfloat16)
    with numerics.kernel_mode():
      supported = jk.supports("glu", "mosaic_gpu", x, x, activation="silu")
    assert not supported and "x's last dimension is 200" in supported.reason


class TestElementwiseMosaicTpu(ElementwiseTest):
  IMPL = "mosaic_tpu"
  REFUSES = {jnp.dtype(jnp.float16): cases.NO_TPU_FLOAT16}

  def test_aot_compiles(self, tpu_mesh):
    """Both ops' backward at a large bfloat16 and a small float32 shape: each activation at
    one of them on CI, both at both under SLOW (each compile ~2 s)."""
    shapes = (((1024, 6144), jnp.bfloat16), ((37, 200), jnp.float32))
    for index, ((rows, cols), dtype) in enumerate(shapes):
      x = jax.ShapeDtypeStruct((rows, cols), dtype)
      b = jax.ShapeDtypeStruct((cols,), jnp.float32)
      everything = numerics.SLOW or numerics.COMPILED
      for activation in ("gelu", "silu") if everything else (("gelu", "silu")[index],):
        text = aot_compile(
            tpu_mesh, lambda x, b, dy: jax.vjp(self.bias_activation(activation), x, b)[1](dy),
            x, b, x)
        assert f"jk_bias_{activation}_bwd" in text
        text = aot_compile(tpu_mesh, lambda g, u, dy: jax.vjp(self.glu(activation), g, u)[1](dy),
                           x, x, x)
        assert f"jk_glu_{activation}_bwd" in text


class TestElementwiseErrors:
  def test_bias_length(self):
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
      jk.bias_activation(jnp.ones((2, 8)), jnp.ones(9), activation="gelu")

  def test_unknown_activation(self):
    with pytest.raises(ValueError, match="activation='tanh' is not one of"):
      jk.bias_activation(jnp.ones((2, 8)), jnp.ones(8), activation="tanh")

  def test_glu_shapes(self):
    with pytest.raises(ValueError, match=r"up must have the shape of gate, \(2, 8\)"):
      jk.glu(jnp.ones((2, 8)), jnp.ones((2, 4)))

  def test_glu_dtypes(self):
    with pytest.raises(TypeError, match="up must have gate's dtype float32, got bfloat16"):
      jk.glu(jnp.ones((2, 8)), jnp.ones((2, 8), jnp.bfloat16))

  def test_glu_packed_needs_an_even_last_axis(self):
    with pytest.raises(ValueError, match=r"gate holds \[gate \| up\].*even length; got shape "
                                         r"\(2, 7\)"):
      jk.glu(jnp.ones((2, 7)))

  def test_integer(self):
    with pytest.raises(TypeError, match="gate must have a floating dtype"):
      jk.glu(jnp.ones((2, 8), jnp.int8), jnp.ones((2, 8), jnp.int8))

  def test_config_invariants(self):
    with pytest.raises(ValueError, match="block_rows=3 must be a power of two"):
      elementwise_triton.Config(block_rows=3, block_cols=128, num_warps=4, bwd_block_rows=1,
                                bwd_num_warps=4, bwd_programs=1)
