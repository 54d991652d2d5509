"""The devices and their mesh: ``data``, ``fsdp``, ``tensor`` and ``sequence`` axes over every
local device (or every process's, ``distributed``), and what the laid-out state holds on one
device."""

from __future__ import annotations

import math

import jax
from jax.sharding import AxisType

from jaxkernels import partitioning
from models import llama
from models.hparams import UsageError

def all_devices() -> list:
  """Every device of the run: this process's, or with several processes (``distributed``)
  every process's."""
  return jax.devices()


def distributed(coordinator: str | None = None, num_processes: int | None = None,
                process_id: int | None = None) -> None:
  """Joins a run of several processes (hosts) through ``jax.distributed.initialize``: where
  ``coordinator`` is None, JAX reads the cluster from its environment (a Cloud TPU pod
  slice's, SLURM's, ...). Host CPUs exchange through gloo."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # host devices' collectives
  try:
    jax.distributed.initialize(coordinator, num_processes, process_id)
  except (RuntimeError, ValueError) as e:
    raise UsageError(f"--distributed: could not join the run ({type(e).__name__}: {e}); on a "
                     "machine with no cluster environment pass --coordinator HOST:PORT, "
                     "--num-processes and --process-id") from e


def parse_mesh(text: str) -> dict[str, int]:
  """``--mesh``'s value, "data=2,fsdp=2,tensor=2": each named axis' size (one of
  ``llama.MESH_AXES``, a whole number >= 1). "" is no axis named; an empty part between or
  after commas is refused (a typo that would leave an axis out)."""
  sizes: dict[str, int] = {}
  for part in (p.strip() for p in text.split(",") if text.strip()):
    name, sep, value = part.partition("=")
    name = name.strip()
    if not sep or name not in llama.MESH_AXES or name in sizes:
      what = ("has an empty part (two commas, or one at an end)" if not part else
              "is not of the form axis=size" if not sep else
              f"names axis {name!r} twice" if name in sizes else f"has an unknown axis {name!r}")
      raise UsageError(f"--mesh {text!r} {what}; the axes are {', '.join(llama.MESH_AXES)}, "
                       "e.g. --mesh data=2,fsdp=2,tensor=2")
    try:
      sizes[name] = int(value)
    except ValueError:
      sizes[name] = 0
    if sizes[name] < 1:
      raise UsageError(f"--mesh {text!r}: {name}={value.strip()!r} must be a whole number >= 1")
  return sizes


def mesh(data: int = 1, devices=None, *, fsdp: int | None = None, tensor: int = 1,
         sequence: int = 1) -> jax.sharding.Mesh:
  """The devices on axes ``llama.MESH_AXES`` (data, fsdp, tensor, sequence), all Explicit;
  ``fsdp=None`` takes the devices the others leave."""
  devices = all_devices() if devices is None else devices
  others = data * tensor * sequence
  if fsdp is None:
    if min(data, tensor, sequence) < 1 or len(devices) % others:
      raise UsageError(f"--mesh data={data},tensor={tensor},sequence={sequence} must divide "
                       f"the {len(devices)} devices (fsdp takes the rest)")
    fsdp = len(devices) // others
  shape = dict(zip(llama.MESH_AXES, (data, fsdp, tensor, sequence)))
  if min(shape.values()) < 1 or math.prod(shape.values()) != len(devices):
    raise UsageError(f"--mesh {describe_shape(shape)} holds {math.prod(shape.values())} devices; "
                     f"there are {len(devices)}: the sizes' product must be the device count")
  return jax.make_mesh(tuple(shape.values()), llama.MESH_AXES,
                       axis_types=(AxisType.Explicit,) * len(shape), devices=devices)


def held(state, where: jax.sharding.Mesh) -> tuple[int, int]:
  """(parameter bytes, optimizer-state bytes) a device holds of (model, optimizer) ``state``
  (may be abstract) laid out on ``where`` by ``llama.place``."""
  shardings = llama.shardings(state, where)

  def local_bytes(x, sharding):
    parts = [partitioning.size(where, partitioning.axes(e)) for e in sharding.spec]
    return x.size * x.dtype.itemsize // math.prod(parts)

  return tuple(sum(jax.tree.leaves(jax.tree.map(local_bytes, state[i], shardings[i])))
               for i in (0, 1))


def layout(state, where: jax.sharding.Mesh) -> list[str]:
  """What ``llama.place`` does with (model, optimizer) ``state`` (may be abstract) on
  ``where``: a line per weight matrix (its shape, the stacked layers' in one, and its mesh
  spec), then the bytes a device holds of the parameters and of the optimizer's state."""
  model = state[0]
  shardings = llama.shardings(state, where)
  lines = []
  leaves = jax.tree_util.tree_leaves_with_path(model)
  for (path, x), sharding in zip(leaves, jax.tree.leaves(shardings[0]), strict=True):
    if x.ndim >= 2:
      keys = (getattr(k, "key", getattr(k, "name", k)) for k in path)
      name = ".".join(str(k) for k in keys if k != "value")
      lines.append(f"  {name:<22} {str(tuple(x.shape)):<22} {sharding.spec}")
  params, moments = held(state, where)
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model))
  lines.append(f"  a device holds {params / 2**20:.1f} MiB of the {total / 2**20:.1f} MiB of "
               f"parameters, and {moments / 2**20:.1f} MiB of optimizer state")
  return lines


def in_bytes(n: int) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def device_limit(where: jax.sharding.Mesh) -> int | None:
  """The bytes a device's allocator may hold, where the device says (GPUs, TPUs), else None
  (this process's first device of the mesh: the others' are alike)."""
  mine = [d for d in where.devices.flat if d.process_index == jax.process_index()]
  stats = mine[0].memory_stats() or {}
  return stats.get("bytes_limit")


def describe_shape(shape) -> str:
  return ",".join(f"{name}={size}" for name, size in dict(shape).items())
