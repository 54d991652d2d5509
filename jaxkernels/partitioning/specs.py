"""What every part of the partitioning shares: mesh axes and PartitionSpec entries, an
array's layout on a mesh of Explicit axes, the mesh in context, the ShardingWarning and its
once-a-process record, and the zig-zag sequence order."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

_WARNED: set[str] = set()
# JAX's switch for checking varying-axes types while tracing (shard_map's check_vma sets it;
# pallas_call turns it off for its kernel's body), jax 0.10 to 0.12.
check_vma = jax._src.config._check_vma  # noqa: SLF001


class ShardingWarning(UserWarning):
  """An op gathered a dimension that its inputs keep split, because its rule cannot keep it
  split (its kernels reduce over it, say)."""


def axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def entry(names: Sequence[str]):
  """A PartitionSpec entry for mesh axes ``names``: None, one name, or a tuple of names."""
  names = tuple(names)
  return None if not names else names[0] if len(names) == 1 else names


def layout(a) -> tuple[Any, tuple] | None:
  """(mesh, spec padded to a's rank) where ``a``'s type places it on a mesh of Explicit axes
  (split or not), else None (no mesh, Auto axes, or inside a shard_map)."""
  if a is None:
    return None
  try:
    sharding = jax.typeof(a).sharding
  except (TypeError, AttributeError):
    return None
  mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
  if mesh is None or spec is None or getattr(mesh, "empty", True):
    return None
  explicit = getattr(jax.sharding.AxisType, "Explicit", None)
  if not any(t == explicit for t in getattr(mesh, "axis_types", ())):
    return None
  return mesh, tuple(spec) + (None,) * (len(a.shape) - len(tuple(spec)))


def warn_once(message: str, stacklevel: int) -> None:
  """A ShardingWarning, once a process for each message; ``stacklevel`` as the caller would
  give it to ``warnings.warn``."""
  if message not in _WARNED:
    _WARNED.add(message)
    warnings.warn(message, ShardingWarning, stacklevel=stacklevel + 1)


def zigzag(length: int, shards: int) -> np.ndarray:
  """The zig-zag order of positions 0..length-1 over ``shards``: the positions in 2 x shards
  equal chunks, shard i's slice holding chunk i then chunk 2 x shards - 1 - i. ``x[:, order]``
  lays a (batch, length, ...) array out so; ``order.argsort()`` undoes it."""
  if shards < 1 or length % (2 * shards):
    raise ValueError(f"zigzag: the length {length} must be a multiple of 2 x shards "
                     f"({2 * shards}): each shard holds two equal chunks")
  chunks = np.arange(length).reshape(2 * shards, -1)
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]])
                         for i in range(shards)])


def auto_mesh():
  """The mesh in context where it spans several devices on Auto axes only (the compiler
  splits the arrays there, so the ops take their split from the rules), else None."""
  mesh = jax.sharding.get_abstract_mesh()
  return mesh if spans_auto(mesh) else None


def is_auto(mesh) -> bool:
  auto = getattr(jax.sharding.AxisType, "Auto", None)
  return all(t == auto for t in getattr(mesh, "axis_types", ()))


def spans_auto(mesh) -> bool:
  """``mesh`` spans several devices on Auto axes only (the compiler, not the type, splits)."""
  return (mesh is not None and not getattr(mesh, "empty", True) and mesh.size > 1
          and is_auto(mesh))


def size(mesh, names: Sequence[str]) -> int:
  return math.prod(dict(mesh.shape)[a] for a in names)
