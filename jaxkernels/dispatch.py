"""Which kernel serves a call: the implementations, the device the arrays live on, the
kernels an op registers, the choice among them, and the plan a call fixes when it is traced.

Every op offers the same implementations:

- ``"xla"``: the pure-jnp reference, compiled by XLA; runs anywhere.
- ``"triton"``: Pallas on CUDA GPUs through Triton (sm80+).
- ``"mosaic_gpu"``: Pallas Mosaic GPU, Hopper only (wgmma, TMA).
- ``"mosaic_tpu"``: Pallas Mosaic TPU.

``implementation=None`` asks for the best kernel that can serve the call on the
device the arrays live on, and falls back to ``"xla"`` with a one-time
:class:`FallbackWarning` naming why. An explicit implementation that cannot
serve the call raises ``ValueError`` with the reason. While tracing (under
``jit``, or AOT-lowering for a TPU topology from a CPU host) the device is not
known for certain, so an explicit kernel is taken at its word.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

import jax

from jaxkernels import (_checks, _mosaic_gpu, _mosaic_tpu, _triton_files, hardware, interpret,
                        partitioning, tuning)
from jaxkernels.interpret import interpreting

Implementation = Literal["xla", "triton", "mosaic_gpu", "mosaic_tpu"]
IMPLEMENTATIONS: tuple[str, ...] = ("xla", *interpret.KERNELS)
KERNELS: tuple[str, ...] = interpret.KERNELS


# The platform each kernel implementation compiles for.
KERNEL_PLATFORM: Mapping[str, str] = {
    "triton": "gpu",
    "mosaic_gpu": "gpu",
    "mosaic_tpu": "tpu",
}

# Preference order of kernels on each platform, best first.
PREFERENCE: Mapping[str, tuple[str, ...]] = {
    "gpu": ("mosaic_gpu", "triton"),
    "tpu": ("mosaic_tpu",),
}


class FallbackWarning(UserWarning):
    """An op ran its XLA reference because no kernel could serve the call."""

_WARNED: set[tuple[str, str]] = set()




@dataclasses.dataclass(frozen=True)
class Target:
  """What the call will run on, as far as can be told at trace time."""

  platform: str  # "cpu" | "gpu" | "tpu"
  device_kind: str
  concrete: bool  # True when read off concrete arrays, not guessed while tracing
  # The mesh of Auto axes the operands live on with no mesh in context
  # (partitioning.unsplit_mesh): no kernel can know their split there.
  unsplit: Any = None
  # Traced with no mesh in sight in a process of several devices (partitioning.unseen): the
  # program's lowering tells whether it spans them.
  unseen: bool = False

  @property
  def chip(self) -> hardware.Chip | None:
    return hardware.chip_for(self.device_kind)

  def chip_for(self, implementation: str) -> hardware.Chip:
    """The chip to size ``implementation``'s tiles for.

    The target's own chip when it runs that kernel; otherwise (interpret mode,
    or tracing for a device this host cannot see) a stand-in: an H100 for GPU
    kernels, and for TPU kernels the chip with the least VMEM, so that the
    kernel compiles for every TPU generation.
    """
    chip = self.chip
    platform = KERNEL_PLATFORM.get(implementation)
    if chip is not None and chip.platform == platform:
      return chip
    if chip is None and self.platform == platform:  # a device the table does not know
      return hardware.unknown_chip(self.device_kind, platform)
    return hardware.SMALLEST_VMEM_TPU if platform == "tpu" else hardware.DEFAULT_GPU


def _platform(name: str) -> str:
  return {"cuda": "gpu", "rocm": "gpu"}.get(name, name)


def target_of(*args: Any) -> Target:
  """The device the arrays live on.

  Concrete arrays answer for themselves. While tracing, the operands' own mesh where no mesh
  is in context (:func:`partitioning.unsplit_mesh`), else the abstract mesh set with
  ``jax.set_mesh`` (e.g. over TPU topology devices for AOT lowering), is used when it names a
  device, else the default device.
  """
  unsplit = partitioning.unsplit_mesh(*args)
  unseen = partitioning.unseen(*args)
  for leaf in jax.tree_util.tree_leaves(args):
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
      device = next(iter(leaf.devices()))
      return Target(_platform(device.platform), device.device_kind, True, unsplit, unseen)
  for mesh in (unsplit, jax.sharding.get_abstract_mesh()):
    abstract_device = getattr(mesh, "abstract_device", None)
    if abstract_device is not None:
      kind = abstract_device.device_kind
      platform = getattr(abstract_device, "platform", None)
      if platform is None:
        platform = "tpu" if kind.startswith("TPU") else "gpu"
      return Target(_platform(platform), kind, False, unsplit, unseen)
  device = jax.config.jax_default_device or jax.devices()[0]
  if isinstance(device, str):
    device = jax.devices(device)[0]
  return Target(_platform(device.platform), device.device_kind, False, unsplit, unseen)


# --------------------------------------------------------------------------- #
# Support and dispatch
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class Support:
  """Whether an implementation can serve a call; ``reason`` says why not."""

  ok: bool
  reason: str = ""

  def __bool__(self) -> bool:
    return self.ok


def _no_error(problem: Any, config: Any, chip: hardware.Chip) -> str | None:
  del problem, config, chip
  return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Kernels:
  """One op's kernels on one implementation, wired by name: what dispatch, tuning and the
  custom_vjp call. An op's api lists one per implementation, e.g. for softmax on Triton
  ``Kernels.of("softmax", "triton", triton, forward=triton.forward, backward=triton.backward)``,
  and registers them with ``backend.register``.

  The ``problem`` every function here takes is the op's description of one call (its
  ``Problem``: shapes, dtypes, static options), hashable, with ``key()`` for the tuning
  tables and ``reason()`` for why no kernel can take it (or None).
  """

  op: str
  implementation: str
  Config: type  # noqa: N815 - the backend's Config class, named as in its module
  heuristic: Callable[[Any, hardware.Chip], Any]  # (problem, chip) -> Config
  unsupported: Callable[[Any, hardware.Chip], str | None]  # (problem, chip) -> why not
  forward: Callable[..., Any]
  backward: Callable[..., Any] | None = None  # None where the op's backward is not a kernel
  config_error: Callable[[Any, Any, hardware.Chip], str | None] = _no_error
  # Whether dispatch prefers these kernels on its own (implementation=None): a bool, or a
  # predicate of the problem where that depends on the call (an activation measured slower).
  # False for kernels slower than the ones they would replace (or not yet timed on their
  # hardware): they serve a call that names them, and, where no other kernel serves the call
  # (a JAX without Pallas Triton), one that names none, before the XLA reference.
  auto: bool | Callable[[Any], bool] = True

  @classmethod
  def of(cls, op: str, implementation: str, module: Any, *, forward: Callable[..., Any],
         backward: Callable[..., Any] | None = None,
         auto: bool | Callable[[Any], bool] = True) -> Kernels:
    """The kernels of ``module`` (a backend file: its Config, heuristic, unsupported and, where
    it has one, config_error), with the entry points the caller names."""
    return cls(op=op, implementation=implementation, Config=module.Config,
               heuristic=module.heuristic, unsupported=module.unsupported,
               config_error=getattr(module, "config_error", _no_error), forward=forward,
               backward=backward, auto=auto)


def triton_kernels(op: str, module: str, **entry_points: str) -> dict[str, Kernels]:
  """{"triton": the Kernels of the Triton file ``module``, its entry points named by
  attribute}, or {} where the file is gone (``_triton_files``)."""
  found = _triton_files.optional(module)
  if found is None:
    return {}
  return {"triton": Kernels.of(op, "triton", found, **{
      name: getattr(found, attribute) for name, attribute in entry_points.items()})}


def on_request(table: Mapping[str, Kernels], problem: Any = None) -> frozenset[str]:
  """The implementations of ``table`` that dispatch does not pick on its own for ``problem``
  (None: those it never picks on its own, whatever the call)."""
  def passed_over(k: Kernels) -> bool:
    if callable(k.auto):
      return problem is not None and not k.auto(problem)
    return not k.auto
  return frozenset(name for name, k in table.items() if passed_over(k))


def kernel_reasons(problem: Any, target: Target,
                   table: Mapping[str, Kernels]) -> dict[str, str | None]:
  """For each of an op's kernels (``table``, by implementation): None if it can serve
  ``problem`` on ``target``, else why not."""
  common = problem.reason()
  return {name: common or k.unsupported(problem, target.chip_for(name))
          for name, k in table.items()}


# Each kernel implementation's toolchain module (its API: the Pallas names its kernels call)
# and the Pallas module those names live in; Triton's are None where its files are gone.
_triton = _triton_files.optional("jaxkernels._triton")
_TOOLCHAINS = {"triton": (_triton, _triton_files.pallas_triton()),
               "mosaic_gpu": (_mosaic_gpu, _mosaic_gpu.plgpu),
               "mosaic_tpu": (_mosaic_tpu, _mosaic_tpu.pltpu)}


@functools.cache
def missing_api(implementation: str) -> tuple[str, ...]:
  """The Pallas names ``implementation``'s kernels call that this JAX lacks (asked once a
  process: every dispatch reads it)."""
  toolchain, pallas = _TOOLCHAINS[implementation]
  if toolchain is None:
    return ("its kernels",)
  return tuple(name for name in toolchain.API if not hasattr(pallas, name))


def _toolchain_reason(implementation: str) -> str | None:
  """Why this JAX's Pallas cannot build ``implementation``'s kernels (API they call is
  missing), or None."""
  missing = missing_api(implementation)
  if not missing:
    return None
  if _TOOLCHAINS[implementation][0] is None:  # the kernels' files removed with it
    return (f"jaxkernels' {implementation} kernels are not installed (removed with Pallas "
            f"{implementation}, which JAX deprecated)")
  if _TOOLCHAINS[implementation][1] is None:  # the whole backend: Pallas Triton removed
    return (f"this JAX ({jax.__version__}) has no Pallas {implementation} "
            f"(jax.experimental.pallas.{implementation} does not import)")
  return (f"this JAX ({jax.__version__}) has no {', '.join(missing)} in Pallas "
          f"{implementation}, which its kernels call")


def _platform_reason(implementation: str, target: Target) -> str | None:
  """Why ``implementation`` cannot run on ``target``'s device, or None."""
  if (reason := _toolchain_reason(implementation)) is not None:
    return reason
  want = KERNEL_PLATFORM[implementation]
  if target.platform == want:
    return None  # the chip's generation is each kernel's to judge (its ``unsupported``)
  if target.platform == "cpu" and interpreting():
    return None
  if not target.concrete:
    return None  # tracing for a platform we cannot see: take the caller's word
  return (
      f"{implementation} compiles for {want.upper()}s; the arrays live on "
      f"{target.platform} ({target.device_kind!r}); "
      "use jaxkernels.interpret_mode() to run it on the CPU"
  )


