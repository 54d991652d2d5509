"""Which implementation serves a call: names, device detection, dispatch, interpret mode.

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

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import jax
from jax._src import core  # the trace stack (forward_mode)
from jax._src.interpreters import ad

from jaxkernels import (_checks, _mosaic_gpu, _mosaic_tpu, _triton, hardware, partitioning,
                        tuning)

Implementation = Literal["xla", "triton", "mosaic_gpu", "mosaic_tpu"]
IMPLEMENTATIONS: tuple[str, ...] = ("xla", "triton", "mosaic_gpu", "mosaic_tpu")
KERNELS: tuple[str, ...] = IMPLEMENTATIONS[1:]

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


# --------------------------------------------------------------------------- #
# Interpret mode
# --------------------------------------------------------------------------- #

_INTERPRET: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxkernels_interpret", default=None
)
_ENV = "JAXKERNELS_INTERPRET"
_ENV_VALUES = ("", "0", "1", *KERNELS)


def _interpret_setting() -> str | None:
  """None (off), "1" (any kernel), or the kernel that auto-dispatch picks on CPU."""
  value = _INTERPRET.get()
  if value is not None:
    return value or None
  env = os.environ.get(_ENV, "").strip().lower()
  if env not in _ENV_VALUES:
    raise ValueError(
        f"{_ENV}={env!r} is not understood; use 1, 0 or one of {KERNELS}."
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
  return _interpret_setting() is not None


def interpreter_has_effects() -> bool:
  """Whether interpret mode may run a Mosaic interpreter (TPU or GPU), which runs kernels
  through host callbacks: ordered effects, which ``jax.checkpoint`` refuses, and threads that
  wait on each other (:func:`check_interpreter_threads`)."""
  return _interpret_setting() in ("1", "mosaic_tpu", "mosaic_gpu")


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
  and registers them with :func:`register`.

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

  @classmethod
  def of(cls, op: str, implementation: str, module: Any, *, forward: Callable[..., Any],
         backward: Callable[..., Any] | None = None) -> Kernels:
    """The kernels of ``module`` (a backend file: its Config, heuristic, unsupported and, where
    it has one, config_error), with the entry points the caller names."""
    return cls(op=op, implementation=implementation, Config=module.Config,
               heuristic=module.heuristic, unsupported=module.unsupported,
               config_error=getattr(module, "config_error", _no_error), forward=forward,
               backward=backward)


def _no_options(**args: Any) -> Mapping[str, Any]:
  del args
  return {}


def _no_elements(**args: Any) -> bool:
  """Whether any array among the call's arguments has no elements."""
  return any(hasattr(a, "shape") and 0 in tuple(a.shape) for a in args.values())


@dataclasses.dataclass(frozen=True, kw_only=True)
class Op:
  """One public op, declared once in its api.py; :func:`call` runs every call of every op the
  same way: validate, split where the arrays are split, plan, then run the kernels or fall
  back to the reference. Each function but ``validate`` takes the call's validated arguments
  by name (``**args``: what ``validate`` returned).

  Fields:
    name: the public op's name, as errors, warnings, :func:`supports` and the tuning tables
      say it.
    kernels: its kernels by implementation (:class:`Kernels`).
    validate: ``(**arguments) -> args``: every argument of the public op but implementation
      and config, by name, checked and normalized (a clear error naming the argument), as a
      dict the other functions take.
    problem: ``(**args) -> the call's Problem`` (see :class:`Kernels`), for one device.
    reference: ``(**args) -> result``: the pure-jnp reference, XLA's ops (the fallback).
    kernel: ``(plan, **args) -> result``: the call on ``plan``'s kernels (the custom_vjp).
    options: ``(**args) -> static keyword arguments for every kernel of the call``.
    empty: ``(**args) -> bool``: the reference serves the call (default: an array has no
      elements).
    rule: ``(**args) -> the split rule`` (``partitioning.Rule``, by argument name), or None
      for an op that never splits itself.
    out: ``(rule, **args) -> the result's dims`` (a tree of dims tuples or PartitionSpecs;
      default: the rule's first operand's).
    across: ``(split, rule, local, **args) -> result``, for an op whose shards do more than
      run side by side (a row-parallel product's sum, a loss's reduction): ``local(**changed)``
      runs the call on one shard with some arguments changed. Default: ``split.run`` of the
      call on each shard, the result laid out by ``out``.
    compose: ``(implementation, config, **args) -> result or None``: where the call is served
      by a composition of ops (matmul's glu outside its fused kernel), its result; else None.
    xla_too: the reference splits with the kernels too (see ``partitioning.split``).
    forward: ``(**args) -> result``: what runs under forward-mode differentiation, where the
      reference is itself a custom_vjp (a loss computed chunk by chunk); default: the
      reference.
  """

  name: str
  kernels: Mapping[str, Kernels]
  validate: Callable[..., dict[str, Any]]
  problem: Callable[..., Any]
  reference: Callable[..., Any]
  kernel: Callable[..., Any]
  options: Callable[..., Mapping[str, Any]] = _no_options
  empty: Callable[..., bool] = _no_elements
  rule: Callable[..., partitioning.Rule] | None = None
  out: Callable[..., Any] | None = None
  across: Callable[..., Any] | None = None
  compose: Callable[..., Any] | None = None
  xla_too: bool = False
  forward: Callable[..., Any] | None = None


