"""Ops on sharded arrays: an op whose inputs are split over a mesh runs its kernels once per
shard, under ``jax.shard_map`` over the mesh the inputs carry, with the collectives its rule
asks for and no others.

Why shard_map, not ``custom_partitioning`` (bench/NOTES.md, sharding-1): a Pallas call is one
opaque custom call, which neither GSPMD nor Shardy can split (Mosaic TPU refuses, "cannot be
automatically partitioned"; a Triton call is pinned to one device). ``custom_partitioning``
hands the split to a Python callback at compile time, but on TPU the callback is never
registered (jax-ml/jax#38196: "Custom emitter for CustomSPMDPartitioning not found", also AOT
for v5e from a CPU host), and the TPU interpreter's callbacks are refused inside it. shard_map
works for every backend, interpreted and compiled, forward and backward (its transpose sums the
cotangents of operands that every shard shares: d(scale), d(bias), dB). Arrays replicated over
the mesh run the kernel whole on every device, as XLA runs replicated work. It needs the split
at trace time: arrays on a mesh whose axes are ``jax.sharding.AxisType.Explicit`` carry it in
their type (``jax.typeof(x).sharding``), so that is what the ops read. On ``Auto`` axes the
compiler decides the split later and cannot split a kernel, so the ops decide it themselves
where a mesh is in context (below). With no mesh in context (``jit(in_shardings=...)``
alone) an operand's type names its mesh but not its split, and no rule applies
(:func:`unsplit_mesh`): dispatch serves the call with XLA's ops, which the compiler splits,
and warns with the fix (put the mesh in context); a kernel named by the caller is refused
(:func:`refuse_or_fall_back`). Host arrays handed to ``jit(in_shardings=...)`` give the traced
operands no mesh at all; only the lowering sees the program's devices, and warns or refuses
there (``backend.lowering_check``).

On a mesh of ``Auto`` axes in context (``jax.set_mesh(mesh)``, arrays placed by
``jit(in_shardings=...)`` or ``device_put``; ``with mesh:`` sets no mesh that traced code can
read, jax 0.10 to 0.12, so it counts as none) the arrays' types carry no split, so the op
takes it from logical axis rules: each dimension has a logical name ("batch", "length",
"embed", ...), and the rules say which mesh axes each name splits over
(:class:`sharding_rules`, else Flax's ``nnx.logical_axis_rules`` where set, else the default:
"batch" over every data-like axis the mesh has, :data:`DATA_AXES`, everything else whole).
The op then runs per shard in shard_map over the mesh in context exactly as on Explicit axes;
where the arrays were split otherwise, the compiler moves them to that split first.

Each op states its rule as data (:class:`Free`, :class:`Whole`): for each operand, what each
dimension does. A free dimension splits, and dimensions of one group (x's rows and the
residual's, q's heads and k's, a matmul's K in A and in B) split over the same mesh axes, those
of the first operand that splits one; a mesh axis splits one group at most. A whole dimension
(one the kernels reduce, walk or contract over) is gathered where it is split, with a one-time
:class:`ShardingWarning` naming the op, the axes and the bytes moved (or a ValueError where the
caller named a kernel), as is a group whose axes do not divide one of its dimensions. A
weight's dimension (``weight=True``: a matmul's B, the fused loss's w) split over data-like
axes is fully sharded data parallelism: gathered quietly inside the map, its gradient
reduce-scattered back (:func:`gathers_inside`). One
function, :func:`split`, reads a rule and the operands' layout for every op, and dispatch's one
entry (``backend.call``) runs the op per shard through :meth:`Split.run`, with what the op adds
across shards (a row-parallel matmul's psum, the losses' sums: its ``across``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

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


# --------------------------------------------------------------------------- #
# Logical axis rules, for meshes of Auto axes
# --------------------------------------------------------------------------- #

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


def _warn_once(message: str, stacklevel: int) -> None:
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


def row_names(ndim: int, feature: str) -> tuple[str, ...]:
  """A rows array's logical dimension names: ("batch", "length", ..., ``feature``)."""
  if ndim == 1:
    return (feature,)
  return ("batch",) + ("length",) * (ndim - 2) + (feature,)


def auto_mesh():
  """The mesh in context where it spans several devices on Auto axes only (the compiler
  splits the arrays there, so the ops take their split from the rules), else None."""
  mesh = jax.sharding.get_abstract_mesh()
  return mesh if _spans_auto(mesh) else None


