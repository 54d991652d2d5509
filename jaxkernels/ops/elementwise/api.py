"""bias_activation and glu: validation, dispatch and the custom_vjp boundary."""

from __future__ import annotations

import dataclasses
import functools

import jax

from jaxkernels import _activations, _checks, backend, partitioning
from jaxkernels._tiling import bucket, rows_struct, rows_view
from jaxkernels.ops.elementwise import mosaic_tpu, reference, triton


@dataclasses.dataclass(frozen=True)
class Problem:
  """One bias_activation or glu call as its kernels see it: x, the first operand's (M, N)
  rows; the operands by name (for the dtype check); the op and activation."""

  x: jax.ShapeDtypeStruct
  operands: tuple[tuple[str, jax.ShapeDtypeStruct], ...]
  op: str
  activation: str

  @classmethod
  def of(cls, op: str, activation: str, **named) -> Problem:
    first = next(iter(named.values()))
    return cls(rows_struct(first), tuple((k, jax.ShapeDtypeStruct(v.shape, v.dtype)) for k, v in named.items()),
               op, activation)

  def key(self) -> str:
    rows, cols = self.x.shape
    return f"{self.x.dtype}|{self.activation}|{bucket(rows)}x{cols}"

  def reason(self) -> str | None:
    return _checks.kernel_dtype_reason(**dict(self.operands))

  def __str__(self) -> str:
    return f"{self.op}({self.activation}) of {self.x.shape} {self.x.dtype}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(plan, a, b):
  return plan.run(plan.kernels.forward, a, b)


def _fused_fwd(plan, a, b):
  # The backward recomputes the activation from the inputs.
  return plan.run(plan.kernels.forward, a, b), (a, b)


def _fused_bwd(plan, saved, dy):
  return plan.run(plan.kernels.backward, *saved, dy)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _plan(op, implementation, config, activation, **named):
  """The kernel plan for this call, or None for the XLA reference."""
  first = next(iter(named.values()))
  target = backend.target_of(*named.values())
  return backend.plan(op, implementation, target, Problem.of(op, activation, **named),
                      _KERNELS[op], config, empty=first.size == 0, activation=activation)


def _validate_bias_activation(x, bias, activation):
  op = "bias_activation"
  x = _checks.array(op, "x", x)
  bias = _checks.vector(op, "bias", bias, x.shape[-1], "x")
  return x, bias, _checks.choice(op, "activation", activation, _activations.ACTIVATIONS)


def _validate_glu(gate, up, activation):
  op = "glu"
  gate = _checks.array(op, "gate", gate)
  up = _checks.same_shape(op, "up", up, gate.shape, "gate")
  if up.dtype != gate.dtype:
    raise TypeError(f"{op}: up must have gate's dtype {gate.dtype}, got {up.dtype}")
  return gate, up, _checks.choice(op, "activation", activation, _activations.ACTIVATIONS)


def _validate_glu_packed(x, activation):
  op = "glu"
  x = _checks.array(op, "gate", x)
  if x.ndim == 0 or x.shape[-1] % 2:
    raise ValueError(f"{op}: with up=None, gate holds [gate | up] side by side along its last "
                     f"axis, which must have an even length; got shape {tuple(x.shape)}")
  return x, _checks.choice(op, "activation", activation, _activations.ACTIVATIONS)


def bias_activation(x, bias, *, activation: str, implementation=None, config=None):
  """activation(x + bias) in one pass over memory, forward and backward.

  Args:
    x: (..., N) bfloat16, float16 or float32.
    bias: (N,).
    activation: "gelu" (exact, erf), "gelu_tanh", "silu" or "relu".
    implementation: None (best available), "xla", "triton" or "mosaic_tpu".
    config: the chosen kernel's Config; None picks one for the shape and device.

  Returns:
    An array shaped and typed like x. The backward recomputes the activation
    from x and bias, and reduces d(bias) in the same pass that writes dx.
  """
  x, bias, activation = _validate_bias_activation(x, bias, activation)
  split, out = partitioning.rowwise(
      "bias_activation", implementation,
      lambda x, bias: bias_activation(x, bias, activation=activation,
                                      implementation=implementation, config=config),
      rows={"x": x}, vectors={"bias": bias}, reduced=None, feature="mlp")
  if split:
    return out
  plan = _plan("bias_activation", implementation, config, activation, x=x, bias=bias)
  if plan is None:
    return reference.bias_activation(x, bias, activation=activation)
  return _fused(plan, rows_view(x), bias).reshape(x.shape)