@dataclasses.dataclass(frozen=True)
class _Registered:
  op: Op
  signature: inspect.Signature  # the public op's


_REGISTRY: dict[str, _Registered] = {}
_WARNED: set[tuple[str, str]] = set()
_DISPATCH_ARGUMENTS = ("implementation", "config")


def register(op: Op, public: Callable[..., Any]) -> Op:
  """Registers ``op`` (its kernels with tuning too) and its public function ``public``, whose
  signature :func:`supports` binds a call's arguments to, so that it takes them exactly as the
  op does. Returns ``op``."""
  for k in op.kernels.values():
    tuning.register(k)
  _REGISTRY[op.name] = _Registered(op, inspect.signature(public))
  return op


def call(op: Op, implementation: str | None, config: Any, /, **arguments: Any) -> Any:
  """One call of ``op``: its arguments validated; where they are split (a mesh of Explicit
  axes, or Auto axes in context with the logical axis rules), the op's rule run per shard
  (``partitioning``); then on one device (or shard) the plan for the call (:func:`plan`) and
  its kernels, else the reference."""
  args = op.validate(**arguments)
  if op.compose is not None and (out := op.compose(implementation, config, **args)) is not None:
    return out
  if op.rule is not None:
    rule = op.rule(**args)
    arrays = {name: args[name] for name in rule if name in args}
    where = partitioning.split(op.name, implementation, arrays, rule, xla_too=op.xla_too,
                               nest=not interpreter_has_effects())
    if where is not None:
      local = lambda **changed: _local(op, implementation, config, {**args, **changed})
      # The plan (None: the reference) for a call of other local arguments: the per-shard
      # pieces of an op that runs its kernels more than once a shard (ring attention).
      local.plan = lambda **changed: _plan(op, implementation, config, {**args, **changed})
      local.implementation, local.config = implementation, config
      if op.across is not None:
        return op.across(where, rule, local, **args)
      out = op.out(rule, **args) if op.out is not None else next(iter(rule.values()))
      return where.run(local, arrays, rule, out)
  return _local(op, implementation, config, args)


def _local(op: Op, implementation: str | None, config: Any, args: dict[str, Any]) -> Any:
  """The validated call on one device, or one shard. Under forward-mode differentiation
  (:func:`forward_mode`) the reference runs, planned or not: the kernels' backward is a
  ``jax.custom_vjp``, which JAX cannot differentiate forward."""
  chosen = _plan(op, implementation, config, args)
  if forward_mode():
    return (op.forward or op.reference)(**args)
  return op.reference(**args) if chosen is None else op.kernel(chosen, **args)


def forward_mode() -> bool:
  """Whether the call is traced under forward-mode differentiation: ``jax.jvp``,
  ``jax.jacfwd``, ``jax.hessian`` and Hessian-vector products (forward over reverse) put
  JAX's JVP trace on the trace stack; reverse mode (``jax.grad``, ``jax.vjp``) linearizes
  with its own trace and keeps the kernels and their backward. (``jax.linearize`` linearizes
  as reverse mode does, so it is told from a gradient by nothing a call can see.)"""
  trace = core.trace_ctx.trace
  while trace is not None:
    if isinstance(trace, ad.JVPTrace):
      return True
    trace = getattr(trace, "parent_trace", None)
  return False


