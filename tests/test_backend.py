"""Dispatch, the fallback warning, interpret mode, device detection, chip table and roofline."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import chex
import jax
import jax.numpy as jnp
import pytest

import jaxkernels as jk
from jaxkernels import backend, dispatch, hardware, interpret, roofline
from jaxkernels.dispatch import Target

CPU = Target("cpu", "cpu", True)
H200 = Target("gpu", "NVIDIA H200", True)
A100 = Target("gpu", "NVIDIA A100-SXM4-80GB", True)
BOTH = {"triton": None, "mosaic_tpu": None}


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
  monkeypatch.setattr(dispatch, "_WARNED", set())
  monkeypatch.delenv("JAXKERNELS_INTERPRET", raising=False)


def test_auto_on_cpu_falls_back_once_for_every_op_and_says_how_to_interpret():
  """A CPU has no kernel for any op: one line for the process (a train run on a CPU printed
  five, one an op), saying how to run the kernels interpreted instead."""
  with pytest.warns(jk.FallbackWarning) as record:
    assert dispatch.select("op", None, CPU, BOTH) == "xla"
  [said] = [str(w.message) for w in record]
  assert said.startswith("jaxkernels: no Pallas kernel runs on cpu: every op runs its XLA "
                         "reference. JAXKERNELS_INTERPRET=triton"), said
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert dispatch.select("op", None, CPU, BOTH) == "xla"  # one time only
    assert dispatch.select("other_op", None, CPU, BOTH) == "xla"  # for every op


@pytest.mark.cpu_only
def test_fallback_warning_names_the_callers_line(monkeypatch):
  # However deep the op's own frames go (select < plan < the op's helpers < the op), the
  # warning points at the line that called the public op.
  monkeypatch.setattr(dispatch, "_WARNED", set())  # it warns once a process
  x = jnp.ones((3, 5), jnp.float32)
  for op in (lambda: jk.softmax(x, axis=0), lambda: jk.rms_norm(x, jnp.ones((5,)), eps=1e-5),
             lambda: jk.glu(x, x), lambda: jk.matmul(x, x.T)):
    monkeypatch.setattr(dispatch, "_WARNED", set())  # on a CPU, one warning for every op
    with pytest.warns(jk.FallbackWarning) as record:
      op()
    assert record[0].filename == __file__, record[0].filename


def test_auto_on_gpu_prefers_a_kernel_and_names_why_not():
  assert dispatch.select("op", None, H200, BOTH) == "triton"
  with pytest.warns(jk.FallbackWarning, match="triton: rows too odd"):
    assert dispatch.select("op", None, H200, {"triton": "rows too odd"}) == "xla"


def test_a_kernel_on_request_is_the_second_choice():
  """Kernels(auto=False): slower than the kernel it would replace; dispatch passes over it
  where that one serves, serves a call that names it, and one that names none where no other
  kernel serves (before the XLA reference: a JAX without Pallas Triton)."""
  gpu_both = {"mosaic_gpu": None, "triton": None}
  assert dispatch.select("op", None, H200, gpu_both) == "mosaic_gpu"
  assert dispatch.select("op", None, H200, gpu_both, {"mosaic_gpu"}) == "triton"
  assert dispatch.select("op", "mosaic_gpu", H200, gpu_both, {"mosaic_gpu"}) == "mosaic_gpu"
  assert dispatch.choice(None, H200, gpu_both, {"mosaic_gpu"}) == "triton"
  no_triton = {"mosaic_gpu": None, "triton": "this JAX has no Pallas triton"}
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the second choice is no fallback: nothing to say
    assert dispatch.select("op", None, H200, no_triton, {"mosaic_gpu"}) == "mosaic_gpu"
  assert dispatch.choice(None, H200, no_triton, {"mosaic_gpu"}) == "mosaic_gpu"
  neither = {"mosaic_gpu": "rows too odd", "triton": "this JAX has no Pallas triton"}
  with pytest.warns(jk.FallbackWarning, match="mosaic_gpu: rows too odd"):
    assert dispatch.select("op", None, H200, neither, {"mosaic_gpu"}) == "xla"
  assert dispatch.on_request(backend.registered()["rms_norm"].kernels) == frozenset()
  # A predicate of the call: glu's Mosaic GPU kernels are preferred for every activation,
  # bias_activation's for silu and relu (forward+backward measured at Triton's time), on
  # request for gelu and gelu_tanh.
  glu, bias = backend.registered()["glu"], backend.registered()["bias_activation"]
  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
  for activation in ("gelu", "silu", "gelu_tanh", "relu"):
    problem = glu.problem(glu.validate(x, x, activation=activation))
    assert dispatch.on_request(glu.kernels, problem) == frozenset(), activation
  for activation, want in (("gelu", {"mosaic_gpu"}), ("silu", frozenset()),
                           ("gelu_tanh", {"mosaic_gpu"}), ("relu", frozenset())):
    problem = bias.problem(bias.validate(x, jax.ShapeDtypeStruct((512,), jnp.float32),
                                         activation=activation))
    assert dispatch.on_request(bias.kernels, problem) == want, activation
  assert dispatch.on_request(glu.kernels) == frozenset()  # no call: none never picked
  # flash_attention's Mosaic GPU kernels: on request only where the zero-padding is wider
  # than Triton's power-of-two tiles (head dims up to 32).
  attention = backend.registered()["flash_attention"]
  for h, want in ((64, frozenset()), (128, frozenset()), (96, frozenset()), (80, frozenset()),
                  (200, frozenset()), (48, frozenset()), (32, {"mosaic_gpu"}),
                  (16, {"mosaic_gpu"})):
    q = jax.ShapeDtypeStruct((1, 128, 2, h), jnp.bfloat16)
    problem = attention.problem(attention.validate(
        q, q, q, causal=True, scale=None, bias=None, segment_ids=None, kv_segment_ids=None,
        local_window_size=None, logits_soft_cap=None))
    assert dispatch.on_request(attention.kernels, problem) == want, h


def test_explicit_implementation_that_cannot_serve_raises():
  with pytest.raises(ValueError, match="implementation='triton' cannot serve this call: rows"):
    dispatch.select("op", "triton", H200, {"triton": "rows too odd"})
  with pytest.raises(ValueError, match="this op has no mosaic_gpu kernel"):
    dispatch.select("op", "mosaic_gpu", H200, BOTH)
  with pytest.raises(ValueError, match="mosaic_tpu compiles for TPUs"):
    dispatch.select("op", "mosaic_tpu", H200, BOTH)


@pytest.mark.parametrize("op,args", [
    ("matmul", (jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),) * 2),
    ("flash_attention", (jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16),) * 3)])
def test_each_mosaic_gpu_backend_refuses_a_gpu_that_is_not_hopper(op, args):
  """The Hopper gate is each Mosaic GPU backend's own (its ``unsupported``), not dispatch's: an
  A100, and a GPU the chip table does not know, get the reason; an H200 none."""
  from jaxkernels import backend
  registered = backend.registered()[op]
  problem = registered.problem(registered.validate(*args, **_DEFAULTS[op]))
  blackwell = Target("gpu", "NVIDIA B200", True)
  for target, want in ((A100, "the device is 'A100' (sm80)"),
                       (blackwell, "the device is 'NVIDIA B200' (unknown)"), (H200, None)):
    reason = dispatch.kernel_reasons(problem, target, registered.kernels)["mosaic_gpu"]
    if want is None:
      assert reason is None, reason
    else:
      assert reason.startswith("mosaic_gpu needs a Hopper GPU (sm90)") and want in reason, reason
  with pytest.raises(ValueError, match="mosaic_gpu needs a Hopper GPU"):
    dispatch.select(op, "mosaic_gpu", A100,
                    dispatch.kernel_reasons(problem, A100, registered.kernels))


_DEFAULTS = {
    "matmul": dict(bias=None, activation=None, residual=None, glu=False, out_dtype=None,
                   precision=None, a_scale=None, b_scale=None),
    "flash_attention": dict(causal=False, scale=None, bias=None, segment_ids=None,
                            kv_segment_ids=None, local_window_size=None, logits_soft_cap=None),
}


def test_explicit_kernel_is_taken_at_its_word_while_tracing():
  tracing = Target("cpu", "cpu", False)
  assert dispatch.select("op", "mosaic_tpu", tracing, BOTH) == "mosaic_tpu"


def test_interpret_mode_switch():
  assert not interpret.interpreting()
  with jk.interpret_mode():
    assert interpret.interpreting()
    assert dispatch.select("op", None, CPU, BOTH) == "mosaic_tpu"
    assert interpret.interpret_params("triton") is True
    assert type(interpret.interpret_params("mosaic_tpu")).__name__ == "InterpretParams"
  with jk.interpret_mode("triton"):
    assert dispatch.select("op", None, CPU, BOTH) == "triton"
  assert interpret.interpret_params("triton") is False
  with pytest.raises(ValueError, match="interpret_mode"):
    with jk.interpret_mode("cuda"):
      pass


def test_interpret_environment_variable(monkeypatch):
  monkeypatch.setenv("JAXKERNELS_INTERPRET", "triton")
  assert dispatch.select("op", None, CPU, BOTH) == "triton"
  monkeypatch.setenv("JAXKERNELS_INTERPRET", "yes please")
  with pytest.raises(ValueError, match="JAXKERNELS_INTERPRET='yes please' is not understood"):
    interpret.interpreting()


@pytest.mark.cpu_only
def test_target_of_concrete_traced_and_mesh(tpu_mesh):
  x = jnp.ones(3)
  assert dispatch.target_of(x) == Target("cpu", "cpu", True)
  seen = []
  jax.jit(lambda a: seen.append(dispatch.target_of(a)) or a)(x)
  assert seen[0].platform == "cpu" and not seen[0].concrete
  with jax.set_mesh(tpu_mesh):
    target = dispatch.target_of(jax.ShapeDtypeStruct((3,), jnp.float32))
  assert target.platform == "tpu" and target.chip.platform == "tpu"


def test_auto_dispatch_picks_the_tpu_kernel_for_a_tpu_mesh(tpu_mesh):
  from tests.conftest import aot_compile

  x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
  s = jax.ShapeDtypeStruct((256,), jnp.float32)
  assert "jk_rms_norm_fwd" in aot_compile(tpu_mesh, lambda x, s: jk.rms_norm(x, s), x, s)


@pytest.mark.cpu_only
def test_supports():
  verdict = jk.supports("rms_norm", "triton", jnp.ones((2, 8)), jnp.ones(8))
  assert not verdict and "interpret_mode" in verdict.reason
  assert jk.supports("rms_norm", "xla", jnp.ones((2, 8)), jnp.ones(8))
  with jk.interpret_mode():
    assert jk.supports("softmax", "triton", jnp.ones((2, 8)))
    assert not jk.supports("glu", "mosaic_tpu", jnp.ones((2, 8), jnp.float16),
                           jnp.ones((2, 8), jnp.float16))
  with pytest.raises(ValueError, match="unknown op 'conv'"):
    jk.supports("conv", "triton", jnp.ones((2, 2)))
  with pytest.raises(ValueError, match="scale must have shape"):
    jk.supports("rms_norm", "triton", jnp.ones((2, 8)), jnp.ones(3))


@pytest.mark.cpu_only
def test_supports_takes_the_arguments_as_the_op_does():
  """supports() binds its arguments to the public op's own signature and validates them as the
  op does: every form of call the op accepts (glu's packed [gate | up]), and each refusal the
  op's own (glu's packed form once raised a TypeError in supports alone; a wrong label shape
  passed supports and failed the op)."""
  x = jnp.ones((4, 8), jnp.float32)
  labels = jnp.zeros((4,), jnp.int32)
  with jk.interpret_mode("triton"):
    assert jk.supports("glu", "triton", x)
    assert jk.supports("glu", "triton", x, x, activation="gelu")
    assert jk.supports("linear_softmax_cross_entropy", "triton", x, jnp.ones((8, 16)), labels,
                       reduction="sum")
    calls = [  # (op, its positional arguments, keyword arguments)
        ("rms_norm", (x,), {}),
        ("rms_norm", (x, jnp.ones(8)), {"bias": jnp.ones(8)}),
        ("glu", (jnp.ones((4, 7)),), {}),
        ("softmax_cross_entropy", (jnp.ones((4, 16)), jnp.zeros((3,), jnp.int32)), {}),
        ("softmax_cross_entropy", (jnp.ones((4, 16)), labels), {"reduction": "max"}),
    ]
    for op, args, kwargs in calls:
      with pytest.raises((TypeError, ValueError)) as by_op:
        getattr(jk, op)(*args, **kwargs)
      with pytest.raises(by_op.type) as by_supports:
        jk.supports(op, "triton", *args, **kwargs)
      # The same complaint: the op's own words; a signature's TypeError (worded by Python's
      # call or by inspect's bind) names the same argument.
      said = str(by_op.value) if by_op.type is ValueError else str(by_op.value).split()[-1]
      assert said in str(by_supports.value), (op, str(by_op.value), str(by_supports.value))


def test_chip_table():
  assert hardware.chip_for("NVIDIA H200").name == "H200"
  assert hardware.chip_for("NVIDIA H100 80GB HBM3").cores == 132
  assert hardware.chip_for("TPU v5 lite").name == "TPU v5e"
  assert hardware.chip_for("TPU v6 lite").mxu == 256
  assert hardware.chip_for("TPU v5").cores == 2  # megacore
  assert hardware.chip_for("Quantum Abacus") is None
  h200 = hardware.chip("H200")
  assert h200.copy_bandwidth == h200.measured["copy_bandwidth"] < h200.hbm_bandwidth
  with pytest.raises(ValueError, match="unknown chip"):
    hardware.chip("H300")


def test_roofline():
  x = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)
  s = jax.ShapeDtypeStruct((4096,), jnp.float32)
  fwd = roofline.norm_fwd(x, s, None, x, layer=False)
  assert fwd.bytes == 4 * 1024 * 4096 * 2 + 4096 * 4  # x, residual in; y, h out; scale
  both = fwd + roofline.norm_bwd(x, s, None, x, layer=False)
  assert both.bytes > fwd.bytes and both.flops > fwd.flops
  h200 = hardware.chip("H200")
  assert fwd.bound_seconds(h200) == pytest.approx(fwd.bytes / 4.24e12)
  assert fwd.percent_of_roofline(fwd.bound_seconds(h200) * 2, h200) == pytest.approx(50.0)
  estimate = fwd.estimate()
  assert estimate.bytes_accessed == fwd.bytes and estimate.transcendentals == 1024


def test_a_missing_toolchain_api_is_reported_and_skipped(monkeypatch):
  """A JAX release whose Pallas lacks what a backend's kernels call: supports() says which
  names are missing, and dispatch takes the next kernel, not a failure inside tracing."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  monkeypatch.delattr(plgpu, "wgmma")
  dispatch.missing_api.cache_clear()  # asked once a process; asked again here, and after
  monkeypatch.setattr(dispatch, "missing_api", dispatch.missing_api.__wrapped__)
  H100 = Target("gpu", "NVIDIA H100 80GB HBM3", True)
  reasons = {"mosaic_gpu": None, "triton": None}
  assert dispatch.select("op", None, H100, reasons) == "triton"
  with pytest.raises(ValueError, match=r"has no wgmma in Pallas mosaic_gpu"):
    dispatch.select("op", "mosaic_gpu", H100, reasons)
  q = jnp.ones((1, 8, 2, 16), jnp.float32)
  support = jk.supports("flash_attention", "mosaic_gpu", q, q, q)
  assert not support and "wgmma" in support.reason