def reasons(
    implementation: str,
    target: Target,
    kernel_reasons: Mapping[str, str | None],
) -> str | None:
  if implementation == "xla":
    return None
  if implementation not in kernel_reasons:
    return f"this op has no {implementation} kernel (it has: {', '.join(kernel_reasons) or 'none'})"
  return _platform_reason(implementation, target) or kernel_reasons[implementation]


def _auto_order(target: Target) -> tuple[str, ...]:
  if target.platform == "cpu":
    setting = interpret.setting()
    if setting is None:
      return ()
    if setting in KERNELS:
      return (setting,)
    return ("mosaic_tpu", "triton", "mosaic_gpu")
  return PREFERENCE.get(target.platform, ())


def _user_stacklevel() -> int:
  """``warnings.warn``'s stacklevel for the first frame outside this package and outside JAX
  (the user's call): an op on sharded arrays runs per shard inside jax.shard_map, whose frames
  stand between the op's and the caller's (the warning once named jax's shard_map.py)."""
  ours = os.path.dirname(os.path.abspath(__file__))
  theirs = os.path.dirname(os.path.abspath(jax.__file__))
  frame, level = sys._getframe(1), 1  # our caller's frame is stacklevel 1
  while frame is not None and frame.f_code.co_filename.startswith((ours, theirs)):
    frame, level = frame.f_back, level + 1
  return level


