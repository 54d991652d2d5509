"""The split: each op's rule as data (:class:`Free`, :class:`Whole`), read against its
operands' layout by one function, :func:`split`, whose :class:`Split` runs the op per shard
(``shard_map.run``); and the warnings and errors where a dimension is gathered."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jaxkernels.partitioning import shard_map
from jaxkernels.partitioning.rules import DATA_AXES, logical_spec, row_names
from jaxkernels.partitioning.specs import auto_mesh, axes, entry, layout, size, warn_once

def gathered(op: str, implementation: str | None, name: str, a, dim: int, names, mesh,
             why: str | None = None, instead: str = "split the rows") -> None:
  """Warns once (or raises, for an explicit kernel) that ``a``'s dimension ``dim`` is gathered
  along mesh axes ``names``, because ``why`` (default: the op reduces over it)."""
  k = size(mesh, names)
  moved = a.size * a.dtype.itemsize * (k - 1) // k
  why = why or f"{op}'s kernels reduce over it whole"
  reason = (f"{name}'s dimension {dim} (size {a.shape[dim]}) is split over mesh axes {names}, "
            f"and {why}")
  if implementation is not None:
    raise ValueError(f"{op}: implementation={implementation!r} cannot serve this call: {reason}; "
                     f"keep that dimension whole ({instead}), or pass implementation=None to "
                     "gather it")
  message = (f"jaxkernels.{op}: {reason}: gathered, {moved / 2**20:.1f} MiB into each device, "
             f"which then holds that dimension whole")
  warn_once(message, stacklevel=3)


@dataclasses.dataclass(frozen=True)
class Free:
  """A dimension that splits freely. Dimensions of one ``group`` split over the same mesh axes:
  those of the first operand (in the rule's order) that splits one. ``name``: its logical name,
  for meshes of Auto axes (None: never split there). ``label``: how messages name the group.
  ``broadcast``: a dimension of size 1 is broadcast against the group and stays whole.
  ``weight``: a weight's dimension (:func:`gathers_inside`)."""

  group: str
  name: str | None = None
  label: str | None = None
  broadcast: bool = False
  weight: bool = False


@dataclasses.dataclass(frozen=True)
class Whole:
  """A dimension the kernels need whole (they reduce, walk or contract over it): gathered where
  it is split, warned (``why``, ``instead``: the warning's words) unless ``quiet`` (a vector
  along a reduced dimension: its bytes are nothing beside the rows'). ``weight``: a weight's
  dimension (:func:`gathers_inside`)."""

  name: str | None = None
  why: str | None = None
  instead: str = "split the rows"
  quiet: bool = False
  weight: bool = False


def warned_axes(d: Free | Whole, names: Sequence[str]) -> tuple[str, ...]:
  """Of mesh axes ``names`` that split dimension ``d``, those a gather of it warns of: all
  but the data-like ones (:data:`DATA_AXES`) where ``d`` is a weight's, which it gathers as
  fully sharded data parallelism does."""
  return tuple(a for a in names if not (d.weight and a in DATA_AXES))


def gathers_inside(dims: Sequence[Free | Whole], have, target) -> dict[int, tuple[str, ...]]:
  """Where an operand laid out as ``have`` enters the op's map as ``target``, the gathers the
  map runs itself, {dimension: mesh axes}: those of fully sharded data parallelism, a
  weight's dimension split over data-like axes after the target's (:func:`warned_axes`).
  Gathered in the map (``lax.all_gather``) rather than before it, the weight's gradient
  leaves as a reduce-scatter of each device's share, not an all-reduce of the whole weight
  sliced after. Empty where any other dimension differs (the array moves before the map)."""
  if have is None:
    return {}
  out = {}
  for dim, (d, h, t) in enumerate(zip(dims, have, tuple(target) + (None,) * len(dims))):
    h, t = axes(h), axes(t)
    if h == t:
      continue
    extra = h[len(t):]
    if h[:len(t)] != t or warned_axes(d, extra):
      return {}
    out[dim] = extra
  return out


Rule = Mapping[str, Sequence["Free | Whole"]]


@dataclasses.dataclass(frozen=True)
class Split:
  """What :func:`split` decided: the mesh, the mesh axes each group splits over, and how each
  operand was laid out (its spec: its type's, or the logical rules' on Auto axes)."""

  mesh: Any
  groups: Mapping[str, tuple[str, ...]]
  layouts: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
  # Whether :func:`run` may nest a shard_map over the axes that split nothing (``split``'s
  # caller says: not under the Mosaic interpreters, see :func:`run`).
  nest: bool = True

  def axes(self, *groups: str) -> tuple[str, ...]:
    return tuple(a for g in groups for a in self.groups.get(g, ()))

  def size(self, *groups: str) -> int:
    return size(self.mesh, self.axes(*groups))

  def spec(self, dims: Sequence[Free | Whole | None], shape=None) -> P:
    """The PartitionSpec of an array whose dimensions are ``dims`` (None: whole)."""
    return P(*(entry(self.groups.get(d.group, ())) if isinstance(d, Free) and not (
        d.broadcast and shape is not None and shape[i] == 1) else None
               for i, d in enumerate(dims)))

  def run(self, call: Callable[..., Any], arrays: Mapping[str, Any], rule: Rule,
          out_dims, wire: Mapping[str, Any] | None = None) -> Any:
    """``call(**arrays)`` once per shard, each array split as ``rule`` and this split say,
    the outputs as ``out_dims`` (a tree of dims tuples, or of PartitionSpecs) say. A weight
    split over data-like axes is gathered in the map (:func:`gathers_inside`), in
    ``wire[name]``'s dtype where given (a weight the op widened to float32 for its gradient's
    sum: the gather moves its own dtype's bytes, the gradient's reduce-scatter float32's)."""
    specs, inside = {}, {}
    for name, a in arrays.items():
      specs[name] = self.spec(rule[name], a.shape) if a is not None else P()
      if a is not None and (g := gathers_inside(rule[name], self.layouts.get(name),
                                                specs[name])):
        have = self.layouts[name]
        inside[name] = g
        specs[name] = P(*(have[i] if i in g else e for i, e in enumerate(
            tuple(specs[name]) + (None,) * (a.ndim - len(specs[name])))))
    is_dims = lambda x: isinstance(x, tuple) and all(
        d is None or isinstance(d, (Free, Whole)) for d in x)
    out_specs = jax.tree.map(lambda d: d if isinstance(d, P) else self.spec(d), out_dims,
                             is_leaf=lambda x: isinstance(x, P) or is_dims(x))
    return shard_map.run(self.mesh, call, arrays, specs, out_specs, inside, wire,
                         nest=self.nest)


def split(op: str, implementation: str | None, arrays: Mapping[str, Any], rule: Rule, *,
          xla_too: bool = False, nest: bool = True) -> Split | None:
  """How ``arrays`` split under ``rule``, or None where nothing says (the op runs as on one
  device): their types where they live on a mesh of Explicit axes (split or not: a Pallas
  call on a multi-device mesh runs only per shard), else the logical axis rules for their
  dimensions' names where a mesh of Auto axes is in context. ``implementation="xla"``: None,
  the reference being jnp that XLA's own partitioner splits, unless ``xla_too`` (an op whose
  reference reshapes what a type keeps split: the fused loss flattens its tokens). Arrays
  that are None or that the rule does not name are left out, and the first operand (in the
  rule's order) that splits a group decides its axes. ``nest``: :attr:`Split.nest`."""
  if implementation == "xla" and not xla_too:
    return None
  present = {k: arrays[k] for k in rule if arrays.get(k) is not None}
  found = next(filter(None, map(layout, present.values())), None)
  if found is not None:
    mesh = found[0]
    specs = {k: list(layout(a)[1]) if layout(a) else [None] * a.ndim
             for k, a in present.items()}
  elif (mesh := auto_mesh()) is not None:
    specs = {k: _dividing(op, k, a, logical_spec([d.name for d in rule[k]], mesh), mesh)
             for k, a in present.items()}
  else:
    return None
  groups: dict[str, tuple[str, ...]] = {}
  first: dict[str, tuple[str, Any, int, str]] = {}  # group -> the operand dimension deciding it
  owner: dict[str, str] = {}  # mesh axis -> what it splits, for the messages
  for name, a in present.items():
    for dim, (d, e) in enumerate(zip(rule[name], specs[name], strict=True)):
      names = axes(e)
      if isinstance(d, Whole):
        if (loud := warned_axes(d, names)) and not d.quiet:
          gathered(op, implementation, name, a, dim, loud, mesh, why=d.why, instead=d.instead)
        continue
      if d.group in groups or not names or (d.broadcast and a.shape[dim] == 1):
        continue  # decided already (this operand moves to it), or nothing to decide
      label = d.label or f"dimension {dim}"
      if clash := tuple(x for x in names if x in owner):
        if loud := warned_axes(d, clash):
          gathered(op, implementation, name, a, dim, loud, mesh,
                   why=f"those axes already split {owner[loud[0]]}",
                   instead=f"split {label} over other mesh axes")
        names = tuple(x for x in names if x not in owner)
      if names:
        groups[d.group], first[d.group] = names, (name, a, dim, label)
        owner.update((x, f"{name}'s {label}") for x in names)
  # A group's axes must divide each of its dimensions (q's heads and k's kv heads, say):
  # where one does not, the group stays whole.
  for name, a in present.items():
    for dim, d in enumerate(rule[name]):
      if not isinstance(d, Free) or not groups.get(d.group) or (
          d.broadcast and a.shape[dim] == 1):
        continue
      k = size(mesh, groups[d.group])
      if a.shape[dim] % k:
        by, b, by_dim, label = first[d.group]
        gathered(op, implementation, by, b, by_dim, groups[d.group], mesh,
                 why=f"those axes (size {k}) do not divide {name}'s {a.shape[dim]} along its "
                 f"dimension {dim}, which splits with {by}'s {label}",
                 instead=f"split {label} over axes that divide {name}'s")
        groups[d.group] = ()
  return Split(mesh, {g: n for g, n in groups.items() if n},
               {k: tuple(spec) for k, spec in specs.items()}, nest)


def rows_rule(rows: Mapping[str, Any], vectors: Mapping[str, Any], reduced: int | None,
              feature: str) -> dict[str, tuple]:
  """The row ops' rule: arrays shaped like x (the first of ``rows``) whose dimensions split
  freely but the one reduced over (kept whole); for elementwise ops (``reduced=None``) the last
  dimension splits too, with the vectors along it. Dimensions are named by :func:`row_names`."""
  x = next(iter(rows.values()))
  names = row_names(x.ndim, feature)
  dims = [*row_dims(x.ndim, feature), Free("feature", feature, label="last dimension")]
  if reduced is not None:
    dims[reduced % x.ndim] = Whole(names[reduced % x.ndim])
  vector = (Whole(feature, quiet=True),) if reduced is not None else (dims[-1],)
  return {**{name: tuple(dims) for name in rows}, **{name: vector for name in vectors}}


def row_dims(ndim: int, feature: str, label: str = "rows") -> tuple[Free, ...]:
  """The rule's dimensions for the leading ``ndim - 1`` dimensions of an array of rows (x's,
  a matmul's A, the fused loss's tokens): each its own group, split freely, named by
  :func:`row_names` (``feature`` names the last, which the caller states itself)."""
  return tuple(Free(f"row{i}", n, label=label)
               for i, n in enumerate(row_names(ndim, feature)[:-1]))


def _dividing(op: str, name: str, a, spec, mesh) -> list:
  """On Auto axes, the rules' split where its axes divide each dimension; a dimension they do
  not divide stays whole (every device then holds it whole, as XLA would run it), warned once."""
  spec = list(spec)
  for dim, (length, split) in enumerate(zip(a.shape, spec)):
    names = axes(split)
    if names and length % size(mesh, names):
      k = size(mesh, names)
      message = (f"jaxkernels.{op}: {name}'s dimension {dim} (size {length}) stays whole: the "
                 f"sharding rules split it over mesh axes {names} (size {k}), which do not "
                 f"divide it; make it a multiple of {k}, or change jk.sharding_rules")
      warn_once(message, stacklevel=4)
      spec[dim] = None
  return spec
