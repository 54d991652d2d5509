"""Interpret mode: every Pallas kernel run on the CPU (for CI and debugging), and the checks
that keep an interpreted kernel from hanging: XLA:CPU's threads for the Mosaic interpreters'
callbacks, and a kernel traced with no mesh in sight checked when its program is lowered.

Mosaic TPU kernels run with TPU semantics (``pltpu.InterpretParams``), Mosaic GPU kernels with
its interpreter, Triton kernels with Pallas' generic interpreter.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from typing import Any

import jax

from jaxkernels import _mosaic_gpu, _mosaic_tpu, partitioning

# The kernel implementations (``dispatch.IMPLEMENTATIONS`` less "xla"): what interpret mode runs.
KERNELS: tuple[str, ...] = ("triton", "mosaic_gpu", "mosaic_tpu")

_INTERPRET: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxkernels_interpret", default=None
)
ENV = "JAXKERNELS_INTERPRET"
_ENV_VALUES = ("", "0", "1", *KERNELS)


def setting() -> str | None:
  """None (off), "1" (any kernel), or the kernel that auto-dispatch picks on CPU."""
  value = _INTERPRET.get()
  if value is not None:
    return value or None
  env = os.environ.get(ENV, "").strip().lower()
  if env not in _ENV_VALUES:
    raise ValueError(
        f"{ENV}={env!r} is not understood; use 1, 0 or one of {KERNELS}."
    )
  return None if env in ("", "0") else env


@contextlib.contextmanager
def interpret_mode(implementation: str | None = None) -> Iterator[None]:
  """Runs every Pallas kernel in interpret mode (on the CPU, for CI and debugging).

  Mosaic TPU kernels run with TPU semantics (``pltpu.InterpretParams``), Triton
  kernels with Pallas' generic interpreter. With ``implementation`` given,
  ``implementation=None`` calls on a CPU device pick that kernel instead of the
  XLA reference; otherwise they prefer ``"mosaic_tpu"``, then ``"triton"``.
  The environment variable ``JAXKERNELS_INTERPRET=1`` (or a kernel name) does
  the same for a whole process.
  """
  if implementation is not None and implementation not in KERNELS:
    raise ValueError(
        f"interpret_mode(implementation={implementation!r}): expected one of {KERNELS}"
    )
  token = _INTERPRET.set(implementation or "1")
  try:
    yield
  finally:
    _INTERPRET.reset(token)


def interpreting() -> bool:
  return setting() is not None


def interpreter_has_effects() -> bool:
  """Whether interpret mode may run a Mosaic interpreter (TPU or GPU), which runs kernels
  through host callbacks: ordered effects, which ``jax.checkpoint`` refuses, and threads that
  wait on each other (:func:`check_interpreter_threads`)."""
  return setting() in ("1", "mosaic_tpu", "mosaic_gpu")


def _host_threads() -> int:
  """Threads of XLA:CPU's pool, which runs host callbacks: ``NPROC`` where it is set (read
  when jax starts), else the cores this process may use."""
  value = os.environ.get("NPROC", "").strip()
  if value.isdigit() and int(value) > 0:
    return int(value)
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_interpreter_threads(op: str, implementation: str, devices: int | None = None) -> None:
  """Refuses, before it can hang, an interpreted Mosaic kernel that XLA:CPU's pool has too few
  threads to run. Each device's kernel is a host callback that waits for the others' (the TPU
  interpreter's rendezvous), and each CTA of the GPU interpreter runs its warpgroups as threads
  that wait on each other: with fewer threads than waiters the process hangs (the TPU
  interpreter on 8 host devices with NPROC=8; the GPU interpreter on 2 cores), or aborts at
  XLA's 60 s rendezvous timeout. ``devices``: the program's (default: the mesh in context's;
  a program that spans devices no traced value names is counted when it is lowered,
  :func:`lowering_check`)."""
  if implementation not in ("mosaic_tpu", "mosaic_gpu"):
    return
  if devices is None:
    mesh = jax.sharding.get_abstract_mesh()
    devices = 1 if getattr(mesh, "empty", True) else mesh.size
  if implementation == "mosaic_tpu" and devices == 1:
    return  # nothing to wait for
  # The TPU interpreter: one waiting callback a device, and one more thread to make progress.
  # The GPU interpreter: a CTA's grid-loop callback, three warpgroups and their nested calls.
  need = devices + 1 if implementation == "mosaic_tpu" else 8 * devices
  have = _host_threads()
  if have < need:
    raise ValueError(
        f"{op}: the {implementation} interpreter on {devices} device(s) needs at least {need} "
        f"host threads to run its kernels' callbacks, and XLA:CPU has {have} (NPROC="
        f"{os.environ.get('NPROC', 'unset')}): set NPROC={need} (or more) in the environment "
        "before jax starts, or interpret with JAXKERNELS_INTERPRET=triton (Pallas' generic "
        "interpreter, no callbacks)")


def lowering_check(x, *, op: str, implementation: str, picked: bool, interpreted: bool):
  """``x``, checked when its program is lowered (a kernel's first operand, where the call was
  traced with no mesh in sight: :func:`partitioning.unseen`). Where that program spans several
  devices, :func:`partitioning.unseen_split` warns or refuses, and an interpreted Mosaic kernel
  is refused if XLA:CPU lacks the threads to run it on every device (it would hang). Lowers to
  ``x`` itself: nothing at run time."""
  return _lowering_check_p.bind(x, op=op, implementation=implementation, picked=picked,
                                interpreted=interpreted)


def _program_devices(ctx) -> int:
  """The devices the program being lowered spans, outside any shard_map (whose body runs per
  device); 1 where unknown."""
  context = ctx.module_context.axis_context
  if type(context).__name__ != "ShardingContext":
    return 1  # a shard_map's body (SPMDAxisContext), pmap's replicas
  return getattr(context, "num_devices", 1) or 1


def _lower_check(ctx, x, *, op, implementation, picked, interpreted):
  devices = _program_devices(ctx)
  if devices > 1:
    partitioning.unseen_split(op, implementation, picked, devices)
    if interpreted:
      check_interpreter_threads(op, implementation, devices)
  return [x]


def _lowering_check_primitive():
  from jax.extend.core import Primitive
  from jax.interpreters import ad, batching, mlir
  p = Primitive("jk_lowering_check")
  p.def_impl(lambda x, **_: x)
  p.def_abstract_eval(lambda x, **_: x)
  mlir.register_lowering(p, _lower_check)
  batching.primitive_batchers[p] = lambda args, dims, **kw: (p.bind(*args, **kw), dims[0])
  ad.deflinear2(p, lambda ct, x, **kw: [ct])
  return p


_lowering_check_p = _lowering_check_primitive()


def interpret_params(implementation: str, on: bool | None = None) -> Any:
  """The ``interpret=`` argument for a pallas_call of ``implementation``.

  ``on`` defaults to whether interpret mode is on now; ops record it when a
  call is traced so that its backward pass, traced later, agrees.
  """
  if not (interpreting() if on is None else on):
    return False
  if implementation == "mosaic_tpu":
    return _mosaic_tpu.interpret_params()
  if implementation == "mosaic_gpu":
    return _mosaic_gpu.interpret_params()
  return True


# --------------------------------------------------------------------------- #
# Device detection
# --------------------------------------------------------------------------- #
