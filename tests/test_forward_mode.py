"""Forward-mode differentiation through every differentiable public op, on the kernel paths.

The kernels' backward is a ``jax.custom_vjp``, which JAX cannot differentiate forward. Under
forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``, forward over reverse) a call runs
its reference (``backend.forward_mode``), which must agree with what the kernels compute: the
primal with the plain call, the tangent with the kernels' gradient. Reverse mode keeps the
kernels and their backward. What cannot have both says so by name."""

from __future__ import annotations

import contextlib
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkernels as jk
from jaxkernels import testing
from tests import numerics

# Two float32 evaluations of the same function (the reference under forward mode, the kernels
# or XLA's fusion of the reference otherwise) each within the numerics rule's float32 floor of
# the exact answer, 4 eps sqrt(n) for sums of n terms (jaxkernels.testing; n <= 32 here), differ
# by up to twice that. 1e-6 was tighter than the rule: a drawn seed split over 8 devices differed
# by 1.7e-6.
ATOL = RTOL = 4 * testing.F32_EPS * math.sqrt(32)


def _case(name, wide=False):
  """(op(a, implementation) -> array, a): each op differentiated in its first input; float32
  and small, or ``wide``: bfloat16 at widths Mosaic GPU takes (rows of whole 128-element
  vectors, heads of 128, 64-row tiles)."""
  gen = numerics.rng("forward mode", name, wide)
  dtype, rows, width, vocab, t, h = ((jnp.bfloat16, 128, 256, 384, 128, 128) if wide else
                                     (jnp.float32, 6, 32, 24, 8, 16))
  x = numerics.normal(gen, (rows, width), dtype)
  scale = numerics.normal(gen, (width,), jnp.float32, shift=1.0)
  w = numerics.normal(gen, (width, vocab), dtype, scale=0.2)
  w_glu = numerics.normal(gen, (width, 2, width // 2), dtype, scale=0.2)
  labels = jnp.asarray(gen.integers(0, vocab, (rows,)), jnp.int32)
  q = numerics.normal(gen, (2, t, 4, h), dtype)
  kv = numerics.normal(gen, (2, t, 2, h), dtype)
  half = width // 2
  cases = {
      "rms_norm": (lambda a, impl: jk.rms_norm(a, scale, implementation=impl), x),
      "rms_norm+residual": (lambda a, impl: jk.rms_norm(a, scale, residual=2 * a,
                                                        implementation=impl)[0], x),
      "layer_norm": (lambda a, impl: jk.layer_norm(a, scale, scale, implementation=impl), x),
      "softmax": (lambda a, impl: jk.softmax(a, implementation=impl), x),
      "softmax_cross_entropy": (lambda a, impl: jk.softmax_cross_entropy(
          a, labels % width, implementation=impl), x),
      "linear_softmax_cross_entropy": (lambda a, impl: jk.linear_softmax_cross_entropy(
          a, w, labels, implementation=impl), x),
      "matmul": (lambda a, impl: jk.matmul(a, w, activation="gelu", implementation=impl), x),
      "glu": (lambda a, impl: jk.glu(a[:, :half], a[:, half:], implementation=impl), x),
      "matmul glu": (lambda a, impl: jk.matmul(a, w_glu, glu=True, activation="silu",
                                               implementation=impl), x),
      "bias_activation": (lambda a, impl: jk.bias_activation(a, scale, activation="gelu",
                                                             implementation=impl), x),
      "flash_attention": (lambda a, impl: jk.flash_attention(a, kv, kv, causal=True,
                                                             implementation=impl), q),
      "decode_attention": (lambda a, impl: jk.decode_attention(
          a[:, :1], kv, kv, lengths=jnp.array([t - 3, t]), implementation=impl), q),
  }
  return cases[name]


OPS = ("rms_norm", "rms_norm+residual", "layer_norm", "softmax", "softmax_cross_entropy",
       "linear_softmax_cross_entropy", "matmul", "matmul glu", "glu", "bias_activation",
       "flash_attention",
       "decode_attention")


# A kernel call in a jaxpr: pallas_call, or plgpu.kernel's mpmd_map (core_map on a JAX that
# binds that).
_KERNEL = re.compile(r"\b(pallas_call|mpmd_map|core_map)\[")

# Where each case runs: (the implementation its calls name, which must serve them (None: the
# device's best, some kernel); whether compiled (None: either); the wide inputs or not). Interpreted on the CPU: Triton's and Mosaic TPU's kernels on float32,
# Mosaic GPU's on its bfloat16 widths (SLOW: the interpreter takes minutes for them all).
# Compiled on the GPU: the device's best on float32 (Triton's on Hopper), and Mosaic GPU's
# named on its widths, compiled.
PATHS = {
    "triton": ("triton", False, False),
    "mosaic_tpu": ("mosaic_tpu", False, False),
    "mosaic_gpu": ("mosaic_gpu", None, True),
    "compiled": (None, True, False),
}


def _path(path, name):
  """(implementation named, context, wide) for ``path``, or a skip where it runs on the other
  machine."""
  named, compiled, wide = PATHS[path]
  if compiled is not None and compiled != numerics.COMPILED:
    pytest.skip("interpreted on the CPU, compiled on the GPU")
  if path == "mosaic_gpu" and not (numerics.COMPILED or numerics.SLOW):
    pytest.skip("slow: the Mosaic GPU interpreter on every op (JAXKERNELS_TEST_SLOW=1); "
                "compiled in the GPU check")
  if path == "mosaic_gpu" and "matmul" in name and not numerics.COMPILED:
    pytest.skip("the Mosaic GPU interpreter hangs on the product's heuristic schedule and has "
                "no TransposeTransform for its backward (tests/test_cases.py): compiled only")
  return named, numerics.kernel_mode(named), wide


def _vdot(a, b) -> float:
  return float(np.sum(np.asarray(a, np.float64) * np.asarray(b, np.float64)))


def _largest(a) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64))))


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("name", OPS)
def test_forward_mode_agrees_with_the_kernels_reverse_mode(name, path):
  """jax.jvp on a kernel path (the reference runs under forward mode, by design) against the
  kernels themselves: its primal against the plain call, and its tangent J t against the
  kernels' gradient J^T c by <c, J t> = <J^T c, t>. So forward mode that drifts from what the
  kernels compute fails (a planted 5% error in what forward mode runs did not fail the test
  this replaces, which compared the reference with itself). The plain call and the gradient
  ran on the kernels (none fell back), and forward mode's program holds no kernel call."""
  named, context, wide = _path(path, name)
  op, a = _case(name, wide)
  gen = numerics.rng("tangent", name, wide)
  t = numerics.normal(gen, a.shape, a.dtype)
  ours = lambda a: op(a, named)
  # float32 products in float32 (a GPU's default takes them in TF32, 10 bits: the fused loss's
  # reference under forward mode was 1.3e-3 off the kernels' on an H100); 16-bit operands'
  # products are exact in their float32 sums already (and Mosaic GPU's refuses a precision).
  precise = (jax.default_matmul_precision("highest") if a.dtype == jnp.float32
             else contextlib.nullcontext())
  with context, precise:
    with testing.served() as forward_calls:
      primal, tangent = jax.jvp(ours, (a,), (t,))
      forward = str(jax.make_jaxpr(lambda a, t: jax.jvp(ours, (a,), (t,)))(a, t))
    with numerics.served_by(named):
      plain = ours(a)
      out, vjp = jax.vjp(ours, a)
      c = numerics.normal(gen, out.shape, out.dtype)
      (grad,) = vjp(c)
  assert {s.implementation for s in forward_calls} == {"xla"}, forward_calls
  assert not _KERNEL.search(forward), "forward mode ran a kernel"
  # Each side within the rule's floor of the exact (float32), or within its dtype's rounding
  # of it (each element of a 16-bit result is rounded once more): the difference is at most
  # twice that, relative to the largest element.
  eps = float(jnp.finfo(a.dtype).eps) if wide else 0.0
  bound = 2 * (eps + 4 * testing.F32_EPS * math.sqrt(a.shape[-1]))
  assert max(numerics.errors(primal, plain)) <= bound, (numerics.errors(primal, plain), bound)
  # <c, J t> and <J^T c, t> in float64, each term's error within the bound of its largest
  # factor: a sum of such terms is off by at most the bound times the sums of magnitudes.
  forward_side, reverse_side = _vdot(c, tangent), _vdot(grad, t)
  allowed = bound * (_largest(tangent) * float(np.sum(np.abs(np.asarray(c, np.float64))))
                     + _largest(grad) * float(np.sum(np.abs(np.asarray(t, np.float64)))))
  assert abs(forward_side - reverse_side) <= allowed, (forward_side, reverse_side, allowed)