def _first_serving(target: Target, kernel_reasons: Mapping[str, str | None],
                   requested_only: Collection[str] = ()) -> tuple[str | None, list[str]]:
  """The first kernel of the target's preference order that serves the call, those in
  ``requested_only`` only where no other does (None if none does), and why each one before
  it does not."""
  why_not, second = [], None
  for candidate in _auto_order(target):
    if candidate not in kernel_reasons:
      if _TOOLCHAINS[candidate][0] is None:  # its files are gone: say so
        why_not.append(f"{candidate}: {_toolchain_reason(candidate)}")
      continue
    reason = reasons(candidate, target, kernel_reasons)
    if reason is None and candidate in requested_only:
      second = second or candidate  # served only where no preferred kernel is
      continue
    if reason is None:
      return candidate, why_not
    why_not.append(f"{candidate}: {reason}")
  return second, why_not


def choice(implementation: str | None, target: Target,
           kernel_reasons: Mapping[str, str | None],
           requested_only: Collection[str] = ()) -> str | None:
  """The kernel :func:`select` would run, asked quietly: None where it would fall back to the
  XLA reference or raise (a caller that then makes the call itself gets the warning or the
  error there)."""
  if implementation is None:
    return _first_serving(target, kernel_reasons, requested_only)[0]
  if implementation == "xla" or reasons(implementation, target, kernel_reasons) is not None:
    return None
  return implementation


