"""The op per shard: :func:`run`, its call under ``jax.shard_map`` (nested over the axes that
split nothing of it), and the two collectives whose transposes the ops need as they are:
:func:`all_gather` (a weight gathered in the map, its gradient reduce-scattered) and
:func:`psum_out` (a row-parallel product's sum)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxkernels.partitioning.specs import axes, is_auto, layout

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
  auto = is_auto(mesh)
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