@pytest.mark.cpu_only
def test_reverse_over_forward_and_hessian_run():
  """jax.hessian (forward over reverse) and a gradient of a jvp (reverse over forward): both
  put a JVP trace on the stack, both run the reference, both agree with XLA's path."""
  op, a = _case("rms_norm")
  a = a[:2]
  t = jnp.ones_like(a)
  results = {}
  for impl in ("triton", "xla"):
    f = lambda a, impl=impl: jnp.sum(jnp.tanh(op(a, impl)))
    with jk.interpret_mode("triton"):
      results[impl] = (jax.hessian(f)(a), jax.grad(lambda a: jax.jvp(f, (a,), (t,))[1])(a))
  chex.assert_shape(results["triton"][0], (*a.shape, *a.shape))
  chex.assert_trees_all_close(results["triton"], results["xla"], atol=ATOL, rtol=RTOL)


@pytest.mark.cpu_only
def test_fp8_matmul_refuses_forward_mode_by_name():
  """fp8_matmul's gradient is a training rule (quantized operands, a custom_vjp on every
  backend), not the derivative of its forward: forward mode says so, on every backend."""
  x = jnp.ones((128, 128), jnp.float32)
  w = jnp.ones((128, 128), jnp.float32)
  for run in (lambda: jax.jvp(lambda x: jk.fp8_matmul(x, w), (x,), (x,)),
              lambda: jax.jacfwd(lambda x: jk.fp8_matmul(x, w).sum())(x)):
    with pytest.raises(ValueError, match=r"fp8_matmul: forward-mode differentiation .*"
                       r"with jax\.grad, or use jk\.matmul"):
      run()


