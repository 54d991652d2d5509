"""rms_norm and layer_norm: every backend against the float64 oracle, forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxkernels as jk
from bench import shapes
from jaxkernels import _mosaic_gpu, _triton, hardware
from jaxkernels.ops.norms import mosaic_gpu as norms_mosaic_gpu
from jaxkernels.ops.norms import reference
from jaxkernels.ops.norms import triton as norms_triton
from jaxkernels.ops.norms.api import Problem
from tests import cases, numerics
from tests.conftest import aot_compile, cuda_lowering

EPS = 1e-5
SMALL = shapes.SMALL_ROWS
MOSAIC_GPU_CALL = "mosaic_gpu_v2"  # the custom call a Mosaic GPU kernel lowers to


def _reference(layer):
  def make(compute_dtype):
    def f(x, scale, bias, residual):
      if layer:
        return reference.layer_norm(x, scale, bias, eps=EPS, residual=residual,
                                    compute_dtype=compute_dtype)
      return reference.rms_norm(x, scale, eps=EPS, residual=residual,
                                compute_dtype=compute_dtype)
    return f
  return make


class NormTest:
  IMPL = "xla"
  REFUSES = {}  # dtype -> words of this backend's reason for refusing it (cases.check's refused)
  # Shapes of the single-shape tests: (rows..., width); a kernel class whose widths are
  # restricted (Mosaic GPU: whole 128-element vectors) draws its own.
  VMAP_SHAPE, CHECKPOINT_SHAPE, STREAM_SHAPE, EMPTY_WIDTH = (5, 3, 40), (24, 72), (40, 96), 8

  def op(self, layer, config=None):
    def f(x, scale, bias, residual):
      if layer:
        return jk.layer_norm(x, scale, bias, eps=EPS, residual=residual,
                             implementation=self.IMPL, config=config)
      return jk.rms_norm(x, scale, eps=EPS, residual=residual, implementation=self.IMPL,
                         config=config)
    return f

  def inputs(self, shape, dtype, layer, residual, residual_dtype=None, shift=0.0):
    gen = numerics.rng(type(self).__name__, shape, jnp.dtype(dtype).name, layer, residual, shift)
    n = shape[-1]
    x = numerics.normal(gen, shape, dtype, shift=shift)
    r = numerics.normal(gen, shape, residual_dtype or dtype) if residual else None
    s = numerics.normal(gen, (n,), jnp.float32, 0.2, 1.0)
    b = numerics.normal(gen, (n,), jnp.float32, 0.2) if layer else None
    dy = numerics.normal(gen, shape, dtype)
    dh = numerics.normal(gen, shape, residual_dtype or dtype) if residual else None
    return (x, s, b, r), ((dy, dh) if residual else dy)

  def check(self, layer, primals, ct, dtype, config=None):
    x, s, b, r = primals
    # A one-element row's gradient is eps / (x^2 + eps) times the cotangent, left over from
    # cancelling two nearly equal terms: ill-conditioned in every implementation; it runs,
    # unjudged.
    return cases.check("layer_norm" if layer else "rms_norm", self.IMPL, self.op(layer, config),
                       _reference(layer), primals, ct, dtype=dtype,
                       reduction=max(x.shape[-1], x.size // x.shape[-1]),
                       support=((x, s, b) if layer else (x, s), {"residual": r}),
                       judge_grads=x.shape[-1] != 1, refused=self.refused(x, r))

  def refused(self, x, residual):
    del residual
    return self.REFUSES.get(jnp.dtype(x.dtype))

  # Every shape with every variant compiled; interpreted, every shape as rms_norm and every
  # variant at (37, 200) (numerics.grid).
  @pytest.mark.parametrize("shape,variant", numerics.grid(
      SMALL + shapes.BATCHED, [(False, False), (True, False), (False, True), (True, True)],
      center=((37, 200), (False, False))))
  def test_float32(self, shape, variant):
    layer, residual = variant
    primals, ct = self.inputs(shape, jnp.float32, layer, residual)
    self.check(layer, primals, ct, jnp.float32)

  @pytest.mark.parametrize("dtype,layer,residual", numerics.grid(
      [jnp.bfloat16, jnp.float16], [True, False], [True, False]))
  def test_low_precision(self, dtype, layer, residual):
    primals, ct = self.inputs((64, 256), dtype, layer, residual)
    self.check(layer, primals, ct, dtype)

  @pytest.mark.parametrize("layer", [False, True])
  def test_float32_residual_stream(self, layer):
    """bf16 branch, float32 residual stream: h (and its gradient) stay float32."""
    primals, ct = self.inputs(self.STREAM_SHAPE, jnp.bfloat16, layer, True,
                              residual_dtype=jnp.float32)
    (y, h), grads = self.check(layer, primals, ct, jnp.bfloat16)
    assert (y.dtype, h.dtype) == (jnp.bfloat16, jnp.float32)
    assert (grads[0].dtype, grads[3].dtype) == (jnp.bfloat16, jnp.float32)

  def test_large_mean(self):
    """Rows far from zero: the statistics must not cancel away the variance."""
    primals, ct = self.inputs((16, 512), jnp.float32, True, False, shift=300.0)
    self.check(True, primals, ct, jnp.float32)

  def test_wide_rows(self):
    primals, ct = self.inputs(shapes.ODD_ROWS[-1], jnp.float32, True, True)
    self.check(True, primals, ct, jnp.float32)

  def test_jit_vmap_over_inner_axis(self):
    (x, s, _, _), _ = self.inputs(self.VMAP_SHAPE, jnp.float32, False, False)
    with numerics.kernel_mode():
      got = jax.jit(jax.vmap(lambda a: jk.rms_norm(a, s, eps=EPS, implementation=self.IMPL),
                             in_axes=1, out_axes=1))(x)
    want = reference.rms_norm(x, s, eps=EPS)
    assert max(numerics.errors(got, want)) < 8 * numerics.F32_EPS

  def test_checkpoint_grad(self):
    primals, ct = self.inputs(self.CHECKPOINT_SHAPE, jnp.float32, True, True)

    def loss(x, s, b, r):
      y, h = self.op(True)(x, s, b, r)
      return jnp.sum(y * ct[0]) + jnp.sum(h * ct[1])

    with numerics.kernel_mode():
      got = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2, 3)))(*primals)
    want = jax.grad(lambda *a: jnp.sum(_reference(True)(jnp.float32)(*a)[0] * ct[0]) +
                    jnp.sum(_reference(True)(jnp.float32)(*a)[1] * ct[1]),
                    argnums=(0, 1, 2, 3))(*primals)
    assert max(numerics.errors(got, want)) < 1e-5

  def test_empty(self):
    x = jnp.zeros((0, self.EMPTY_WIDTH), jnp.float32)
    with numerics.kernel_mode():
      y, h = jk.rms_norm(x, jnp.ones(self.EMPTY_WIDTH), residual=x, implementation=self.IMPL)
    assert y.shape == h.shape == x.shape


class TestNormsXla(NormTest):
  IMPL = "xla"


class TestNormsTriton(NormTest):
  IMPL = "triton"

  @pytest.mark.parametrize("layer", [False, True])
  def test_chunked_path(self, layer):
    """Rows wider than one register pass: statistics and output in chunks (Chan's merge)."""
    primals, ct = self.inputs((9, 300), jnp.float32, layer, True, shift=3.0)
    config = norms_triton.Config(block_rows=2, block_cols=64, num_warps=4, bwd_block_rows=2,
                                 bwd_num_warps=4, bwd_programs=3)
    assert not config.one_pass(300)
    self.check(layer, primals, ct, jnp.float32, config)

  def test_persistent_backward_uneven(self):
    """More row blocks than programs, unevenly: strided blocks, masked tail, summed partials."""
    primals, ct = self.inputs((37, 128), jnp.float32, True, True)
    config = norms_triton.Config(block_rows=4, block_cols=128, num_warps=4, bwd_block_rows=2,
                                 bwd_num_warps=4, bwd_programs=5)
    self.check(True, primals, ct, jnp.float32, config)

  @pytest.mark.parametrize("layer", [False, True])
  def test_lowers_for_cuda_with_named_kernels(self, layer):
    x = jax.ShapeDtypeStruct((256, 1000), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((1000,), jnp.float32)
    name = "layer" if layer else "rms"

    def loss(x, s, r):
      y, h = self.op(layer)(x, s, s if layer else None, r)
      return jnp.sum(y.astype(jnp.float32)) + jnp.sum(h.astype(jnp.float32))

    # value_and_grad: the loss needs the forward, so remat shows as a second forward kernel.
    plain = cuda_lowering(jax.value_and_grad(loss, argnums=(0, 1, 2)), x, s, x)
    remat = cuda_lowering(jax.value_and_grad(jax.checkpoint(
        loss, policy=jax.checkpoint_policies.nothing_saveable), argnums=(0, 1, 2)), x, s, x)
    fwd, bwd = f'name = "jk_{name}_norm_fwd"', f'name = "jk_{name}_norm_bwd"'
    assert (plain.count(fwd), plain.count(bwd)) == (1, 1)
    assert (remat.count(fwd), remat.count(bwd)) == (2, 1)  # the forward is recomputed


class TestNormsMosaicGpu(NormTest):
  """Rows of whole 128-element vectors (the widths the kernels take), interpreted with three
  CTAs (each a host thread), so that every CTA walks several rows and some one fewer."""

  IMPL = "mosaic_gpu"
  VMAP_SHAPE, CHECKPOINT_SHAPE, STREAM_SHAPE, EMPTY_WIDTH = (5, 3, 128), (7, 256), (9, 256), 128

  @pytest.fixture(autouse=True)
  def _three_ctas(self, monkeypatch):
    if not numerics.COMPILED:
      monkeypatch.setattr(_mosaic_gpu, "num_sms", lambda: 3)

  # (37, 384): a row of pieces of 192, one-element vectors; (2, 3, 128): batched rows.
  @pytest.mark.parametrize("shape,variant", numerics.grid(
      ((37, 384), (2, 3, 128), (130, 1024)),
      [(False, False), (True, False), (False, True), (True, True)],
      center=((37, 384), (True, True))))
  def test_float32(self, shape, variant):
    layer, residual = variant
    primals, ct = self.inputs(shape, jnp.float32, layer, residual)
    self.check(layer, primals, ct, jnp.float32)

  def test_wide_rows(self):
    numerics.slow_when_interpreted(60)
    primals, ct = self.inputs((6, 8192), jnp.bfloat16, True, True)
    self.check(True, primals, ct, jnp.bfloat16)

  @pytest.mark.parametrize("rows,bwd_rows,per_cta,in_registers",
                           [(2, 2, 0, False), (2, 1, 0, True), (2, 1, 3, False), (2, 2, 3, True)])
  def test_row_blocks(self, rows, bwd_rows, per_cta, in_registers):
    """Two rows a pipeline step; an odd row count takes one a step instead. Persistent grids
    (per_cta 0), and runs of three blocks a CTA, the last run shorter (forward and backward:
    the backward's partials then one a run). The backward's sums in shared memory and in
    registers."""
    for n in (10, 9):
      primals, ct = self.inputs((n, 256), jnp.float32, True, True)
      config = norms_mosaic_gpu.Config(stages=2, ctas_per_sm=1, bwd_stages=3,
                                       bwd_ctas_per_sm=1, rows=rows, bwd_rows=bwd_rows,
                                       per_cta=per_cta, bwd_per_cta=per_cta,
                                       bwd_sums_in_registers=in_registers)
      self.check(True, primals, ct, jnp.float32, config)

  def test_heuristic_walks(self):
    """The forward in runs of RUN blocks a CTA where two CTAs' rings fit an SM (one block a CTA
    where runs would leave SMs idle), a persistent grid where they do not (layer_norm's
    two-row blocks beside a float32 residual); the backward, with its partials a CTA, always
    persistent: rms_norm's without a residual three CTAs an SM, its sums in shared memory;
    layer_norm's sums in registers where they fit (notes/mgpurows.md mgpu-rows-2, mgpu-rows-3)."""
    chip = hardware.chip("H200")
    x = jax.ShapeDtypeStruct((16384, 4096), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((4096,), jnp.float32)
    f32 = jax.ShapeDtypeStruct((16384, 4096), jnp.float32)
    small = jax.ShapeDtypeStruct((64, 4096), jnp.bfloat16)  # fewer rows than SMs: one a CTA
    run = norms_mosaic_gpu.RUN
    wide = jax.ShapeDtypeStruct((1024, 8192), jnp.bfloat16)
    s8 = jax.ShapeDtypeStruct((8192,), jnp.float32)
    for rows, scale, layer, bias, residual, want, bwd in (
        (x, s, False, None, None, run, (1, 3, False)), (x, s, False, None, f32, run, None),
        (x, s, True, s, x, run, (2, 1, True)), (x, s, True, s, f32, 0, None),
        (x, s, True, s, None, run, (2, 1, True)), (small, s, False, None, small, 1, None),
        (wide, s8, True, s8, None, 0, (2, 1, False))):
      problem = Problem(rows, scale, bias, residual, layer)
      config = norms_mosaic_gpu.heuristic(problem, chip)
      assert (config.per_cta, config.bwd_per_cta) == (want, 0), (layer, residual, config)
      if bwd is not None:
        got = (config.bwd_rows, config.bwd_ctas_per_sm, config.bwd_sums_in_registers)
        assert got == bwd, (layer, bias, config)
      assert norms_mosaic_gpu.config_error(problem, config, chip) is None
    too_wide = norms_mosaic_gpu.Config(**{**config.__dict__, "bwd_sums_in_registers": True})
    assert "bwd_sums_in_registers=True" in norms_mosaic_gpu.config_error(problem, too_wide, chip)

  def test_checkpoint_grad(self):
    """Compiled, the numerics under remat; interpreted (the interpreter's callbacks cannot pass
    through remat), the CUDA lowering: the backward recomputes the statistics from h, so
    without a residual (h is x) it needs no forward at all, and remat recomputes none."""
    if numerics.COMPILED:
      return super().test_checkpoint_grad()
    x = jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((1024,), jnp.float32)

    def loss(x, s):
      return jnp.sum(self.op(False)(x, s, None, None).astype(jnp.float32))

    for policy in (None, jax.checkpoint_policies.nothing_saveable):
      fn = loss if policy is None else jax.checkpoint(loss, policy=policy)
      text = cuda_lowering(jax.value_and_grad(fn, argnums=(0, 1)), x, s)
      assert text.count(f"@{MOSAIC_GPU_CALL}(") == 2  # one forward, one backward

  @pytest.mark.parametrize("layer", [False, True])
  @pytest.mark.parametrize("residual", [None, jnp.bfloat16, jnp.float32])
  def test_widest_rows_fit_shared_memory(self, layer, residual):
    """At the widest rows dispatch offers the kernels (the shared-memory count of
    ``most_stages``), the heuristic's configs lower for CUDA: Mosaic GPU's allocator, which
    refuses a kernel over the SM's shared memory, agrees with the count."""
    chip = hardware.chip("H200")

    def problem(n, rows=4096):
      x = jax.ShapeDtypeStruct((rows, n), jnp.bfloat16)
      s = jax.ShapeDtypeStruct((n,), jnp.float32)
      r = None if residual is None else jax.ShapeDtypeStruct((rows, n), residual)
      return Problem(x, s, s if layer else None, r, layer)

    n = max(n for n in range(128, 32768, 128)
            if norms_mosaic_gpu.unsupported(problem(n, 8), chip) is None)
    assert norms_mosaic_gpu.unsupported(problem(n + 128, 8), chip) is not None
    p = problem(n)
    config = norms_mosaic_gpu.heuristic(p, chip)
    fwd = lambda x, s, b, r: norms_mosaic_gpu.forward(x, s, b, r, layer=layer, eps=EPS,
                                                      config=config)[:2]
    bwd = lambda h, s, b, dy, dh: norms_mosaic_gpu.backward(
        h, s, b, (), dy, dh, layer=layer, eps=EPS, config=config, residual_dtype=residual)
    cuda_lowering(fwd, p.x, p.scale, p.bias, p.residual)
    cuda_lowering(bwd, p.x if p.residual is None else p.residual, p.scale, p.bias, p.x,
                  p.residual)

  @pytest.mark.parametrize("bias", [False, True])
  @pytest.mark.parametrize("residual", [None, jnp.float32])
  def test_sums_in_registers_lower_for_cuda(self, bias, residual):
    """layer_norm's backward at the widest rows whose sums its registers hold (4096 with a
    bias, 8192 without): the heuristic asks for them there, and the kernel lowers for CUDA
    beside as many steps as its shared memory then holds."""
    chip = hardware.chip("H200")
    n = 4096 if bias else 8192
    x = jax.ShapeDtypeStruct((2048, n), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((n,), jnp.float32)
    r = None if residual is None else jax.ShapeDtypeStruct((2048, n), residual)
    p = Problem(x, s, s if bias else None, r, True)
    config = norms_mosaic_gpu.heuristic(p, chip)
    assert config.bwd_sums_in_registers, config
    wider = Problem(jax.ShapeDtypeStruct((2048, n + 128), jnp.bfloat16),
                    jax.ShapeDtypeStruct((n + 128,), jnp.float32),
                    jax.ShapeDtypeStruct((n + 128,), jnp.float32) if bias else None, None, True)
    assert not norms_mosaic_gpu.heuristic(wider, chip).bwd_sums_in_registers
    bwd = lambda h, s, b, dy, dh: norms_mosaic_gpu.backward(
        h, s, b, (), dy, dh, layer=True, eps=EPS, config=config, residual_dtype=residual)
    cuda_lowering(bwd, x if r is None else r, s, p.bias, x, r)

  @pytest.mark.parametrize("cols", [200, 129, 1])
  def test_unsupported_width_names_why(self, cols):
    x = jnp.ones((4, cols), jnp.bfloat16)
    with numerics.kernel_mode():
      supported = jk.supports("rms_norm", "mosaic_gpu", x, jnp.ones(cols))
    assert not supported and f"x's last dimension is {cols}" in supported.reason

  @pytest.mark.parametrize("layer", [False, True])
  def test_lowers_for_cuda(self, layer):
    """One forward and one backward kernel a call, Mosaic GPU's, and nothing from Triton."""
    x = jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16)
    r = jax.ShapeDtypeStruct((256, 1024), jnp.float32)
    s = jax.ShapeDtypeStruct((1024,), jnp.float32)

    def loss(x, s, r):
      y, h = self.op(layer)(x, s, s if layer else None, r)
      return jnp.sum(y.astype(jnp.float32)) + jnp.sum(h)

    text = cuda_lowering(jax.value_and_grad(loss, argnums=(0, 1, 2)), x, s, r)
    assert text.count(f"@{MOSAIC_GPU_CALL}(") == 2 and _triton.CUSTOM_CALL not in text


class TestNormsMosaicTpu(NormTest):
  IMPL = "mosaic_tpu"
  REFUSES = {jnp.dtype(jnp.float16): cases.NO_TPU_FLOAT16}

  def refused(self, x, residual):
    # The widest float32 rows with a residual: a block of 8 of them and their gradients'
    # exceed the VMEM of the chip it sizes for interpreted (TPU v4's), by design.
    if x.shape[-1] >= 20000 and x.dtype == jnp.float32 and residual is not None:
      return "too wide for TPU v4's VMEM"
    return super().refused(x, residual)

  def test_checkpoint_grad(self, tpu_mesh):
    """The TPU interpreter's callbacks cannot pass through remat: compile it for a TPU instead."""
    def loss(x, s, r):
      y, h = self.op(False)(x, s, None, r)
      return jnp.sum(y.astype(jnp.float32)) + jnp.sum(h.astype(jnp.float32))

    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((512,), jnp.float32)
    remat = jax.checkpoint(loss, policy=jax.checkpoint_policies.nothing_saveable)
    plain = aot_compile(tpu_mesh, jax.value_and_grad(loss, argnums=(0, 1, 2)), x, s, x)
    text = aot_compile(tpu_mesh, jax.value_and_grad(remat, argnums=(0, 1, 2)), x, s, x)
    assert "jk_rms_norm_bwd" in text
    assert text.count("jk_rms_norm_fwd") > plain.count("jk_rms_norm_fwd")  # recomputed

  @pytest.mark.parametrize("layer", [False, True])
  def test_aot_compiles(self, tpu_mesh, layer):
    def step(x, r, s, dy, dh):
      out, vjp = jax.vjp(lambda x, r, s: self.op(layer)(x, s, s if layer else None, r), x, r, s)
      return out, vjp((dy, dh))

    for (rows, cols), dtype in (((1024, 4096), jnp.bfloat16), ((37, 200), jnp.float32)):
      big = jax.ShapeDtypeStruct((rows, cols), dtype)
      vec = jax.ShapeDtypeStruct((cols,), jnp.float32)
      text = aot_compile(tpu_mesh, step, big, big, vec, big, big)
      name = "layer" if layer else "rms"
      assert f"jk_{name}_norm_fwd" in text and f"jk_{name}_norm_bwd" in text


class TestNormErrors:
  def test_rank(self):
    with pytest.raises(ValueError, match="x must have rank >= 1"):
      jk.rms_norm(jnp.float32(1.0), jnp.ones(1))

  def test_scale_shape(self):
    with pytest.raises(ValueError, match=r"scale must have shape \(8,\).*got shape \(7,\)"):
      jk.rms_norm(jnp.ones((2, 8)), jnp.ones(7))

  def test_bias_shape(self):
    with pytest.raises(ValueError, match="bias must have shape"):
      jk.layer_norm(jnp.ones((2, 8)), jnp.ones(8), jnp.ones((1, 8)))

  def test_residual_shape(self):
    with pytest.raises(ValueError, match=r"residual must have the shape of x, \(2, 8\)"):
      jk.rms_norm(jnp.ones((2, 8)), jnp.ones(8), residual=jnp.ones((8,)))

  def test_integer_dtype(self):
    with pytest.raises(TypeError, match="x must have a floating dtype.*int32"):
      jk.layer_norm(jnp.ones((2, 8), jnp.int32), jnp.ones(8))

  @pytest.mark.parametrize("eps", [0.0, -1e-6, float("nan")])
  def test_eps(self, eps):
    with pytest.raises(ValueError, match="eps must be a finite float > 0"):
      jk.rms_norm(jnp.ones((2, 8)), jnp.ones(8), eps=eps)

  def test_traced_eps(self):
    with pytest.raises(TypeError, match="eps must be a Python float"):
      jax.jit(lambda e: jk.rms_norm(jnp.ones((2, 8)), jnp.ones(8), eps=e))(1e-6)

  def test_zero_width(self):
    with pytest.raises(ValueError, match="last dimension is normalized and must be > 0"):
      jk.rms_norm(jnp.ones((2, 0)), jnp.ones(0))

  def test_unknown_implementation(self):
    with pytest.raises(ValueError, match="implementation='cuda' is not one of"):
      jk.rms_norm(jnp.ones((2, 8)), jnp.ones(8), implementation="cuda")

  @pytest.mark.cpu_only
  def test_kernel_on_cpu_arrays_outside_interpret_mode(self):
    with pytest.raises(ValueError, match="triton compiles for GPUs.*interpret_mode"):
      jk.rms_norm(jnp.ones((2, 8)), jnp.ones(8), implementation="triton")

  @pytest.mark.cpu_only
  def test_float16_on_tpu(self):
    with jk.interpret_mode(), pytest.raises(ValueError, match="float16 is not a TPU dtype"):
      jk.rms_norm(jnp.ones((2, 8), jnp.float16), jnp.ones(8), implementation="mosaic_tpu")

  @pytest.mark.cpu_only
  def test_config_type(self):
    config = norms_triton.Config(block_rows=1, block_cols=8, num_warps=4, bwd_block_rows=1,
                                 bwd_num_warps=4, bwd_programs=1)
    with jk.interpret_mode(), pytest.raises(TypeError, match="config for implementation="):
      jk.rms_norm(jnp.ones((2, 8)), jnp.ones(8), implementation="mosaic_tpu", config=config)

  def test_config_invariants(self):
    with pytest.raises(ValueError, match="block_cols=100 must be a power of two"):
      norms_triton.Config(block_rows=1, block_cols=100, num_warps=4, bwd_block_rows=1,
                          bwd_num_warps=4, bwd_programs=1)


def test_streamed_loads_ask_for_cg():
  """Pallas Triton needs _triton's shim to take cache_modifier=".cg" (jax 0.10-0.11); without
  it, streamed loads fall back to default caching and the norms lose 2-4 us (run 45)."""
  from jaxkernels import _triton
  assert _triton.stream_cache_modifier() == ".cg"


def test_shipped_h100_table_serves_the_model_s_norms():
  """The H100 table (tuned at the Llama presets' fused residual + RMSNorm) decodes into the
  Triton Config and is what an H100 call of that problem runs; another device keeps the
  heuristic."""
  from jaxkernels import backend, hardware, tuning
  from jaxkernels.ops.norms import api
  kernels = backend.kernels("rms_norm")["triton"]
  for rows, cols in ((16384, 1024), (8192, 2048)):
    x = jax.ShapeDtypeStruct((rows, cols), jnp.bfloat16)
    residual = jax.ShapeDtypeStruct((rows, cols), jnp.float32)
    scale = jax.ShapeDtypeStruct((cols,), jnp.bfloat16)
    problem = api.Problem.of(x, scale, None, residual, False)
    h100 = tuning.config_for(kernels, problem, hardware.chip("H100"),
                             device_kind="NVIDIA H100 80GB HBM3")
    assert isinstance(h100, norms_triton.Config)
    assert h100 != norms_triton.heuristic(problem, hardware.chip("H100"))
    assert h100.bwd_programs == 528 and h100.block_cols == cols
    h200 = tuning.config_for(kernels, problem, hardware.chip("H200"), device_kind="NVIDIA H200")
    assert h200 == norms_triton.heuristic(problem, hardware.chip("H200"))
