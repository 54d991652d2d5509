"""softmax: validation, dispatch and the custom_vjp boundary."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkernels import _checks, backend
from jaxkernels._pallas import rows_view
from jaxkernels.ops.softmax import mosaic_tpu, reference, triton

_KERNELS = {"triton": triton, "mosaic_tpu": mosaic_tpu}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _softmax(plan, x):
  return plan("forward", x)


def _softmax_fwd(plan, x):
  y = plan("forward", x)
  return y, y


def _softmax_bwd(plan, y, dy):
  return (plan("backward", y, dy),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def _validate(x, axis):
  x = _checks.array("softmax", "x", x)
  return x, _checks.axis("softmax", "axis", axis, x.ndim)


def _kernel_reasons(target, x):
  dtypes = _checks.kernel_dtype_reason(x=x)
  return {name: dtypes or module.unsupported(x, target.chip_for(name))
          for name, module in _KERNELS.items()}


def softmax(x, *, axis: int = -1, implementation=None, config=None):
  """Softmax along ``axis``, statistics in float32; a fully masked (all -inf) row gives zeros.

  Args:
    x: bfloat16, float16 or float32, any rank >= 1.
    axis: the axis normalised over. The kernels work on the last axis; another
      axis is moved last and back (two XLA transposes).
    implementation: None (best available), "xla", "triton" or "mosaic_tpu".
    config: the chosen kernel's Config; None picks one for the shape and device.
  """
  x, axis = _validate(x, axis)
  last = x.ndim - 1
  moved = jnp.moveaxis(x, axis, last) if axis != last else x
  target = backend.target_of(x)
  plan = backend.plan("softmax", implementation, target, _kernel_reasons(target, moved),
                      _KERNELS, config,
                      lambda kernels, chip: kernels.heuristic(rows_view(moved), chip),
                      empty=x.size == 0)
  if plan is None:  # also for no elements, where a (-1, 0) rows view is ambiguous
    return reference.softmax(x, axis=axis)
  y = _softmax(plan, rows_view(moved)).reshape(moved.shape)
  return jnp.moveaxis(y, last, axis) if axis != last else y


def _reasons(x, *, axis=-1, **unused):
  x, axis = _validate(x, axis)
  return _kernel_reasons(backend.target_of(x), jnp.moveaxis(x, axis, -1) if axis != x.ndim - 1 else x)


backend.register("softmax", _reasons)
