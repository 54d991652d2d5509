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


def _validate_bias_activation(x, bias, *, activation):
  op = "bias_activation"
  x = _checks.array(op, "x", x)
  bias = _checks.vector(op, "bias", bias, x.shape[-1], "x")
  return dict(x=x, bias=bias,
              activation=_checks.choice(op, "activation", activation, _activations.ACTIVATIONS))


def _validate_glu(gate, up=None, *, activation):
  op = "glu"
  gate = _checks.array(op, "gate", gate)
  if up is None:
    if gate.ndim == 0 or gate.shape[-1] % 2:
      raise ValueError(f"{op}: with up=None, gate holds [gate | up] side by side along its "
                       f"last axis, which must have an even length; got shape "
                       f"{tuple(gate.shape)}")
  else:
    up = _checks.same_shape(op, "up", up, gate.shape, "gate")
    if up.dtype != gate.dtype:
      raise TypeError(f"{op}: up must have gate's dtype {gate.dtype}, got {up.dtype}")
  return dict(gate=gate, up=up,
              activation=_checks.choice(op, "activation", activation, _activations.ACTIVATIONS))


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
  return backend.call(_BIAS_ACTIVATION, implementation, config, x=x, bias=bias,
                      activation=activation)


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
  return backend.call(_GLU, implementation, config, gate=gate, up=up, activation=activation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _packed(plan, x):
  return plan.run(triton.glu_packed_fwd, x)


def _packed_fwd(plan, x):
  return plan.run(triton.glu_packed_fwd, x), x


def _packed_bwd(plan, x, dy):
  return (plan.run(triton.glu_packed_bwd, x, dy),)


_packed.defvjp(_packed_fwd, _packed_bwd)


def _halves(x):
  n = x.shape[-1] // 2
  return x[..., :n], x[..., n:]


def _glu_problem(gate, up, activation):
  if up is None:  # [gate | up] side by side: the kernels see its two halves
    half = jax.ShapeDtypeStruct((*gate.shape[:-1], gate.shape[-1] // 2), gate.dtype)
    return Problem.of("glu", activation, gate=half, up=half)
  return Problem.of("glu", activation, gate=gate, up=up)


def _glu_kernel(plan, gate, up, activation):
  del activation  # in the plan's options
  if up is None:
    out_shape = (*gate.shape[:-1], gate.shape[-1] // 2)
    if plan.implementation == "triton":  # reads both halves in place
      return _packed(plan, rows_view(gate)).reshape(out_shape)
    gate, up = _halves(gate)
  return _fused(plan, rows_view(gate), rows_view(up)).reshape(gate.shape)


def _glu_rule(gate, up, activation):
  """The rows split freely; the last dimension too where gate and up come apart (elementwise),
  not where they sit side by side (each row's halves pair up: gathered, warned)."""
  del activation
  if up is None:
    return partitioning.rows_rule({"gate": gate}, {}, -1, "mlp")
  return partitioning.rows_rule({"gate": gate, "up": up}, {}, None, "mlp")


def packed_glu_grad(x, dy, *, activation: str, implementation=None):
  """d[gate | up] of ``glu(x)`` (x = [gate | up] along its last axis) for the cotangent
  ``dy``, one array shaped like x: the backward alone, for a kernel that computed glu's
  output itself and saved x (``matmul(glu=True)``). Unsharded arrays."""
  args = _validate_glu(x, activation=activation)
  plan = backend.plan("glu", implementation, backend.target_of(x, dy), _glu_problem(**args),
                      _GLU.kernels, None, empty=x.size == 0, activation=activation)
  if plan is not None and plan.implementation == "triton":
    return plan.run(triton.glu_packed_bwd, rows_view(x), rows_view(dy)).reshape(x.shape)
  _, vjp = jax.vjp(lambda x: glu(x, activation=activation, implementation=implementation), x)
  return vjp(dy)[0]


_BIAS_ACTIVATION = backend.register(backend.Op(
    name="bias_activation",
    kernels={
        "triton": backend.Kernels.of("bias_activation", "triton", triton,
                                     forward=triton.bias_activation_fwd,
                                     backward=triton.bias_activation_bwd),
        "mosaic_tpu": backend.Kernels.of("bias_activation", "mosaic_tpu", mosaic_tpu,
                                         forward=mosaic_tpu.bias_activation_fwd,
                                         backward=mosaic_tpu.bias_activation_bwd),
    },
    validate=_validate_bias_activation,
    problem=lambda x, bias, activation: Problem.of("bias_activation", activation, x=x,
                                                   bias=bias),
    reference=reference.bias_activation,
    kernel=lambda plan, x, bias, activation: _fused(plan, rows_view(x), bias).reshape(x.shape),
    options=lambda activation, **unused: dict(activation=activation),
    rule=lambda x, bias, activation: partitioning.rows_rule({"x": x}, {"bias": bias}, None,
                                                            "mlp"),
), bias_activation)

_GLU = backend.register(backend.Op(
    name="glu",
    kernels={
        "triton": backend.Kernels.of("glu", "triton", triton, forward=triton.glu_fwd,
                                     backward=triton.glu_bwd),
        "mosaic_tpu": backend.Kernels.of("glu", "mosaic_tpu", mosaic_tpu,
                                         forward=mosaic_tpu.glu_fwd, backward=mosaic_tpu.glu_bwd),
    },
    validate=_validate_glu,
    problem=_glu_problem,
    reference=lambda gate, up, activation: reference.glu(
        *(_halves(gate) if up is None else (gate, up)), activation=activation),
    kernel=_glu_kernel,
    options=lambda activation, **unused: dict(activation=activation),
    rule=_glu_rule,
), glu)