def _plan(op: Op, implementation: str | None, config: Any, args: dict[str, Any]) -> Plan | None:
  return plan(op.name, implementation, target_of(*args.values()), op.problem(**args),
              op.kernels, config, empty=op.empty(**args), **op.options(**args))


def ops() -> list[str]:
  """The registered ops' names (each public op's)."""
  return sorted(_REGISTRY)


def kernels(op: str) -> Mapping[str, Kernels]:
  """``op``'s registered kernels by implementation (for tuning a config by hand, say)."""
  if op not in _REGISTRY:
    raise ValueError(f"unknown op {op!r}; known: {sorted(_REGISTRY)}")
  return _REGISTRY[op].op.kernels


def kernel_reasons(problem: Any, target: Target,
                   table: Mapping[str, Kernels]) -> dict[str, str | None]:
  """For each of an op's kernels (``table``, by implementation): None if it can serve
  ``problem`` on ``target``, else why not."""
  common = problem.reason()
  return {name: common or k.unsupported(problem, target.chip_for(name))
          for name, k in table.items()}


# Each kernel implementation's toolchain module (its API: the Pallas names its kernels call)
# and the Pallas module those names live in.
_TOOLCHAINS = {"triton": (_triton, _triton.pltriton),
               "mosaic_gpu": (_mosaic_gpu, _mosaic_gpu.plgpu),
               "mosaic_tpu": (_mosaic_tpu, _mosaic_tpu.pltpu)}


@functools.cache
def missing_api(implementation: str) -> tuple[str, ...]:
  """The Pallas names ``implementation``'s kernels call that this JAX lacks (asked once a
  process: every dispatch reads it)."""
  toolchain, pallas = _TOOLCHAINS[implementation]
  return tuple(name for name in toolchain.API if not hasattr(pallas, name))


def _toolchain_reason(implementation: str) -> str | None:
  """Why this JAX's Pallas cannot build ``implementation``'s kernels (API they call is
  missing), or None."""
  missing = missing_api(implementation)
  if not missing:
    return None
  return (f"this JAX ({jax.__version__}) has no {', '.join(missing)} in Pallas "
          f"{implementation}, which its kernels call")


def _platform_reason(implementation: str, target: Target) -> str | None:
  """Why ``implementation`` cannot run on ``target``'s device, or None."""
  if (reason := _toolchain_reason(implementation)) is not None:
    return reason
  want = KERNEL_PLATFORM[implementation]
  if target.platform == want:
    if implementation == "mosaic_gpu":
      chip = target.chip
      if chip is None or chip.compute_capability != (9, 0):
        return f"mosaic_gpu needs a Hopper GPU (sm90); the device is {target.device_kind!r}"
    return None
  if target.platform == "cpu" and interpreting():
    return None
  if not target.concrete:
    return None  # tracing for a platform we cannot see: take the caller's word
  return (
      f"{implementation} compiles for {want.upper()}s; the arrays live on "
      f"{target.platform} ({target.device_kind!r}); "
      "use jaxkernels.interpret_mode() to run it on the CPU"
  )


