"""rms_norm and layer_norm: validation, dispatch and the custom_vjp boundary."""

from __future__ import annotations

import functools

import jax

from jaxkernels import _checks, backend
from jaxkernels._pallas import rows_view
from jaxkernels.ops.norms import mosaic_tpu, reference, triton

_KERNELS = {"triton": triton, "mosaic_tpu": mosaic_tpu}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(plan, x, scale, bias, residual):
  return _fused_fwd(plan, x, scale, bias, residual)[0]


def _fused_fwd(plan, x, scale, bias, residual):
  y, h, stats = plan("forward", x, scale, bias, residual)
  if residual is not None:
    return (y, h), (h, scale, bias, stats)
  return y, (x, scale, bias, stats)


def _fused_bwd(plan, saved, cotangent):
  h, scale, bias, stats = saved
  has_residual = isinstance(cotangent, tuple)  # (dy, dh) for the outputs (y, h)
  dy, dh = cotangent if has_residual else (cotangent, None)
  dx, dr, dscale, dbias = plan("backward", h, scale, bias, stats, dy, dh,
                               residual_dtype=dh.dtype if has_residual else None)
  if has_residual and dr is None:
    dr = dx  # same dtype: one array serves both gradients, written once
  return dx, dscale, dbias, dr


_fused.defvjp(_fused_fwd, _fused_bwd)


def _validate(op, x, scale, bias, residual, eps):
  x = _checks.array(op, "x", x)
  if x.shape[-1] == 0:
    raise ValueError(f"{op}: x's last dimension is normalized and must be > 0, got shape {x.shape}")
  scale = _checks.vector(op, "scale", scale, x.shape[-1], "x")
  if bias is not None:
    bias = _checks.vector(op, "bias", bias, x.shape[-1], "x")
  if residual is not None:
    residual = _checks.same_shape(op, "residual", residual, x.shape, "x")
  return x, scale, bias, residual, _checks.positive_float(op, "eps", eps)


def _kernel_reasons(target, x, scale, bias, residual):
  dtypes = _checks.kernel_dtype_reason(x=x, scale=scale, bias=bias, residual=residual)
  return {
      name: dtypes or module.unsupported(x, scale, bias, residual, target.chip_for(name))
      for name, module in _KERNELS.items()
  }


def _norm(op, layer, x, scale, bias, residual, eps, implementation, config):
  x, scale, bias, residual, eps = _validate(op, x, scale, bias, residual, eps)
  target = backend.target_of(x, scale, bias, residual)
  rows = rows_view(x)
  residual_rows = rows_view(residual) if residual is not None else None
  plan = backend.plan(
      op, implementation, target, _kernel_reasons(target, x, scale, bias, residual), _KERNELS,
      config, lambda kernels, chip: kernels.heuristic(rows, scale, bias, residual_rows, chip,
                                                      layer=layer),
      empty=x.size == 0, layer=layer, eps=eps)
  if plan is None:
    if layer:
      return reference.layer_norm(x, scale, bias, eps=eps, residual=residual)
    return reference.rms_norm(x, scale, eps=eps, residual=residual)
  out = _fused(plan, rows, scale, bias, residual_rows)
  if residual is None:
    return out.reshape(x.shape)
  y, h = out
  return y.reshape(x.shape), h.reshape(x.shape)


def rms_norm(x, scale, *, eps: float = 1e-6, residual=None, implementation=None, config=None):
  """RMSNorm over the last axis, optionally fused with the residual add before it.

  Args:
    x: (..., N) bfloat16, float16 or float32.
    scale: (N,) multiplier.
    eps: added to the mean square; a Python float > 0.
    residual: optional array shaped like x. Then h = x + residual is formed in
      float32 and normalised in the same pass, and ``(y, h)`` is returned: the
      pre-norm transformer pattern in one read of x and residual, forward and
      backward. h keeps the residual's dtype, y takes x's.
    implementation: None (best available), "xla", "triton" or "mosaic_tpu".
    config: the chosen kernel's Config (``jaxkernels.ops.norms.triton.Config``,
      ``...mosaic_tpu.Config``); None picks one for the shape and device.

  Returns:
    y, or (y, h) with a residual. Statistics are float32 whatever the dtype.
  """
  return _norm("rms_norm", False, x, scale, None, residual, eps, implementation, config)


def layer_norm(x, scale, bias=None, *, eps: float = 1e-6, residual=None, implementation=None,
               config=None):
  """LayerNorm over the last axis (centred, scaled, optionally biased); see :func:`rms_norm`."""
  return _norm("layer_norm", True, x, scale, bias, residual, eps, implementation, config)


def _registered(op, layer):
  def reasons(x, scale, bias=None, *, eps=1e-6, residual=None, **unused):
    if not layer and bias is not None:
      raise TypeError("rms_norm takes no bias")
    x, scale, bias, residual, _ = _validate(op, x, scale, bias, residual, eps)
    return _kernel_reasons(backend.target_of(x, scale, bias, residual), x, scale, bias, residual)
  return reasons


backend.register("rms_norm", _registered("rms_norm", False))
backend.register("layer_norm", _registered("layer_norm", True))