@pytest.mark.cpu_only
def test_forward_mode_runs_split_and_refuses_the_ring_by_name():
  """Over 8 host devices (Explicit axes): the batch split, jax.jvp runs per shard on the
  reference and agrees with the unsplit XLA path; the sequence split (ring attention, whose
  passes are a custom_vjp) raises naming flash_attention and the way out."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  gen = numerics.rng("forward mode split")
  q = numerics.normal(gen, (4, 16, 2, 16), jnp.float32)
  t = numerics.normal(gen, q.shape, jnp.float32)
  attend = lambda impl: lambda q: jk.flash_attention(q, q, q, causal=True, implementation=impl)
  want = jax.jvp(attend("xla"), (q,), (t,))
  for spec in (P("data"), P("data", "model")):
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, t)]
    with jax.set_mesh(mesh), jk.interpret_mode("triton"):
      run = jax.jit(lambda q, t: jax.jvp(attend("triton"), (q,), (t,)))
      if spec == P("data"):
        chex.assert_trees_all_close(run(*placed), want, atol=ATOL, rtol=RTOL)
        continue
      with pytest.raises(ValueError, match=r"flash_attention: forward-mode differentiation .* "
                         r"ring attention .* reverse mode \(jax\.grad\)"):
        run(*placed)


@pytest.mark.cpu_only
def test_linearize_is_what_cannot_have_both():
  """The minimal case: jax.linearize linearizes as jax.grad does (JAX's LinearizeTrace, no JVP
  trace on the stack), so a call cannot tell a user's linearize from a gradient; on a kernel
  path the kernels' custom_vjp is linearized and JAX refuses to apply its linear function
  forward. The XLA path linearizes; jax.jvp on the kernel path gives the same tangent."""
  op, a = _case("rms_norm")
  t = jnp.ones_like(a)
  _, linear = jax.linearize(lambda a: op(a, "xla"), a)
  want = jax.jvp(lambda a: op(a, "xla"), (a,), (t,))[1]
  chex.assert_trees_all_close(linear(t), want, atol=ATOL, rtol=RTOL)
  with jk.interpret_mode("triton"):
    _, linear = jax.linearize(lambda a: op(a, "triton"), a)
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
      linear(t)
    chex.assert_trees_all_close(jax.jvp(lambda a: op(a, "triton"), (a,), (t,))[1], want,
                                atol=ATOL, rtol=RTOL)