def glu(gate, up=None, *, activation: str = "silu", implementation=None, config=None):
  """activation(gate) * up in one pass: SwiGLU ("silu"), GeGLU ("gelu", "gelu_tanh").

  Args:
    gate, up: (..., N) arrays of one shape and dtype (bfloat16, float16, float32). With
      ``up=None``, ``gate`` holds both side by side, [gate | up] along its last axis (..., 2N),
      as one matmul against the two weights side by side writes them: the Triton kernels read
      both halves in place and write the gradient as one (..., 2N) array, where two arrays
      would cost a copy of each half forward and a concatenation backward (3.1 ms each of a
      92 ms train step at 350m on an H100, bench/NOTES.md model-3). The XLA reference and the
      Mosaic TPU kernels take the halves as slices.
    activation: applied to gate; "silu" by default.
    implementation, config: as for :func:`bias_activation`.
  """
  if up is None:
    return _glu_packed(gate, activation, implementation, config)
  gate, up, activation = _validate_glu(gate, up, activation)
  split, out = partitioning.rowwise(
      "glu", implementation,
      lambda gate, up: glu(gate, up, activation=activation, implementation=implementation,
                           config=config),
      rows={"gate": gate, "up": up}, reduced=None, feature="mlp")
  if split:
    return out
  plan = _plan("glu", implementation, config, activation, gate=gate, up=up)
  if plan is None:
    return reference.glu(gate, up, activation=activation)
  return _fused(plan, rows_view(gate), rows_view(up)).reshape(gate.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _packed(plan, x):
  return plan.run(triton.glu_packed_fwd, x)


def _packed_fwd(plan, x):
  return plan.run(triton.glu_packed_fwd, x), x


def _packed_bwd(plan, x, dy):
  return (plan.run(triton.glu_packed_bwd, x, dy),)


_packed.defvjp(_packed_fwd, _packed_bwd)


def _packed_plan(x, activation, implementation, config, *arrays):
  """(plan, half) for glu of x = [gate | up]: the kernel plan (None: the XLA reference) for
  the two halves, each ``half`` (where ``arrays`` live)."""
  half = jax.ShapeDtypeStruct((*x.shape[:-1], x.shape[-1] // 2), x.dtype)
  plan = backend.plan("glu", implementation, backend.target_of(*arrays),
                      Problem.of("glu", activation, gate=half, up=half), _KERNELS["glu"], config,
                      empty=x.size == 0, activation=activation)
  return plan, half


def _glu_packed(x, activation, implementation, config):
  """glu of x = [gate | up] along the last axis."""
  op = "glu"
  x, activation = _validate_glu_packed(x, activation)
  # The halves pair up within a row: a split last axis is gathered (the rule's warning).
  split, out = partitioning.rowwise(
      op, implementation,
      lambda gate: _glu_packed(gate, activation, implementation, config),
      rows={"gate": x}, reduced=-1, feature="mlp")
  if split:
    return out
  plan, half = _packed_plan(x, activation, implementation, config, x)
  if plan is not None and plan.implementation == "triton":
    return _packed(plan, rows_view(x)).reshape(half.shape)
  n = half.shape[-1]
  gate, up = x[..., :n], x[..., n:]
  if plan is None:
    return reference.glu(gate, up, activation=activation)
  return _fused(plan, rows_view(gate), rows_view(up)).reshape(half.shape)


def packed_glu_grad(x, dy, *, activation: str, implementation=None):
  """d[gate | up] of ``glu(x)`` (x = [gate | up] along its last axis) for the cotangent
  ``dy``, one array shaped like x: the backward alone, for a kernel that computed glu's
  output itself and saved x (``matmul(glu=True)``). Unsharded arrays."""
  plan, _ = _packed_plan(x, activation, implementation, None, x, dy)
  if plan is not None and plan.implementation == "triton":
    return plan.run(triton.glu_packed_bwd, rows_view(x), rows_view(dy)).reshape(x.shape)
  _, vjp = jax.vjp(lambda x: _glu_packed(x, activation, implementation, None), x)
  return vjp(dy)[0]


def _bias_activation_problem(x, bias, *, activation, **unused):
  x, bias, activation = _validate_bias_activation(x, bias, activation)
  return Problem.of("bias_activation", activation, x=x, bias=bias), (x, bias)


def _glu_problem(gate, up, *, activation, **unused):
  if up is None:  # [gate | up] side by side: the kernels see its two halves
    gate, activation = _validate_glu_packed(gate, activation)
    half = jax.ShapeDtypeStruct((*gate.shape[:-1], gate.shape[-1] // 2), gate.dtype)
    return Problem.of("glu", activation, gate=half, up=half), (gate,)
  gate, up, activation = _validate_glu(gate, up, activation)
  return Problem.of("glu", activation, gate=gate, up=up), (gate, up)


_KERNELS = {
    "bias_activation": backend.register("bias_activation", {
        "triton": backend.Kernels.of("bias_activation", "triton", triton,
                                     forward=triton.bias_activation_fwd,
                                     backward=triton.bias_activation_bwd),
        "mosaic_tpu": backend.Kernels.of("bias_activation", "mosaic_tpu", mosaic_tpu,
                                         forward=mosaic_tpu.bias_activation_fwd,
                                         backward=mosaic_tpu.bias_activation_bwd),
    }, _bias_activation_problem, bias_activation),
    "glu": backend.register("glu", {
        "triton": backend.Kernels.of("glu", "triton", triton, forward=triton.glu_fwd,
                                     backward=triton.glu_bwd),
        "mosaic_tpu": backend.Kernels.of("glu", "mosaic_tpu", mosaic_tpu,
                                         forward=mosaic_tpu.glu_fwd, backward=mosaic_tpu.glu_bwd),
    }, _glu_problem, glu),
}