def test_the_package_imports_whatever_plgpu_load_takes():
  """jax 0.10's plgpu.load requires an index, 0.11's takes one optionally, 0.12's none: the
  package imports on each (jax 0.12 once failed at import on a signature probe), and the
  kernels' one shim reads which it is when a kernel is traced."""
  script = textwrap.dedent("""
      import inspect
      from jax.experimental.pallas import mosaic_gpu as plgpu
      real = plgpu.load
      variants = {  # "gone" first: the import itself once failed on it
          "gone": lambda src, *, layout=None, optimized=True: (src, ()),
          "required": lambda src, idx, *, layout=None, optimized=True: (src, idx),
      }
      for want, fake in variants.items():
        plgpu.load = fake
        import jaxkernels
        from jaxkernels import _mosaic_gpu
        _mosaic_gpu._load_index.cache_clear()
        assert _mosaic_gpu._load_index() == want, (want, _mosaic_gpu._load_index())
        assert _mosaic_gpu.load("ref", layout=None) == ("ref", ())
      print("ok")
  """)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_too_few_host_threads_for_an_interpreter_is_refused_before_it_hangs(monkeypatch):
  """The TPU interpreter's callbacks on N devices wait for each other (N + 1 threads), a GPU
  interpreter CTA's warpgroups too (8 a device): fewer, and the call is refused naming NPROC."""
  monkeypatch.setenv("NPROC", "8")
  interpret.check_interpreter_threads("op", "mosaic_gpu")  # 8 threads serve one device
  interpret.check_interpreter_threads("op", "triton")  # no callbacks
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((8,), ("x",))):
    with pytest.raises(ValueError, match=r"mosaic_tpu interpreter on 8 device\(s\) needs at "
                       r"least 9 host threads.*NPROC=8.*set NPROC=9.*JAXKERNELS_INTERPRET=triton"):
      interpret.check_interpreter_threads("op", "mosaic_tpu")
    monkeypatch.setenv("NPROC", "9")
    interpret.check_interpreter_threads("op", "mosaic_tpu")


