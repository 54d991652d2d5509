"""Argument checks shared by the ops: each error names the argument, what it got, what is accepted."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Dtypes the kernels compute on (statistics and accumulation in float32).
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def array(op: str, name: str, value: Any, *, min_rank: int = 1) -> jax.Array:
  """A floating-point array of rank >= min_rank (anything with shape and dtype passes through)."""
  if not (hasattr(value, "shape") and hasattr(value, "dtype")):
    try:
      value = jnp.asarray(value)
    except TypeError:
      raise TypeError(f"{op}: {name} must be an array, got {type(value).__name__}") from None
  dtype = jnp.dtype(value.dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f"{op}: {name} must have a floating dtype (bfloat16, float16, float32), got {dtype}"
    )
  if len(value.shape) < min_rank:
    raise ValueError(
        f"{op}: {name} must have rank >= {min_rank}, got shape {tuple(value.shape)}"
    )
  return value


def vector(op: str, name: str, value: Any, size: int, against: str) -> jax.Array:
  """A floating-point vector of length ``size`` (the last dimension of ``against``)."""
  value = array(op, name, value)
  if tuple(value.shape) != (size,):
    raise ValueError(
        f"{op}: {name} must have shape ({size},) to match the last dimension of "
        f"{against}, got shape {tuple(value.shape)}"
    )
  return value


def same_shape(op: str, name: str, value: Any, shape: tuple[int, ...], against: str) -> jax.Array:
  value = array(op, name, value)
  if tuple(value.shape) != tuple(shape):
    raise ValueError(
        f"{op}: {name} must have the shape of {against}, {tuple(shape)}, got {tuple(value.shape)}"
    )
  return value


def positive_float(op: str, name: str, value: Any) -> float:
  """A static, finite, strictly positive float (not a traced value)."""
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{op}: {name} must be a Python float, not a traced array")
  if isinstance(value, (np.ndarray, jax.Array)) and np.ndim(value) == 0:
    value = value.item()
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{op}: {name} must be a float, got {type(value).__name__}")
  value = float(value)
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"{op}: {name} must be a finite float > 0, got {value}")
  return value


def choice(op: str, name: str, value: Any, allowed: tuple[str, ...]) -> str:
  if value not in allowed:
    raise ValueError(f"{op}: {name}={value!r} is not one of {allowed}")
  return value


def axis(op: str, name: str, value: Any, rank: int) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__}")
  if not -rank <= value < rank:
    raise ValueError(f"{op}: {name}={value} is out of range for an array of rank {rank}")
  return int(value) % rank


def kernel_dtype_reason(**arrays: Any) -> str | None:
  """Why the kernels cannot take these arrays' dtypes, or None."""
  for name, value in arrays.items():
    if value is not None and jnp.dtype(value.dtype) not in KERNEL_DTYPES:
      return f"{name} has dtype {jnp.dtype(value.dtype)}; kernels take bfloat16, float16, float32"
  return None


def config_type(op: str, implementation: str, config: Any, expected: type | None) -> None:
  if config is None:
    return
  if expected is None:
    raise ValueError(f"{op}: implementation={implementation!r} takes no config, got {config!r}")
  if not isinstance(config, expected):
    raise TypeError(
        f"{op}: config for implementation={implementation!r} must be "
        f"{expected.__module__}.{expected.__qualname__}, got {type(config).__name__}"
    )


def traced_check(ok, message: str, *, at, debug: bool = False, **values) -> None:
  """A check of values known only when the computation runs (traced: under jit, vmap, grad),
  by ``jax.experimental.checkify``, the mechanism JAX gives value checks: run the function as
  ``err, out = checkify.checkify(f)(...)`` and ``err.throw()`` raises a ValueError
  (checkify's JaxRuntimeError) whose text is ``message`` first. Under vmap or grad of
  concrete values it raises at once. ``debug=True``: a check that is dropped where the
  function is not checkified (the op then does what its docstring says: clip, say); else JAX
  refuses to compile a jitted function that is not ("a checkify.check which was not
  functionalized"). ``message`` holds ``{where}`` (the first failing element's index into
  ``at``, a boolean array of the failures) and ``{name}`` for each of ``values``, each read at
  that element."""
  from jax.experimental import checkify  # noqa: PLC0415 - only where a check is traced
  # Elementwise ops and reductions alone (no ravel, no gather): the arrays may be split over
  # a mesh of Explicit axes, where a dynamic slice of a split dimension does not lower.
  strides = [int(np.prod(at.shape[d + 1:])) for d in range(at.ndim)]
  flat = sum((jax.lax.broadcasted_iota(jnp.int32, at.shape, d) * stride
              for d, stride in enumerate(strides)), jnp.zeros(at.shape, jnp.int32))
  first = jnp.min(jnp.where(at, flat, at.size))  # the first failure's flat index
  names = {f"i{d}": first // stride % n for d, (stride, n) in enumerate(zip(strides, at.shape))}
  fields = {**names, **{name: jnp.sum(jnp.where(flat == first, v, jnp.zeros((), v.dtype)))
                        if getattr(v, "ndim", 0) else v for name, v in values.items()}}
  text = message.replace("{where}", ", ".join("{" + n + "}" for n in names))
  (checkify.debug_check if debug else checkify.check)(ok, text, **fields)