def _is_auto(mesh) -> bool:
  auto = getattr(jax.sharding.AxisType, "Auto", None)
  return all(t == auto for t in getattr(mesh, "axis_types", ()))


def _spans_auto(mesh) -> bool:
  """``mesh`` spans several devices on Auto axes only (the compiler, not the type, splits)."""
  return (mesh is not None and not getattr(mesh, "empty", True) and mesh.size > 1
          and _is_auto(mesh))


def size(mesh, names: Sequence[str]) -> int:
  return math.prod(dict(mesh.shape)[a] for a in names)


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
  _warn_once(message, stacklevel=3)


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
    return run(self.mesh, call, arrays, specs, out_specs, inside, wire, nest=self.nest)


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
      _warn_once(message, stacklevel=4)
      spec[dim] = None
  return spec


def run(mesh, call: Callable[..., Any], arrays: Mapping[str, Any], specs: Mapping[str, P],
        out_specs, inside: Mapping[str, Mapping[int, tuple[str, ...]]] | None = None,
        wire: Mapping[str, Any] | None = None, nest: bool = True) -> Any:
  """``call(**arrays)`` under shard_map over ``mesh``, each array split as ``specs`` says
  (resharded first where it is split otherwise: slicing a whole array is local; gathering a
  split one is what the rules warn of), None arrays passed through as None. On a mesh of Auto
  axes the compiler moves each array to its split. ``inside``: {array: {dimension: mesh
  axes}}, the gathers the map runs on entry (:func:`gathers_inside`), each in ``wire``'s dtype
  for that array where given. ``nest=False``: no shard_map nested over the axes that split
  nothing (the Mosaic interpreters' host callbacks in a nested manual computation abort
  XLA:CPU's lowering, Shardy on jax 0.10.2 "Check failed: buffer != nullptr"; there the plain
  shard_map, with its extra all-reduces)."""
  inside, wire = inside or {}, wire or {}
  names = [name for name, a in arrays.items() if a is not None]
  args, in_specs = [], []
  padded = lambda spec, ndim: P(*spec, *[None] * (ndim - len(spec)))
  auto = _is_auto(mesh)
  for name in names:
    a, target = arrays[name], specs[name]
    have = layout(a)
    if not auto and padded(have[1] if have else (), a.ndim) != padded(target, a.ndim):
      a = jax.sharding.reshard(a, NamedSharding(mesh, target))
    args.append(a)
    in_specs.append(target)
  absent = {name: None for name, a in arrays.items() if a is None}

  def gather(local):
    out = []
    for name, x in zip(names, local):
      for dim, over in sorted(inside.get(name, {}).items()):
        x = all_gather(x, over, dim, np.dtype(wire.get(name, x.dtype)))
      out.append(x)
    return out

  def body(*local):
    return call(**dict(zip(names, local)), **absent)

  # check_vma=False: a pallas_call's outputs carry no varying-axes type; the op's rule is what
  # says how they vary. Its transpose then treats an operand that a mesh axis does not split
  # as one whose shards' cotangents differ: it divides the output's cotangent by the axis'
  # size and adds the operands' across it, an all-reduce of each such operand (an
  # activation's size) in the backward. Over an axis that splits nothing of this call (a
  # norm's rows beside a tensor axis) every device computes the same thing: the call runs
  # in a shard_map over those axes nested in the one over the others, which knows its inputs
  # and outputs are the same on each (check_vma), and the backward adds nothing across them.
  used = {a for spec in (*in_specs, *jax.tree.leaves(out_specs, is_leaf=lambda x: isinstance(
      x, P))) for e in spec for a in axes(e)}
  unused = frozenset(a for a in mesh.axis_names if a not in used)
  if not used or all(dict(mesh.shape)[a] == 1 for a in unused) or not nest:
    return jax.shard_map(lambda *local: body(*gather(local)), mesh=mesh,
                         in_specs=tuple(in_specs), out_specs=out_specs, check_vma=False)(*args)

  same = jax.tree.map(lambda _: P(), out_specs, is_leaf=lambda x: isinstance(x, P))

  def split(*local):
    local = gather(local)
    return jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(), in_specs=(P(),) * len(
        local), out_specs=same, axis_names=unused, check_vma=True)(*local)

  return jax.shard_map(split, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                       axis_names=frozenset(used), check_vma=False)(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def all_gather(x, names: tuple[str, ...], dim: int, dtype):
  """``x`` gathered along ``dim`` over mesh axes ``names`` (tiled, inside a shard_map), moved
  in ``dtype`` (a weight's compute dtype, where x came widened for its gradient): the values
  are x's rounded to ``dtype``, in x's dtype. Its transpose is the reduce-scatter in x's dtype
  (the sum of each device's gradient of the whole, each device keeping its share)."""
  return jax.lax.all_gather(x.astype(dtype), names, axis=dim, tiled=True).astype(x.dtype)


def _all_gather_fwd(x, names, dim, dtype):
  return all_gather(x, names, dim, dtype), None


def _all_gather_bwd(names, dim, dtype, _, ct):
  del dtype
  scatter = lambda ct: jax.lax.psum_scatter(ct, names, scatter_dimension=dim, tiled=True)
  # In a map manual over some axes only (run's nested form), jax 0.12's reduce-scatter fails to
  # lower where the mesh's other axes are Explicit ("Length of sharding.spec (2) must be equal
  # to aval's ndim (0)"): it runs in a map over those axes too, where each holds the same.
  mesh = jax.sharding.get_abstract_mesh()
  manual = getattr(jax.sharding.AxisType, "Manual", None)
  rest = frozenset(a for a, t in zip(mesh.axis_names, getattr(mesh, "axis_types", ()))
                   if t != manual)
  if rest:
    scatter = jax.shard_map(scatter, mesh=mesh, in_specs=P(), out_specs=P(), axis_names=rest,
                            check_vma=False)
  return (scatter(ct),)


all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def psum_out(x, names: tuple[str, ...]):
  """``lax.psum(x, names)`` for a sum that leaves the shard_map (:func:`run`) unsplit over
  ``names``, and whatever follows it there runs the same on each shard (a row-parallel
  product's partial sums and its epilogue). shard_map's transpose hands each shard the
  output's cotangent divided by the axes' size (check_vma=False); the true cotangent of each
  partial sum is the whole of it, so the backward multiplies it back, with no collective,
  where lax.psum's transpose would add the shares across the axes (an all-reduce of the
  output's size, one a row-parallel layer in a tensor-parallel step)."""
  return jax.lax.psum(x, names)


def _psum_out_fwd(x, names):
  return jax.lax.psum(x, names), None


def _psum_out_bwd(names, _, ct):
  return (ct * jax.lax.psum(1, names),)


psum_out.defvjp(_psum_out_fwd, _psum_out_bwd)


def unsplit_mesh(*arrays: Any):
  """The mesh of Auto axes the arrays live on where no mesh is in context, else None.

  Under ``jax.jit(f, in_shardings=...)`` alone an operand's type names its mesh but not its
  split (Auto axes leave that to the compiler), and nothing tells the op which rules to split
  by: a kernel there would run whole on gathered operands (GPUs, CPUs) or fail to compile
  (Mosaic TPU, "cannot be automatically partitioned"). A concrete array answers exactly (a
  replicated one is no question)."""
  if not getattr(jax.sharding.get_abstract_mesh(), "empty", True):
    return None  # a mesh in context: the op splits by the rules (auto_mesh) or is in a map
  for leaf in jax.tree_util.tree_leaves(arrays):
    if not isinstance(leaf, jax.Array):
      continue
    if isinstance(leaf, jax.core.Tracer):
      sharding = getattr(jax.typeof(leaf), "sharding", None)
    else:
      sharding = leaf.sharding
      if sharding.is_fully_replicated:
        continue
    mesh = getattr(sharding, "mesh", None)
    if _spans_auto(mesh):
      return mesh
  return None


def refuse_or_fall_back(op: str, implementation: str, mesh, picked: bool) -> None:
  """Operands on ``mesh`` (Auto axes) with no mesh in context (:func:`unsplit_mesh`): with
  ``picked`` (implementation=None), warns once that XLA's ops serve the call (the compiler
  splits those); a kernel asked for by name is refused. Either way the message names the fix."""
  fix = ("put the mesh in context around the jit call with jax.set_mesh(mesh) (`with mesh:` "
         "is not enough: it sets no mesh that traced code can read, and jax 0.12 deprecates "
         "it) and the op runs per shard, split by the logical axis rules (jk.sharding_rules); "
         "or give the mesh Explicit axes; or call the op inside your own jax.shard_map")
  where = (f"its operands live on a mesh of Auto axes {dict(mesh.shape)} and no mesh is in "
           f"context (jax.jit's in_shardings alone), so nothing says how they are split")
  if not picked:
    raise ValueError(f"{op}: implementation={implementation!r} cannot run here: {where}; a "
                     f"kernel would run whole on every device or fail to compile; {fix}")
  message = f"jaxkernels.{op}: {where}: XLA's ops serve the call instead of a kernel; {fix}"
  _warn_once(message, stacklevel=5)


def unseen(*arrays: Any) -> bool:
  """Whether a traced call sees no mesh at all: none in context, and no operand on a mesh of
  several devices, in a process with several devices. Its program may still span them
  (``jax.jit(f, in_shardings=...)`` called on host arrays gives the traced operands no mesh),
  which only the lowering can tell: ``backend.lowering_check``."""
  if jax.device_count() == 1 or not getattr(jax.sharding.get_abstract_mesh(), "empty", True):
    return False
  leaves = [x for x in jax.tree_util.tree_leaves(arrays) if isinstance(x, jax.Array)]
  if not any(isinstance(x, jax.core.Tracer) for x in leaves):
    return False  # run eagerly: the arrays answered for themselves (target_of)
  for x in leaves:
    sharding = (getattr(jax.typeof(x), "sharding", None) if isinstance(x, jax.core.Tracer)
                else x.sharding)
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and not getattr(mesh, "empty", True) and mesh.size > 1:
      return False
  return True


def unseen_split(op: str, implementation: str, picked: bool, devices: int) -> None:
  """Where a call traced with no mesh in sight (:func:`unseen`) is lowered in a program over
  ``devices`` devices (``backend.lowering_check``): the compiler would gather the kernel's
  split operands and run it whole on every device (Mosaic TPU cannot be compiled so). Warns (a
  kernel dispatch picked) or refuses (a kernel named, or Mosaic TPU), naming the fix."""
  fix = ("put the mesh in context around the jit call with jax.set_mesh(mesh) and the op runs "
         "per shard, split by the logical axis rules (jk.sharding_rules); or give the mesh "
         "Explicit axes; or call the op inside your own jax.shard_map")
  where = (f"its program spans {devices} devices, but no mesh was in sight when the op was "
           f"traced (jax.jit's in_shardings on arrays that were not placed on the mesh, and no "
           f"mesh in context), so the op cannot tell how its operands are split")
  if implementation == "mosaic_tpu" or not picked:
    chosen = (f"the {implementation} kernel that dispatch picked" if picked
              else f"implementation={implementation!r}")
    raise ValueError(f"{op}: {chosen} cannot run here: {where}; the compiler would gather "
                     f"split operands and run the kernel whole on every device (Mosaic TPU "
                     f"cannot be compiled so); {fix}")
  message = (f"jaxkernels.{op}: {where}: where they are split, the compiler gathers them and "
             f"the {implementation} kernel runs whole on every device; {fix}")
  _warn_once(message, stacklevel=2)


def check_mesh_in_context(op: str, implementation: str, picked: bool = False) -> None:
  """Where the mesh in context (``jax.set_mesh``) spans several devices on Auto axes only, the
  compiler, not the op, splits the arrays, and it cannot split a kernel. Mosaic TPU would then
  fail to compile ("cannot be automatically partitioned"): refused here, saying what works.
  A GPU kernel would run whole on one device, its operands gathered: warned once."""
  mesh = auto_mesh()
  if mesh is None:
    return  # one device, Explicit axes (the op splits itself) or Manual ones (a shard_map)
  advice = ("give the mesh Explicit axes (jax.make_mesh(..., axis_types=(jax.sharding."
            "AxisType.Explicit,) * n)) so that the op runs per shard, or call it inside "
            "jax.shard_map")
  where = f"the mesh in context spans {mesh.size} devices on Auto axes {dict(mesh.shape)}"
  if implementation == "mosaic_tpu":
    # ``picked``: the caller passed implementation=None and dispatch (on a CPU, interpret
    # mode) chose the kernel; the message says so rather than name an argument never given.
    chosen = ("the mosaic_tpu kernel that interpret mode picked" if picked
              else "implementation='mosaic_tpu'")
    raise ValueError(f"{op}: {chosen} cannot run on {where}: the compiler cannot split a "
                     f"Mosaic kernel; {advice}")
  message = (f"jaxkernels.{op}: {where}; the compiler cannot split a {implementation} kernel, "
             f"so its operands are gathered and it runs whole; {advice}")
  _warn_once(message, stacklevel=4)

