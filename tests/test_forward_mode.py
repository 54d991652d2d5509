"""Forward-mode differentiation through every differentiable public op, on the kernel paths.

The kernels' backward is a ``jax.custom_vjp``, which JAX cannot differentiate forward. Under
forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``, forward over reverse) a call runs
its reference (``backend.forward_mode``): the tangents, and the values, are the XLA path's.
Reverse mode keeps the kernels and their backward. What cannot have both says so by name."""

from __future__ import annotations

import contextlib
import math
import re

import chex
import jax
import jax.numpy as jnp
import pytest

import jaxkernels as jk
from jaxkernels import testing
from tests import numerics

# The same reference both ways: only XLA's fusion of it (and, split, the shards' sums) differs,
# so the two float32 evaluations agree to the numerics rule's float32 floor, 4 eps sqrt(n) for
# sums of n terms (jaxkernels.testing; n <= 32 here). 1e-6 was tighter than the rule: a drawn
# seed split over 8 devices differed by 1.7e-6.
ATOL = RTOL = 4 * testing.F32_EPS * math.sqrt(32)


def _case(name):
  """(op(a, implementation) -> array, a): each op differentiated in its first input, small."""
  gen = numerics.rng("forward mode", name)
  x = numerics.normal(gen, (6, 32), jnp.float32)
  scale = numerics.normal(gen, (32,), jnp.float32, shift=1.0)
  w = numerics.normal(gen, (32, 24), jnp.float32, scale=0.2)
  labels = jnp.asarray(gen.integers(0, 24, (6,)), jnp.int32)
  q = numerics.normal(gen, (2, 8, 4, 16), jnp.float32)
  kv = numerics.normal(gen, (2, 8, 2, 16), jnp.float32)
  cases = {
      "rms_norm": (lambda a, impl: jk.rms_norm(a, scale, implementation=impl), x),
      "rms_norm+residual": (lambda a, impl: jk.rms_norm(a, scale, residual=2 * a,
                                                        implementation=impl)[0], x),
      "layer_norm": (lambda a, impl: jk.layer_norm(a, scale, scale, implementation=impl), x),
      "softmax": (lambda a, impl: jk.softmax(a, implementation=impl), x),
      "softmax_cross_entropy": (lambda a, impl: jk.softmax_cross_entropy(
          a, labels % 32, implementation=impl), x),
      "linear_softmax_cross_entropy": (lambda a, impl: jk.linear_softmax_cross_entropy(
          a, w, labels, implementation=impl), x),
      "matmul": (lambda a, impl: jk.matmul(a, w, activation="gelu", implementation=impl), x),
      "glu": (lambda a, impl: jk.glu(a[:, :16], a[:, 16:], implementation=impl), x),
      "matmul glu": (lambda a, impl: jk.matmul(a, w.reshape(32, 2, 12), glu=True,
                                               activation="silu", implementation=impl), x),
      "bias_activation": (lambda a, impl: jk.bias_activation(a, scale, activation="gelu",
                                                             implementation=impl), x),
      "flash_attention": (lambda a, impl: jk.flash_attention(a, kv, kv, causal=True,
                                                             implementation=impl), q),
      "decode_attention": (lambda a, impl: jk.decode_attention(
          a[:, :1], kv, kv, lengths=jnp.array([5, 8]), implementation=impl), q),
  }
  return cases[name]


OPS = ("rms_norm", "rms_norm+residual", "layer_norm", "softmax", "softmax_cross_entropy",
       "linear_softmax_cross_entropy", "matmul", "matmul glu", "glu", "bias_activation",
       "flash_attention",
       "decode_attention")


def _context(impl):
  """Where ``impl`` runs: interpreted on the CPU; None (the device's best) compiled."""
  return contextlib.nullcontext() if impl is None else jk.interpret_mode(impl)


def _served(op, impl, a):
  """Whether ``impl`` serves the call (else it would fall back, and there is nothing to show)."""
  if impl is None:
    return True
  with _context(impl):
    try:
      jax.eval_shape(lambda a: op(a, impl), a)
    except ValueError as e:
      if "cannot serve" in str(e):
        return False
      raise
  return True


# A kernel call in a jaxpr: pallas_call, or plgpu.kernel's mpmd_map (core_map on a JAX that
# binds that).
_KERNEL = re.compile(r"\b(pallas_call|mpmd_map|core_map)\[")


@pytest.mark.parametrize("impl", ["triton", "mosaic_tpu", "compiled"])
@pytest.mark.parametrize("name", OPS)
def test_forward_mode_agrees_with_the_xla_path(name, impl):
  """jax.jvp, jax.jacfwd and a Hessian-vector product (forward over reverse) on the kernel
  path (interpreted on the CPU; the device's own kernels compiled in the GPU check) against
  the same on implementation="xla"; the gradient still runs the kernel (a pallas_call in its
  program) and forward mode does not."""
  if (impl == "compiled") != numerics.COMPILED:
    pytest.skip("interpreted on the CPU, compiled on the GPU")
  impl = None if impl == "compiled" else impl
  op, a = _case(name)
  if not _served(op, impl, a):
    pytest.skip(f"{impl} does not serve {name} at this shape")
  t = numerics.normal(numerics.rng("tangent", name), a.shape, a.dtype)
  ours = lambda a: op(a, impl)
  xla = lambda a: op(a, "xla")
  square = lambda f: lambda a: jnp.sum(f(a).astype(jnp.float32) ** 2)
  with _context(impl):
    got = (jax.jvp(ours, (a,), (t,)), jax.jacfwd(ours)(a),
           jax.jvp(jax.grad(square(ours)), (a,), (t,)))
    forward = str(jax.make_jaxpr(lambda a, t: jax.jvp(ours, (a,), (t,)))(a, t))
    reverse = str(jax.make_jaxpr(jax.grad(square(ours)))(a))
  want = (jax.jvp(xla, (a,), (t,)), jax.jacfwd(xla)(a),
          jax.jvp(jax.grad(square(xla)), (a,), (t,)))
  chex.assert_trees_all_close(got, want, atol=ATOL, rtol=RTOL)
  # Compiled, the device's best may be XLA for a call (a fallback): then no kernel to keep.
  assert _KERNEL.search(reverse) or impl is None, "the gradient left the kernels"
  assert not _KERNEL.search(forward)


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
