"""Calls that cannot see how their operands are split: operands on a mesh of Auto axes with
no mesh in context, a program over several devices traced with no mesh in sight, a mesh of
Auto axes in context that the compiler splits. Each is warned of, or refused, with the fix."""

from __future__ import annotations

from typing import Any

import jax

from jaxkernels.partitioning.specs import auto_mesh, spans_auto, warn_once

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
    if spans_auto(mesh):
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
  warn_once(message, stacklevel=5)


def unseen(*arrays: Any) -> bool:
  """Whether a traced call sees no mesh at all: none in context, and no operand on a mesh of
  several devices, in a process with several devices. Its program may still span them
  (``jax.jit(f, in_shardings=...)`` called on host arrays gives the traced operands no mesh),
  which only the lowering can tell: ``interpret.lowering_check``."""
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
  ``devices`` devices (``interpret.lowering_check``): the compiler would gather the kernel's
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
  warn_once(message, stacklevel=2)


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
  warn_once(message, stacklevel=4)
