"""bias_activation and glu: validation, dispatch and the custom_vjp boundary."""

from __future__ import annotations

import functools

import jax

from jaxkernels import _activations, _checks, backend
from jaxkernels._pallas import rows_view
from jaxkernels.ops.elementwise import mosaic_tpu, reference, triton

_KERNELS = {"triton": triton, "mosaic_tpu": mosaic_tpu}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused(plan, op, a, b):
  return plan(f"{op}_fwd", a, b)


def _fused_fwd(plan, op, a, b):
  return plan(f"{op}_fwd", a, b), (a, b)  # the backward recomputes the activation from these


def _fused_bwd(plan, op, saved, dy):
  return plan(f"{op}_bwd", *saved, dy)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _kernel_reasons(target, first, named):
  dtypes = _checks.kernel_dtype_reason(**named)
  return {name: dtypes or module.unsupported(first, target.chip_for(name))
          for name, module in _KERNELS.items()}


def _plan(op, implementation, config, activation, **named):
  """The kernel plan for this call, or None for the XLA reference."""
  first = next(iter(named.values()))
  target = backend.target_of(*named.values())
  return backend.plan(op, implementation, target, _kernel_reasons(target, first, named),
                      _KERNELS, config,
                      lambda kernels, chip: kernels.heuristic(rows_view(first), chip, op=op,
                                                              activation=activation),
                      empty=first.size == 0, activation=activation)


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
  plan = _plan("bias_activation", implementation, config, activation, x=x, bias=bias)
  if plan is None:
    return reference.bias_activation(x, bias, activation=activation)
  return _fused(plan, "bias_activation", rows_view(x), bias).reshape(x.shape)


def glu(gate, up, *, activation: str = "silu", implementation=None, config=None):
  """activation(gate) * up in one pass: SwiGLU ("silu"), GeGLU ("gelu", "gelu_tanh").

  Args:
    gate, up: (..., N) arrays of one shape and dtype (bfloat16, float16, float32).
    activation: applied to gate; "silu" by default.
    implementation, config: as for :func:`bias_activation`.
  """
  gate, up, activation = _validate_glu(gate, up, activation)
  plan = _plan("glu", implementation, config, activation, gate=gate, up=up)
  if plan is None:
    return reference.glu(gate, up, activation=activation)
  return _fused(plan, "glu", rows_view(gate), rows_view(up)).reshape(gate.shape)


def _registered(validate, names):
  def reasons(a, b, *, activation="silu", **unused):
    a, b, _ = validate(a, b, activation)
    return _kernel_reasons(backend.target_of(a, b), a, dict(zip(names, (a, b))))
  return reasons


backend.register("bias_activation", _registered(_validate_bias_activation, ("x", "bias")))
backend.register("glu", _registered(_validate_glu, ("gate", "up")))
