"""rms_norm and layer_norm: validation, dispatch and the custom_vjp boundary."""

from __future__ import annotations

import dataclasses
import functools

import jax

from jaxkernels import _checks, backend, dispatch, partitioning
from jaxkernels._tiling import bucket, rows_struct, rows_view
from jaxkernels.ops.norms import mosaic_gpu, mosaic_tpu, reference


@dataclasses.dataclass(frozen=True)
class Problem:
  """One norm call as its kernels see it: x and the residual as (M, N) rows, scale and bias as
  (N,), and which norm."""

  x: jax.ShapeDtypeStruct
  scale: jax.ShapeDtypeStruct
  bias: jax.ShapeDtypeStruct | None
  residual: jax.ShapeDtypeStruct | None
  layer: bool

  @classmethod
  def of(cls, x, scale, bias, residual, layer: bool) -> Problem:
    vector = lambda v: None if v is None else jax.ShapeDtypeStruct(v.shape, v.dtype)
    return cls(rows_struct(x), vector(scale), vector(bias), rows_struct(residual), layer)

  def key(self) -> str:
    rows, cols = self.x.shape
    residual = self.residual.dtype if self.residual is not None else "none"
    return (f"{self.x.dtype}|residual:{residual}|bias:{self.bias is not None}|"
            f"{bucket(rows)}x{cols}")

  def reason(self) -> str | None:
    return _checks.kernel_dtype_reason(x=self.x, scale=self.scale, bias=self.bias,
                                       residual=self.residual)

  def __str__(self) -> str:
    return f"{'layer' if self.layer else 'rms'}_norm of {self.x.shape} {self.x.dtype}"


def _kernels(op):
  """rms_norm's and layer_norm's kernels: one pair of entry points per backend serves both."""
  return {
      "mosaic_gpu": dispatch.Kernels.of(op, "mosaic_gpu", mosaic_gpu,
                                       forward=mosaic_gpu.forward,
                                       backward=mosaic_gpu.backward),
      **dispatch.triton_kernels(op, "jaxkernels.ops.norms.triton", forward="forward",
                                backward="backward"),
      "mosaic_tpu": dispatch.Kernels.of(op, "mosaic_tpu", mosaic_tpu,
                                       forward=mosaic_tpu.forward, backward=mosaic_tpu.backward),
  }


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(plan, x, scale, bias, residual):
  return _fused_fwd(plan, x, scale, bias, residual)[0]


def _fused_fwd(plan, x, scale, bias, residual):
  y, h, stats = plan.run(plan.kernels.forward, x, scale, bias, residual)
  if residual is not None:
    return (y, h), (h, scale, bias, stats)
  return y, (x, scale, bias, stats)


def _fused_bwd(plan, saved, cotangent):
  h, scale, bias, stats = saved
  has_residual = isinstance(cotangent, tuple)  # (dy, dh) for the outputs (y, h)
  dy, dh = cotangent if has_residual else (cotangent, None)
  dx, dr, dscale, dbias = plan.run(plan.kernels.backward, h, scale, bias, stats, dy, dh,
                                   residual_dtype=dh.dtype if has_residual else None)
  if has_residual and dr is None:
    dr = dx  # same dtype: one array serves both gradients, written once
  return dx, dscale, dbias, dr


_fused.defvjp(_fused_fwd, _fused_bwd)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Args(backend.Args):
  """A norm call's validated arguments: x and the residual as given, scale and bias (N,)."""

  x: jax.Array
  scale: jax.Array
  bias: jax.Array | None
  residual: jax.Array | None
  eps: float


def _validator(op):
  def validate(x, scale, bias=None, *, eps, residual) -> Args:
    x = _checks.array(op, "x", x)
    if x.shape[-1] == 0:
      raise ValueError(f"{op}: x's last dimension is normalized and must be > 0, got shape "
                       f"{x.shape}")
    scale = _checks.vector(op, "scale", scale, x.shape[-1], "x")
    if bias is not None:
      bias = _checks.vector(op, "bias", bias, x.shape[-1], "x")
    if residual is not None:
      residual = _checks.same_shape(op, "residual", residual, x.shape, "x")
    return Args(x=x, scale=scale, bias=bias, residual=residual,
                eps=_checks.positive_float(op, "eps", eps))
  return validate


def _kernel(plan: dispatch.Plan, args: Args):
  x, residual = args.x, args.residual
  out = _fused(plan, rows_view(x), args.scale, args.bias,
               rows_view(residual) if residual is not None else None)
  if residual is None:
    return out.reshape(x.shape)
  y, h = out
  return y.reshape(x.shape), h.reshape(x.shape)


def _rule(args: Args) -> partitioning.Rule:
  """x's and the residual's rows split freely; the normalized last dimension stays whole."""
  return partitioning.rows_rule({"x": args.x, "residual": args.residual},
                                {"scale": args.scale, "bias": args.bias}, -1, "embed")


def _op(name, layer, reference_norm):
  return backend.Op(
      name=name, kernels=_kernels(name), validate=_validator(name),
      problem=lambda args: Problem.of(args.x, args.scale, args.bias, args.residual, layer),
      reference=reference_norm, kernel=_kernel, rule=_rule,
      options=lambda args: dict(layer=layer, eps=args.eps))


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
    implementation: None (best available), "xla", "triton", "mosaic_gpu" (Hopper) or
      "mosaic_tpu".
    config: the chosen kernel's Config (``jaxkernels.ops.norms.triton.Config``,
      ``...mosaic_gpu.Config``, ``...mosaic_tpu.Config``); None picks one for the shape and
      device.

  Returns:
    y, or (y, h) with a residual. Statistics are float32 whatever the dtype.
  """
  return backend.call(_RMS_NORM, implementation, config, x=x, scale=scale, eps=eps,
                      residual=residual)


def layer_norm(x, scale, bias=None, *, eps: float = 1e-6, residual=None, implementation=None,
               config=None):
  """LayerNorm over the last axis (centred, scaled, optionally biased); see :func:`rms_norm`."""
  return backend.call(_LAYER_NORM, implementation, config, x=x, scale=scale, bias=bias, eps=eps,
                      residual=residual)


_RMS_NORM = backend.register(_op(
    "rms_norm", False,
    lambda args: reference.rms_norm(args.x, args.scale, eps=args.eps, residual=args.residual)),
    rms_norm)
_LAYER_NORM = backend.register(_op(
    "layer_norm", True,
    lambda args: reference.layer_norm(args.x, args.scale, args.bias, eps=args.eps,
                                      residual=args.residual)),
    layer_norm)
