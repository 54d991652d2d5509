"""bias_activation and glu: validation, dispatch and the custom_vjp boundary."""

from __future__ import annotations

import dataclasses
import functools

import jax

from jaxkernels import _activations, _checks, backend, dispatch, partitioning
from jaxkernels._tiling import bucket, rows_struct, rows_view
from jaxkernels.ops.elementwise import mosaic_gpu, mosaic_tpu, reference


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
  """The call's rows on ``plan``'s kernels: (x, bias) for bias_activation, (gate, up) for glu
  (up None: gate holds [gate | up] side by side, its gradient one array)."""
  return plan.run(plan.kernels.forward, a, b)


def _fused_fwd(plan, a, b):
  # The backward recomputes the activation from the inputs.
  return plan.run(plan.kernels.forward, a, b), (a, b)


def _fused_bwd(plan, saved, dy):
  return plan.run(plan.kernels.backward, *saved, dy)


_fused.defvjp(_fused_fwd, _fused_bwd)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class BiasActivationArgs(backend.Args):
  """bias_activation's validated arguments: x (..., N), bias (N,)."""

  x: jax.Array
  bias: jax.Array
  activation: str


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class GluArgs(backend.Args):
  """glu's validated arguments: gate and up of one shape, or up None and gate [gate | up]."""

  gate: jax.Array
  up: jax.Array | None
  activation: str


def _validate_bias_activation(x, bias, *, activation) -> BiasActivationArgs:
  op = "bias_activation"
  x = _checks.array(op, "x", x)
  bias = _checks.vector(op, "bias", bias, x.shape[-1], "x")
  return BiasActivationArgs(
      x=x, bias=bias,
      activation=_checks.choice(op, "activation", activation, _activations.ACTIVATIONS))


def _validate_glu(gate, up=None, *, activation) -> GluArgs:
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
  return GluArgs(gate=gate, up=up,
                 activation=_checks.choice(op, "activation", activation,
                                           _activations.ACTIVATIONS))


def bias_activation(x, bias, *, activation: str, implementation=None, config=None):
  """activation(x + bias) in one pass over memory, forward and backward.

  Args:
    x: (..., N) bfloat16, float16 or float32.
    bias: (N,).
    activation: "gelu" (exact, erf), "gelu_tanh", "silu" or "relu".
    implementation: None (best available), "xla", "triton", "mosaic_gpu" (Hopper; asked for
      by name only until it is at Triton's speed) or "mosaic_tpu".
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
      as one matmul against the two weights side by side writes them: the GPU kernels read
      both halves in place and write the gradient as one (..., 2N) array, where two arrays
      would cost a copy of each half forward and a concatenation backward (3.1 ms each of a
      92 ms train step at 350m on an H100, notes/model.md model-3). The XLA reference and the
      Mosaic TPU kernels take the halves as slices.
    activation: applied to gate; "silu" by default.
    implementation, config: as for :func:`bias_activation`.
  """
  return backend.call(GLU, implementation, config, gate=gate, up=up, activation=activation)


def _halves(x):
  n = x.shape[-1] // 2
  return x[..., :n], x[..., n:]