def select(
    op: str,
    implementation: str | None,
    target: Target,
    kernel_reasons: Mapping[str, str | None],
    requested_only: Collection[str] = (),
) -> str:
  """Picks the implementation for one call of ``op``.

  Args:
    op: the public op's name, for messages.
    implementation: what the caller asked for (None: the best that serves).
    target: where the call runs (see :func:`target_of`).
    kernel_reasons: for each kernel the op has, None if its kernel can serve the
      call's shapes, dtypes and options, else the reason it cannot.
    requested_only: kernels that serve only a call naming them (:func:`on_request`).
  """
  if implementation is not None:
    if implementation not in IMPLEMENTATIONS:
      raise ValueError(
          f"{op}: implementation={implementation!r} is not one of {IMPLEMENTATIONS} or None"
      )
    reason = reasons(implementation, target, kernel_reasons)
    if reason is not None:
      raise ValueError(f"{op}: implementation={implementation!r} cannot serve this call: {reason}")
    return implementation
  chosen, why_not = _first_serving(target, kernel_reasons, requested_only)
  if chosen is not None:
    return chosen
  if not why_not:  # no kernel for the platform at all (a CPU): one line for every op
    op, message = "*", (
        f"jaxkernels: no Pallas kernel runs on {target.platform}: every op runs its XLA "
        f"reference. {interpret.ENV}=triton (or mosaic_gpu, mosaic_tpu) runs the kernels "
        "under Pallas' interpreter there, to check them, not to time them")
  else:
    message = f"jaxkernels.{op}: using the XLA reference ({'; '.join(why_not)})"
  warn_fallback(op, message)
  return "xla"


