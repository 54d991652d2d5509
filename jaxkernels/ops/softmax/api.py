"""softmax: validation, dispatch and the custom_vjp boundary."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxkernels import _checks, backend, dispatch, partitioning
from jaxkernels._tiling import bucket, rows_view
from jaxkernels.ops.softmax import mosaic_gpu, mosaic_tpu, reference

OP = "softmax"


@dataclasses.dataclass(frozen=True)
class Problem:
  """One softmax call as its kernels see it: x as (M, N) rows, the softmax axis last."""

  x: jax.ShapeDtypeStruct

  @classmethod
  def of(cls, x, axis: int) -> Problem:
    rows = math.prod(d for i, d in enumerate(x.shape) if i != axis)
    return cls(jax.ShapeDtypeStruct((rows, x.shape[axis]), x.dtype))

  def key(self) -> str:
    rows, cols = self.x.shape
    return f"{self.x.dtype}|{bucket(rows)}x{cols}"

  def reason(self) -> str | None:
    return _checks.kernel_dtype_reason(x=self.x)

  def __str__(self) -> str:
    return f"softmax of {self.x.shape} {self.x.dtype}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _softmax(plan, x):
  return plan.run(plan.kernels.forward, x)


def _softmax_fwd(plan, x):
  y = plan.run(plan.kernels.forward, x)
  return y, y


def _softmax_bwd(plan, y, dy):
  return (plan.run(plan.kernels.backward, y, dy),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Args(backend.Args):
  """A softmax call's validated arguments: x, and the axis as a non-negative index."""

  x: jax.Array
  axis: int


def _validate(x, axis) -> Args:
  x = _checks.array(OP, "x", x)
  return Args(x=x, axis=_checks.axis(OP, "axis", axis, x.ndim))


def _kernel(plan: dispatch.Plan, args: Args):
  x, axis = args.x, args.axis
  last = x.ndim - 1
  moved = jnp.moveaxis(x, axis, last) if axis != last else x
  y = _softmax(plan, rows_view(moved)).reshape(moved.shape)
  return jnp.moveaxis(y, last, axis) if axis != last else y


def softmax(x, *, axis: int = -1, implementation=None, config=None):
  """Softmax along ``axis``, statistics in float32; a fully masked (all -inf) row gives zeros.

  Args:
    x: bfloat16, float16 or float32, any rank >= 1.
    axis: the axis normalised over. The kernels work on the last axis; another
      axis is moved last and back (two XLA transposes).
    implementation: None (best available), "xla", "triton", "mosaic_gpu" (Hopper; asked for
      by name only until it is at Triton's speed) or "mosaic_tpu".
    config: the chosen kernel's Config; None picks one for the shape and device.
  """
  return backend.call(_OP, implementation, config, x=x, axis=axis)


_OP = backend.register(backend.Op(
    name=OP,
    kernels={
        "mosaic_gpu": dispatch.Kernels.of(OP, "mosaic_gpu", mosaic_gpu,
                                         forward=mosaic_gpu.forward,
                                         backward=mosaic_gpu.backward),
        **dispatch.triton_kernels(OP, "jaxkernels.ops.softmax.triton", forward="forward",
                                  backward="backward"),
        "mosaic_tpu": dispatch.Kernels.of(OP, "mosaic_tpu", mosaic_tpu,
                                         forward=mosaic_tpu.forward, backward=mosaic_tpu.backward),
    },
    validate=_validate,
    problem=lambda args: Problem.of(args.x, args.axis),
    # no elements: the reference, where a (-1, 0) rows view is ambiguous
    reference=lambda args: reference.softmax(args.x, axis=args.axis),
    kernel=_kernel,
    rule=lambda args: partitioning.rows_rule({"x": args.x}, {}, args.axis, "embed"),
), softmax)