def _glu_problem(args: GluArgs) -> Problem:
  gate, up = args.gate, args.up
  if up is None:  # [gate | up] side by side: the kernels see its two halves
    half = jax.ShapeDtypeStruct((*gate.shape[:-1], gate.shape[-1] // 2), gate.dtype)
    return Problem.of("glu", args.activation, gate=half, up=half)
  return Problem.of("glu", args.activation, gate=gate, up=up)


def _glu_kernel(plan: dispatch.Plan, args: GluArgs):
  gate, up = args.gate, args.up
  if up is None:  # the kernels take [gate | up] whole
    return _fused(plan, rows_view(gate), None).reshape(*gate.shape[:-1], gate.shape[-1] // 2)
  return _fused(plan, rows_view(gate), rows_view(up)).reshape(gate.shape)


def _glu_rule(args: GluArgs) -> partitioning.Rule:
  """The rows split freely; the last dimension too where gate and up come apart (elementwise),
  not where they sit side by side (each row's halves pair up: gathered, warned)."""
  if args.up is None:
    return partitioning.rows_rule({"gate": args.gate}, {}, -1, "mlp")
  return partitioning.rows_rule({"gate": args.gate, "up": args.up}, {}, None, "mlp")


def _glu_reference(args: GluArgs):
  gate, up = _halves(args.gate) if args.up is None else (args.gate, args.up)
  return reference.glu(gate, up, activation=args.activation)


def packed_glu_grad(x, dy, *, activation: str, implementation=None):
  """d[gate | up] of ``glu(x)`` (x = [gate | up] along its last axis) for the cotangent
  ``dy``, one array shaped like x: the backward alone, for a kernel that computed glu's
  output itself and saved x (``matmul(glu=True)``), on the kernels a glu call of x takes
  (its plan). Unsharded arrays."""
  plan = backend.plan_call(GLU, implementation, gate=x, up=None, activation=activation)
  if plan is None:
    _, vjp = jax.vjp(lambda x: _glu_reference(GluArgs(gate=x, up=None, activation=activation)),
                     x)
    return vjp(dy)[0]
  return _fused_bwd(plan, (rows_view(x), None), rows_view(dy))[0].reshape(x.shape)


_BIAS_ACTIVATION = backend.register(backend.Op(
    name="bias_activation",
    kernels={
        # On request but where measured at Triton's time (mosaic_gpu.AT_PARITY).
        "mosaic_gpu": dispatch.Kernels.of("bias_activation", "mosaic_gpu", mosaic_gpu,
                                          forward=mosaic_gpu.bias_activation_fwd,
                                          backward=mosaic_gpu.bias_activation_bwd,
                                          auto=mosaic_gpu.on_auto),
        **dispatch.triton_kernels("bias_activation", "jaxkernels.ops.elementwise.triton",
                                  forward="bias_activation_fwd",
                                  backward="bias_activation_bwd"),
        "mosaic_tpu": dispatch.Kernels.of("bias_activation", "mosaic_tpu", mosaic_tpu,
                                          forward=mosaic_tpu.bias_activation_fwd,
                                          backward=mosaic_tpu.bias_activation_bwd),
    },
    validate=_validate_bias_activation,
    problem=lambda args: Problem.of("bias_activation", args.activation, x=args.x,
                                    bias=args.bias),
    reference=lambda args: reference.bias_activation(args.x, args.bias,
                                                     activation=args.activation),
    kernel=lambda plan, args: _fused(plan, rows_view(args.x), args.bias).reshape(args.x.shape),
    options=lambda args: dict(activation=args.activation),
    rule=lambda args: partitioning.rows_rule({"x": args.x}, {"bias": args.bias}, None, "mlp"),
), bias_activation)

GLU = backend.register(backend.Op(
    name="glu",
    kernels={
        "mosaic_gpu": dispatch.Kernels.of("glu", "mosaic_gpu", mosaic_gpu,
                                          forward=mosaic_gpu.glu_fwd,
                                          backward=mosaic_gpu.glu_bwd, auto=mosaic_gpu.on_auto),
        **dispatch.triton_kernels("glu", "jaxkernels.ops.elementwise.triton",
                                  forward="glu_fwd", backward="glu_bwd"),
        "mosaic_tpu": dispatch.Kernels.of("glu", "mosaic_tpu", mosaic_tpu,
                                          forward=mosaic_tpu.glu_fwd, backward=mosaic_tpu.glu_bwd),
    },
    validate=_validate_glu,
    problem=_glu_problem,
    reference=_glu_reference,
    kernel=_glu_kernel,
    options=lambda args: dict(activation=args.activation),
    rule=_glu_rule,
), glu)
