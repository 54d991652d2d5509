"""Integer arithmetic on tiles and shapes, and config field checks: what every kernel shares,
whatever its toolchain (``_triton``, ``_mosaic_gpu``, ``_mosaic_tpu`` hold each one's own)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def round_up(a: int, b: int) -> int:
  return cdiv(a, b) * b


def pad_to(x, shape):
  """x zero-padded at the end of each dimension to ``shape`` (x itself when it already fits)."""
  if tuple(x.shape) == tuple(shape):
    return x
  return jnp.pad(x, [(0, want - have) for have, want in zip(x.shape, shape)])


def next_pow2(n: int) -> int:
  return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def bucket(size: int) -> int:
  """A dimension as tuning tables key it: the next power of two up to 1024, a multiple of 128
  past it (``jaxkernels.tuning`` says why the neighbourhood is that narrow)."""
  return next_pow2(size) if size <= 1024 else round_up(size, 128)


def rows_view(x):
  """(..., N) -> (M, N), free for contiguous arrays."""
  return x.reshape(-1, x.shape[-1])


def rows_struct(a):
  """a's (M, N) rows view as a jax.ShapeDtypeStruct (None for None): what a row op's Problem
  holds."""
  if a is None:
    return None
  return jax.ShapeDtypeStruct((math.prod(a.shape[:-1]), a.shape[-1]), a.dtype)


def check_fields(config, names, ok, requirement: str) -> None:
  """Raises ValueError naming the first of ``names`` whose value fails ``ok``."""
  for name in names:
    value = getattr(config, name)
    if not ok(value):
      raise ValueError(f"{name}={value} must be {requirement}")