def test_supports_a_composed_call_as_it_runs():
  """matmul(glu=True) where no kernel takes the gated product whole runs the product and then
  glu (its composition): supports() says yes where that composition runs on the kernel named,
  as the call itself does, and names the product's reason where it does not."""
  a, b = jnp.ones((8, 16), jnp.bfloat16), jnp.ones((16, 64), jnp.bfloat16)
  with interpret.interpret_mode():
    support = jk.supports("matmul", "triton", a, b, glu=True, activation="silu")
    assert support, support.reason
    y = jk.matmul(a, b, glu=True, activation="silu", implementation="triton")
    chex.assert_shape(y, (8, 32))
    refused = jk.supports("matmul", "triton", a.astype(jnp.int8), b.astype(jnp.int8), glu=True,
                          activation="silu")
    assert not refused and "int8" in refused.reason, refused.reason


def test_the_triton_files_deleted():
  """The day Pallas Triton goes and the Triton kernels' files with it, simulated: none of
  ``_triton_files.MODULES`` imports (nor Pallas Triton). The package imports; no op registers
  a Triton kernel; every op keeps the same Hopper kernel as on a JAX that merely lacks Pallas
  Triton (test_a_jax_without_pallas_triton), with no warning; an sm80 call falls back to XLA
  with the FallbackWarning saying the Triton kernels are not installed; the Hopper matmul's
  crop of a padded C is XLA's slice; and Hopper attention with a bias stays Mosaic GPU."""
  script = textwrap.dedent("""
      import sys
      import warnings

      def gone(name):  # the Triton files (by their names, as the structure test finds them)
        last = name.rpartition(".")[2]
        return (name == "jax.experimental.pallas.triton" or name.startswith("jaxkernels.")
                and "triton" in last and last != "_triton_files")

      class Deleted:
        def find_spec(self, name, path=None, target=None):
          if gone(name):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
          return None

      sys.meta_path.insert(0, Deleted())
      import jax.numpy as jnp
      import numpy as np
      import jaxkernels as jk
      from jaxkernels import _triton_files, backend, dispatch
      from jaxkernels.ops.matmul.mosaic_gpu import padding

      assert all(gone(name) for name in _triton_files.MODULES)
      assert not [name for name in sys.modules if gone(name)]
      registered = backend.registered()
      assert not [op for op, r in registered.items() if "triton" in r.kernels]
      A100 = dispatch.Target("gpu", "NVIDIA A100-SXM4-80GB", True)
      H200 = dispatch.Target("gpu", "NVIDIA H200", True)

      def chosen(op, target, *args, **kwargs):
        arguments = backend._REGISTRY[op].signature.bind(*args, **kwargs)
        arguments.apply_defaults()
        r = registered[op]
        problem = r.problem(r.validate(**{k: v for k, v in arguments.arguments.items()
                                          if k not in ("implementation", "config")}))
        reasons = dispatch.kernel_reasons(problem, target, r.kernels)
        with warnings.catch_warnings(record=True) as caught:
          warnings.simplefilter("always")
          picked = dispatch.select(op, None, target, reasons, dispatch.on_request(r.kernels))
        return picked, [str(w.message) for w in caught]

      x, s = jnp.ones((8, 128), jnp.bfloat16), jnp.ones((128,), jnp.bfloat16)
      q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
      cache = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
      calls = [("rms_norm", (x, s), {}), ("layer_norm", (x, s, s), {}), ("softmax", (x,), {}),
               ("bias_activation", (x, s), {"activation": "gelu"}), ("glu", (x, x), {}),
               ("softmax_cross_entropy", (jnp.ones((8, 256), jnp.bfloat16),
                                          jnp.zeros((8,), jnp.int32)), {}),
               ("matmul", (x, jnp.ones((128, 256), jnp.bfloat16)), {}),
               ("flash_attention", (q, q, q), {}),
               ("decode_attention", (cache[:, :1], cache, cache), {"lengths": jnp.array([64])})]
      for op, args, kwargs in calls:
        picked, warned = chosen(op, H200, *args, **kwargs)
        assert picked == "mosaic_gpu" and not warned, (op, picked, warned)
      picked, warned = chosen("rms_norm", A100, x, s)
      assert picked == "xla" and "triton kernels are not installed" in warned[0], warned
      bias = jnp.ones((1, 2, 128, 128), jnp.bfloat16)
      picked, warned = chosen("flash_attention", H200, q, q, q, bias=bias)
      assert picked == "mosaic_gpu" and not warned, (picked, warned)
      c = jnp.arange(24.0).reshape(4, 6)
      assert (np.asarray(padding.crop(c, 3, 5)) == np.asarray(c[:3, :5])).all()
      with jk.interpret_mode("mosaic_gpu"):  # a Mosaic GPU kernel still runs (interpreted)
        y = jk.rms_norm(x.astype(jnp.float32), s.astype(jnp.float32))
      np.testing.assert_allclose(np.asarray(y), 1.0, rtol=1e-6)
      print("ok")
  """)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu", "NPROC": "8"}, timeout=180)
  assert out.returncode == 0 and out.stdout.strip() == "ok", (out.stdout[-2000:] +
                                                              out.stderr[-3000:])


