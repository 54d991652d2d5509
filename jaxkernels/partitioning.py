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
(:func:`refuse_or_fall_back`).

On a mesh of ``Auto`` axes in context (``jax.set_mesh(mesh)``, arrays placed by
``jit(in_shardings=...)`` or ``device_put``; ``with mesh:`` sets no mesh that traced code can
read, jax 0.10 to 0.12, so it counts as none) the arrays' types carry no split, so the op
takes it from logical axis rules: each dimension has a logical name ("batch", "length",
"embed", ...), and the rules say which mesh axes each name splits over
(:class:`sharding_rules`, else Flax's ``nnx.logical_axis_rules`` where set, else the default:
"batch" over every data-like axis the mesh has, :data:`DATA_AXES`, everything else whole).
The op then runs per shard in shard_map over the mesh in context exactly as on Explicit axes;
where the arrays were split otherwise, the compiler moves them to that split first.

Each op states its rule: which of its arrays are rows (shaped like x), which are vectors along
x's last dimension, and which dimension of x it reduces over. Rows split freely except along the
reduced dimension; a split reduced dimension is gathered, with a one-time
:class:`ShardingWarning` naming the op, the axes and the bytes moved (or a ValueError where the
caller named a kernel). A mesh axis that does not divide the dimension it splits is a
ValueError naming the op, the array, the axes and the sizes.
"""

from __future__ import annotations

import math
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

_WARNED: set[str] = set()


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


def split_of(op: str, arrays: Mapping[str, Any],
             names: Mapping[str, Sequence[str | None]]) -> tuple[Any, dict[str, list]] | None:
  """(the mesh, each array's split as a list of PartitionSpec entries) for an op's ``arrays``:
  from their types where they live on a mesh of Explicit axes, else from the rules for their
  dimensions' logical ``names`` where a mesh of Auto axes is in context (an array without
  names stays whole; a dimension the rules' axes do not divide is kept whole, warned); None
  where neither (one device, or inside a shard_map). Arrays that are None are left out."""
  present = {k: a for k, a in arrays.items() if a is not None}
  found = next(filter(None, map(layout, present.values())), None)
  if found is not None:
    mesh = found[0]
    return mesh, {k: list(layout(a)[1]) if layout(a) else [None] * a.ndim
                  for k, a in present.items()}
  mesh = auto_mesh()
  if mesh is None:
    return None
  return mesh, {k: _dividing(op, k, a, logical_spec(names.get(k, (None,) * a.ndim), mesh), mesh)
                for k, a in present.items()}


def _is_auto(mesh) -> bool:
  auto = getattr(jax.sharding.AxisType, "Auto", None)
  return all(t == auto for t in getattr(mesh, "axis_types", ()))


def _spans_auto(mesh) -> bool:
  """``mesh`` spans several devices on Auto axes only (the compiler, not the type, splits)."""
  return (mesh is not None and not getattr(mesh, "empty", True) and mesh.size > 1
          and _is_auto(mesh))


def size(mesh, names: Sequence[str]) -> int:
  return math.prod(dict(mesh.shape)[a] for a in names)


def check_divides(op: str, name: str, shape, spec, mesh) -> None:
  """A ValueError naming the op, the array, the axes and the sizes where a mesh axis does not
  divide the dimension it splits."""
  for dim, (length, split) in enumerate(zip(shape, spec)):
    names = axes(split)
    if names and length % size(mesh, names):
      raise ValueError(
          f"{op}: {name} has dimension {dim} of size {length}, which mesh axes {names} (size "
          f"{size(mesh, names)}) do not divide: shard it over axes whose size divides "
          f"{length}, or pad it")


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
  if message not in _WARNED:
    _WARNED.add(message)
    warnings.warn(message, ShardingWarning, stacklevel=3)


def rowwise(op: str, implementation: str | None, call: Callable[..., Any], *,
            rows: Mapping[str, Any], vectors: Mapping[str, Any] = {},
            reduced: int | None, feature: str = "embed") -> tuple[bool, Any]:
  """Runs ``call(**rows, **vectors)`` once per shard where the arrays are split.

  Args:
    rows: arrays shaped like the first of them (x); the first decides the layout, the others
      are resharded to it where they differ.
    vectors: arrays along x's last dimension (scale, bias).
    reduced: the dimension of x the op reduces over (kept whole), or None (elementwise: the
      last dimension splits too, and the vectors with it).
    feature: the logical name of x's last dimension, for meshes of Auto axes (x's dimensions
      are named by :func:`row_names`).

  Returns:
    (True, the result) where the arrays live on a mesh of Explicit axes (split or not: a Pallas
    call on a multi-device mesh runs only per shard) or a mesh of Auto axes is in context
    (split by the rules), else (False, None): the caller runs as on one device. The result's
    row outputs are split as x's rows are.
  """
  if implementation == "xla":
    return False, None  # the reference is jnp: XLA's own partitioner splits it
  (x_name, x), *_ = rows.items()
  found = next((lay for lay in map(layout, (*rows.values(), *vectors.values())) if lay), None)
  if found is not None:
    mesh, x_layout = found[0], layout(x)
    spec = list(x_layout[1]) if x_layout else [None] * x.ndim
  elif (mesh := auto_mesh()) is not None:
    spec = logical_spec(row_names(x.ndim, feature), mesh)
  else:
    return False, None
  if reduced is not None:
    reduced %= x.ndim
    if axes(spec[reduced]):
      gathered(op, implementation, x_name, x, reduced, axes(spec[reduced]), mesh)
      spec[reduced] = None
  if found is None:
    spec = _dividing(op, x_name, x, spec, mesh)
  check_divides(op, x_name, x.shape, spec, mesh)
  row_spec = P(*spec)
  vector_spec = P(spec[-1]) if reduced is None else P(None)
  specs = {**{name: row_spec for name in rows}, **{name: vector_spec for name in vectors}}
  return True, run(mesh, call, {**rows, **vectors}, specs, row_spec)


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
      if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, ShardingWarning, stacklevel=4)
      spec[dim] = None
  return spec


def run(mesh, call: Callable[..., Any], arrays: Mapping[str, Any], specs: Mapping[str, P],
        out_specs) -> Any:
  """``call(**arrays)`` under shard_map over ``mesh``, each array split as ``specs`` says
  (resharded first where it is split otherwise: slicing a whole array is local; gathering a
  split one is what the rules warn of), None arrays passed through as None. On a mesh of Auto
  axes the compiler moves each array to its split."""
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

  def body(*local):
    return call(**dict(zip(names, local)), **absent)

  # check_vma=False: a pallas_call's outputs carry no varying-axes type; the op's rule is what
  # says how they vary.
  return jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                       check_vma=False)(*args)


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
  if message not in _WARNED:
    _WARNED.add(message)
    warnings.warn(message, ShardingWarning, stacklevel=5)


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
  if message not in _WARNED:
    _WARNED.add(message)
    warnings.warn(message, ShardingWarning, stacklevel=4)

