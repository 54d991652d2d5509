"""Logical axis rules, for meshes of Auto axes: which mesh axes each logical dimension name
("batch", "length", "embed", ...) splits over; ours (:class:`sharding_rules`), else Flax's
where set, else the default ("batch" over the data-like axes)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping, Sequence

from jax.sharding import PartitionSpec as P

from jaxkernels.partitioning.specs import axes, entry

# The mesh axes that the default rules split "batch" over, those of them the mesh has.
DATA_AXES = ("replica", "data", "fsdp", "batch", "dp")


class _Rules(threading.local):
  rules: tuple[tuple[str, tuple[str, ...]], ...] | None = None


_RULES = _Rules()


def _axes_of(where: str, value) -> tuple[str, ...]:
  if value is None:
    return ()
  if isinstance(value, str):
    return (value,)
  if isinstance(value, (tuple, list)) and all(isinstance(a, str) for a in value):
    return tuple(value)
  raise TypeError(f"sharding_rules: {where} must be None, a mesh axis name or a tuple of them, "
                  f"got {value!r}")


def _first_wins(pairs, whose: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
  """(name, mesh axes) pairs in Flax's form as our rules, the first pair of a name winning."""
  out: dict[str, tuple[str, ...]] = {}
  for pair in pairs:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
      raise TypeError(f"sharding_rules: each rule must be a (logical name, mesh axes) pair, "
                      f"got {pair!r}")
    out.setdefault(pair[0], _axes_of(f"{whose} rule for {pair[0]!r}", pair[1]))
  return tuple(out.items())


def _flax_rules():
  """Flax's logical axis rules where set (flax is never imported for this), else ()."""
  flax_spmd = sys.modules.get("flax.core.spmd")
  return flax_spmd.get_logical_axis_rules() if flax_spmd is not None else ()


class sharding_rules:  # noqa: N801 - used as a function, and as a context manager
  """Which mesh axes each logical dimension name splits over, for ops on meshes of Auto axes.

  ``jk.sharding_rules(batch=("data", "fsdp"), embed=None)``, or Flax's form, a sequence of
  ``(name, axes)`` pairs (the first pair of a name wins), sets them for this thread until
  set again; as a context manager (``with jk.sharding_rules(...):``) until the block ends.
  A name the rules leave out stays whole, and so does an axis the mesh lacks.
  ``jk.sharding_rules(None)`` goes back to Flax's rules where set, else the default;
  ``jk.sharding_rules()`` sets none at all (nothing splits).
  """

  def __init__(self, rules=(), /, **named):
    self._previous = _RULES.rules
    if rules is None and not named:
      _RULES.rules = None
      return
    pairs = list(rules.items() if isinstance(rules, Mapping) else rules) + list(named.items())
    _RULES.rules = _first_wins(pairs, "the")

  def __enter__(self) -> sharding_rules:
    return self

  def __exit__(self, *exc) -> None:
    _RULES.rules = self._previous


def rules_set(mesh) -> dict[str, tuple[str, ...]] | None:
  """The rules someone set (ours, else Flax's), each name's axes those of ``mesh``; None where
  none are set (a model then lays itself out its own way)."""
  if _RULES.rules is None and not _flax_rules():
    return None
  return current_rules(mesh)


def current_rules(mesh) -> dict[str, tuple[str, ...]]:
  """The rules in force for ``mesh``: ours, else Flax's where set, else the default; each
  name's axes those of ``mesh``."""
  rules = _RULES.rules
  if rules is None:
    rules = _first_wins(_flax_rules(), "Flax's") or (
        ("batch", tuple(a for a in mesh.axis_names if a in DATA_AXES)),)
  return {name: tuple(a for a in value if a in mesh.axis_names) for name, value in rules}


def logical_spec(names: Sequence[str | None], mesh, rules=None) -> list:
  """The PartitionSpec entries for dimensions named ``names`` under ``rules`` (name -> mesh
  axes; default: the rules in force), a mesh axis splitting at most one dimension: the first
  that asks for it."""
  rules, used, spec = current_rules(mesh) if rules is None else rules, set(), []
  for name in names:
    picked = tuple(a for a in rules.get(name, ()) if a not in used) if name else ()
    used.update(picked)
    spec.append(entry(picked))
  return spec


def row_names(ndim: int, feature: str) -> tuple[str, ...]:
  """A rows array's logical dimension names: ("batch", "length", ..., ``feature``)."""
  if ndim == 1:
    return (feature,)
  return ("batch",) + ("length",) * (ndim - 2) + (feature,)


def partition_spec(names: Sequence[str | None], mesh, *, rules=None) -> P:
  """The PartitionSpec of an array whose dimensions carry the logical names ``names`` (None:
  unnamed, whole) on ``mesh``: under the rules set (``jk.sharding_rules``, else Flax's),
  else ``rules`` (logical name -> mesh axes: a name, a tuple of names, or None), else the
  default ("batch" over the mesh's data-like axes). An axis of size 1 splits nothing, and a
  mesh axis splits at most one dimension, the first that asks for it. A model lays its
  parameters out by this, as the ops split their operands."""
  chosen = rules_set(mesh)
  if chosen is None:
    chosen = current_rules(mesh) if rules is None else {
        name: tuple(a for a in axes(value) if a in mesh.axis_names)
        for name, value in rules.items()}
  sizes = dict(mesh.shape)
  chosen = {name: tuple(a for a in value if sizes.get(a, 1) > 1)
            for name, value in chosen.items()}
  return P(*logical_spec(tuple(names), mesh, chosen))