def _reasons(
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
    setting = _interpret_setting()
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


def _first_serving(target: Target,
                   kernel_reasons: Mapping[str, str | None]) -> tuple[str | None, list[str]]:
  """The first kernel of the target's preference order that serves the call (None if none
  does), and why each one before it does not."""
  why_not = []
  for candidate in _auto_order(target):
    if candidate not in kernel_reasons:
      continue
    reason = _reasons(candidate, target, kernel_reasons)
    if reason is None:
      return candidate, why_not
    why_not.append(f"{candidate}: {reason}")
  return None, why_not


def choice(implementation: str | None, target: Target,
           kernel_reasons: Mapping[str, str | None]) -> str | None:
  """The kernel :func:`select` would run, asked quietly: None where it would fall back to the
  XLA reference or raise (a caller that then makes the call itself gets the warning or the
  error there)."""
  if implementation is None:
    return _first_serving(target, kernel_reasons)[0]
  if implementation == "xla" or _reasons(implementation, target, kernel_reasons) is not None:
    return None
  return implementation


def select(
    op: str,
    implementation: str | None,
    target: Target,
    kernel_reasons: Mapping[str, str | None],
) -> str:
  """Picks the implementation for one call of ``op``.

  Args:
    op: the public op's name, for messages.
    implementation: what the caller asked for (None: the best that serves).
    target: where the call runs (see :func:`target_of`).
    kernel_reasons: for each kernel the op has, None if its kernel can serve the
      call's shapes, dtypes and options, else the reason it cannot.
  """
  if implementation is not None:
    if implementation not in IMPLEMENTATIONS:
      raise ValueError(
          f"{op}: implementation={implementation!r} is not one of {IMPLEMENTATIONS} or None"
      )
    reason = _reasons(implementation, target, kernel_reasons)
    if reason is not None:
      raise ValueError(f"{op}: implementation={implementation!r} cannot serve this call: {reason}")
    return implementation
  chosen, why_not = _first_serving(target, kernel_reasons)
  if chosen is not None:
    return chosen
  if not why_not:
    why_not.append(f"no Pallas kernel runs on {target.platform} outside interpret mode")
  message = f"jaxkernels.{op}: using the XLA reference ({'; '.join(why_not)})"
  if (op, message) not in _WARNED:
    _WARNED.add((op, message))
    warnings.warn(message, FallbackWarning, stacklevel=_user_stacklevel())
  return "xla"


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
              "interpret": interpret_params(self.implementation, self.interpret)}
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
        args[first] = lowering_check(
            args[first], op=op, implementation=self.implementation, picked=picked,
            interpreted=self.interpret and interpreter_has_effects())
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
  chosen = select(op, implementation, target, kernel_reasons(problem, target, table))
  k = table.get(chosen)
  _checks.config_type(op, chosen, config, k.Config if k else None)
  if k is None or empty:
    return None
  if target.unsplit is not None:
    partitioning.refuse_or_fall_back(op, chosen, target.unsplit, picked=implementation is None)
    return None
  partitioning.check_mesh_in_context(op, chosen, picked=implementation is None)
  if interpreting():
    check_interpreter_threads(op, chosen)
  chip = target.chip_for(chosen)
  explicit = config is not None
  if config is None:
    config = tuning.config_for(k, problem, chip)
  elif (error := k.config_error(problem, config, chip)) is not None:
    raise ValueError(f"{op}: config={config} cannot run {problem} on "
                     f"implementation={chosen!r}: {error}")
  return Plan(k, config, chip, interpreting(), tuple(sorted(options.items())), explicit,
              (op, implementation is None) if target.unseen else None)


def supports(op: str, implementation: str, *args: Any, **kwargs: Any) -> Support:
  """Whether ``implementation`` can serve ``op(*args, **kwargs)`` where the arrays live.

  Example: ``jaxkernels.supports("rms_norm", "triton", x, scale)``. Argument
  errors (wrong shapes or dtypes) raise as the op itself would.
  """
  if op not in _REGISTRY:
    raise ValueError(f"supports: unknown op {op!r}; known: {sorted(_REGISTRY)}")
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"supports: implementation={implementation!r} is not one of {IMPLEMENTATIONS}"
    )
  registered = _REGISTRY[op]
  try:
    bound = registered.signature.bind(*args, **kwargs)
  except TypeError as e:  # the op's own signature refuses them, as a call would
    raise TypeError(f"supports({op!r}, ...): {op}{registered.signature} does not take these "
                    f"arguments: {e}") from None
  bound.apply_defaults()
  arguments = {k: v for k, v in bound.arguments.items() if k not in _DISPATCH_ARGUMENTS}
  checked = registered.op.validate(**arguments)
  problem = registered.op.problem(**checked)
  target = target_of(*checked.values())
  reason = _reasons(implementation, target,
                    kernel_reasons(problem, target, registered.op.kernels))
  return Support(reason is None, reason or "")