def warn_fallback(op: str, message: str) -> None:
  """``message`` as a FallbackWarning, once a process for each (``op``, ``message``), at the
  user's line."""
  if (op, message) not in _WARNED:
    _WARNED.add((op, message))
    warnings.warn(message, FallbackWarning, stacklevel=_user_stacklevel())


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one call fixes when it is traced: the kernels that serve it and their config, the
  chip the configs are chosen for, the static keyword options every kernel of the call takes,
  and whether interpret mode was on. An op's custom_vjp takes it as a non-differentiable
  argument, so the backward, traced later, runs the same kernels the same way.
  """

  kernels: Kernels
  config: Any  # the call's problem's: the caller's, the tuned table's or the heuristic's
  chip: hardware.Chip
  interpret: bool
  options: tuple[tuple[str, Any], ...] = ()
  explicit: bool = False  # the caller gave the config
  # (op, dispatch picked the kernel) where the call was traced with no mesh in sight
  # (Target.unseen): each kernel call is checked when its program is lowered.
  unseen: tuple[str, bool] | None = None

  @property
  def implementation(self) -> str:
    return self.kernels.implementation

  def config_for(self, problem: Any) -> Any:
    """The config for another problem of the same call (a backward pass's own product, say):
    the tuned table's for this chip, else the heuristic's."""
    return tuning.config_for(self.kernels, problem, self.chip)

  def run(self, kernel: Callable[..., Any], *args: Any, config: Any = None,
          **kwargs: Any) -> Any:
    """``kernel(*args, **kwargs)`` (one of ``self.kernels``' entry points) with the call's
    options, ``config`` (default: the plan's) and interpret mode."""
    static = {**kwargs, **dict(self.options), "config": self.config if config is None else config,
              "interpret": interpret.interpret_params(self.implementation, self.interpret)}
    try:
      hash(tuple(static.values()))
    except TypeError:  # an option that cannot be a jit's static argument: called as it is
      jitted = kernel
    else:
      jitted = _jitted(kernel, tuple(sorted(static)))
    # A pallas_call's outputs carry no varying-axes type: traced unchecked, also where a
    # shard_map that checks them holds the call (partitioning.run, over the mesh axes that
    # split none of its operands, on each of which every value is the same).
    if self.unseen is not None:
      args = list(args)
      first = next((i for i, a in enumerate(args) if isinstance(a, jax.Array)), None)
      if first is not None:
        op, picked = self.unseen
        args[first] = interpret.lowering_check(
            args[first], op=op, implementation=self.implementation, picked=picked,
            interpreted=self.interpret and interpret.interpreter_has_effects())
    with partitioning.check_vma(False):
      return jitted(*args, **static)


@functools.cache
def _jitted(kernel: Callable[..., Any], static: tuple[str, ...]) -> Callable[..., Any]:
  """``kernel`` under one ``jax.jit`` per (kernel, static argument names), its options static.

  A program lowers each distinct kernel call once only where the call's jaxpr is the same
  object: a kernel traced afresh in each place it appears (the two backward passes of a
  model's rematerialized layers, say) was lowered again for each (the 125m train step lowered
  25 Mosaic GPU kernels, 12 of them twice: 5.5 of its 18 s of lowering). Through one jit per
  kernel, JAX's trace cache hands every call with the same shapes and options the same jaxpr,
  and the lowering of that jit is cached across the module."""
  return jax.jit(kernel, static_argnames=static)


def plan(op: str, implementation: str | None, target: Target, problem: Any,
         table: Mapping[str, Kernels], config: Any, *, empty: bool = False,
         **options: Any) -> Plan | None:
  """The kernel plan for one call of ``op``, or None where the XLA reference serves it.

  The config is the caller's (checked against the chosen kernels' ``Config`` and
  ``config_error``), else the tuned table's for the chip, else the heuristic's.

  Args:
    op, implementation, target: as for :func:`select`.
    problem: the op's description of the call (see :class:`Kernels`).
    table: the op's kernels by implementation name.
    config: the caller's config, or None.
    empty: the call has no elements (the reference serves it, whatever was chosen).
    options: static keyword arguments for every kernel of the call.
  """
  chosen = select(op, implementation, target, kernel_reasons(problem, target, table),
                  on_request(table, problem))
  k = table.get(chosen)
  _checks.config_type(op, chosen, config, k.Config if k else None)
  if k is None or empty:
    return None
  if target.unsplit is not None:
    partitioning.refuse_or_fall_back(op, chosen, target.unsplit, picked=implementation is None)
    return None
  partitioning.check_mesh_in_context(op, chosen, picked=implementation is None)
  if interpreting():
    interpret.check_interpreter_threads(op, chosen)
  chip = target.chip_for(chosen)
  explicit = config is not None
  if config is None:
    config = tuning.config_for(k, problem, chip)
  elif (error := k.config_error(problem, config, chip)) is not None:
    raise ValueError(f"{op}: config={config} cannot run {problem} on "
                     f"implementation={chosen!r}: {error}")
  return Plan(k, config, chip, interpreting(), tuple(sorted(options.items())), explicit,
              (op, implementation is None) if target.unseen else None)