def test_a_jax_without_pallas_triton():
  """The day JAX removes Pallas Triton (deprecated since 0.11), simulated: its import fails.
  The package imports (``_triton`` is the one import of it); a call on an sm80 GPU, whose only
  kernel was Triton's, falls back to XLA with the FallbackWarning naming why; Hopper's Mosaic
  GPU kernels still serve matmul, attention, decode and every row op (softmax's and the
  activations' as the second choice); an explicit Triton kernel is refused by name;
  the Hopper matmul's crop of a padded C is XLA's slice; and the fused GLU product's gradient
  runs glu's backward on the Mosaic GPU kernel beside it (it asked for Triton's by name, and
  raised); attention with a bias lowers to four Mosaic GPU kernels (forward, dq, dk/dv and
  d(bias))."""
  script = textwrap.dedent("""
      import sys
      import warnings

      class Removed:  # the finder of a JAX without jax.experimental.pallas.triton
        def find_spec(self, name, path=None, target=None):
          if name == "jax.experimental.pallas.triton":
            raise ModuleNotFoundError(f"No module named {name!r}")
          return None

      sys.meta_path.insert(0, Removed())
      import jax
      import jax.numpy as jnp
      import numpy as np
      import jaxkernels as jk
      from jaxkernels import _triton, backend, dispatch
      from jaxkernels.ops.matmul.mosaic_gpu import padding

      assert _triton.pltriton is None
      A100 = dispatch.Target("gpu", "NVIDIA A100-SXM4-80GB", True)
      H200 = dispatch.Target("gpu", "NVIDIA H200", True)
      x, s = jnp.ones((8, 128), jnp.bfloat16), jnp.ones((128,), jnp.bfloat16)
      q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)

      def chosen(op, target, *args, **kwargs):
        registered = backend.registered()[op]
        arguments = backend._REGISTRY[op].signature.bind(*args, **kwargs)
        arguments.apply_defaults()
        problem = registered.problem(registered.validate(**{
            k: v for k, v in arguments.arguments.items() if k not in ("implementation",
                                                                      "config")}))
        reasons = dispatch.kernel_reasons(problem, target, registered.kernels)
        with warnings.catch_warnings(record=True) as caught:
          warnings.simplefilter("always")
          picked = dispatch.select(op, None, target, reasons,
                                   dispatch.on_request(registered.kernels))
        return picked, [str(w.message) for w in caught]

      picked, warned = chosen("rms_norm", A100, x, s)
      assert picked == "xla" and warned, (picked, warned)
      assert "triton: this JAX" in warned[0] and "has no Pallas triton" in warned[0], warned
      assert chosen("matmul", H200, x, jnp.ones((128, 256), jnp.bfloat16))[0] == "mosaic_gpu"
      assert chosen("flash_attention", H200, q, q, q)[0] == "mosaic_gpu"
      q32 = jnp.ones((1, 128, 2, 32), jnp.bfloat16)  # zero-padded to 64: on request
      assert chosen("flash_attention", H200, q32, q32, q32) == ("mosaic_gpu", []), q32.shape
      # Every row op and decode keeps a Hopper kernel: the norms', the loss's and decode's
      # preferred there, softmax's and the activations' (slower than Triton's where it
      # imports) as the second choice, before XLA.
      logits, labels = jnp.ones((8, 256), jnp.bfloat16), jnp.zeros((8,), jnp.int32)
      cache = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
      for op, args, kwargs in (
          ("rms_norm", (x, s), {}), ("layer_norm", (x, s, s), {}), ("softmax", (x,), {}),
          ("bias_activation", (x, s), {"activation": "gelu"}), ("glu", (x, x), {}),
          ("softmax_cross_entropy", (logits, labels), {}),
          ("decode_attention", (cache[:, :1].reshape(1, 1, 2, 64), cache, cache),
           {"lengths": jnp.array([64])})):
        picked, warned = chosen(op, H200, *args, **kwargs)
        assert picked == "mosaic_gpu" and not warned, (op, picked, warned)
      with jk.interpret_mode("triton"):
        refused = jk.supports("rms_norm", "triton", x, s)
        assert not refused and "no Pallas triton" in refused.reason, refused.reason
        dispatch._WARNED.clear()  # the same words as on the A100 above: once a process
        with warnings.catch_warnings(record=True) as caught:
          warnings.simplefilter("always")
          y = jk.rms_norm(x.astype(jnp.float32), s.astype(jnp.float32))
        assert any("no Pallas triton" in str(w.message) for w in caught), caught
        np.testing.assert_allclose(np.asarray(y), 1.0, rtol=1e-6)
      c = jnp.arange(24.0).reshape(4, 6)
      assert (np.asarray(padding.crop(c, 3, 5)) == np.asarray(c[:3, :5])).all()

      def grads(a, b):  # the fused GLU product's gradient: glu's backward beside it
        loss = lambda a, b: jnp.sum(jk.matmul(a, b, activation="silu", glu=True,
                                              implementation="mosaic_gpu").astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1))(a, b)

      text = jax.export.export(jax.jit(grads), platforms=["cuda"])(
          jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
          jax.ShapeDtypeStruct((128, 512), jnp.bfloat16)).mlir_module()
      assert text.count("@mosaic_gpu_v2(") == 4 and "jk_glu_silu_bwd_mgpu" in text, text[:500]
      # Halves of 192 columns, which glu's Mosaic GPU kernel does not take: the reference.
      text = jax.export.export(jax.jit(grads), platforms=["cuda"])(
          jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
          jax.ShapeDtypeStruct((128, 384), jnp.bfloat16)).mlir_module()
      assert text.count("@mosaic_gpu_v2(") == 3 and "jk_glu" not in text, text[:500]

      # A bias: its backward and gradient are Mosaic GPU kernels too.
      bias = jnp.ones((1, 2, 128, 128), jnp.bfloat16)
      picked, warned = chosen("flash_attention", H200, q, q, q, bias=bias)
      assert picked == "mosaic_gpu" and not warned, (picked, warned)
      attend = lambda q, b: jk.flash_attention(q, q, q, bias=b, implementation="mosaic_gpu")
      text = jax.export.export(jax.jit(jax.grad(lambda q, b: attend(q, b).sum(), (0, 1))),
                               platforms=["cuda"])(q, bias).mlir_module()
      assert text.count("@mosaic_gpu_v2(") == 4 and "jk_attention_dbias_mgpu" in text, (
          text.count("@mosaic_gpu_v2("))
      print("ok")
  """)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "ok", (out.stdout[-2000:] +
                                                              out.stderr[-3000:])
