"""The op pipeline: every public op is one :class:`Op`, declared in its api.py, and every call
of every op runs through :func:`call` the same way: validate, split where the arrays are split
(``partitioning``), plan (``dispatch``), then run the kernels or fall back to the reference.

The call carries one typed object from start to end: the op's :class:`Args`, a frozen
dataclass of its validated arguments (and the internal knobs a split sets, declared as fields
of their own), which every hook of the op takes. A sharded op's hooks that run the call again
on a shard get a :class:`Local`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import jax.numpy as jnp
import numpy as np

from jax._src import core  # the trace stack (forward_mode)
from jax._src.interpreters import ad

from jaxkernels import dispatch, partitioning, tuning
from jaxkernels.dispatch import IMPLEMENTATIONS, Kernels, Plan, Support
from jaxkernels.interpret import interpreter_has_effects

_A = TypeVar("_A", bound="Args")


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Args:
  """The base of each op's validated arguments: an op declares its own subclass, a frozen
  dataclass (``@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)``) whose fields
  are the public op's arguments as ``validate`` normalizes them, and the knobs only the
  pipeline sets (a weight's compute dtype under a split, say), with their defaults."""

  def replace(self: _A, **changed: Any) -> _A:
    """These arguments with some changed (a shard's arrays, say); a name that is not a field
    raises TypeError."""
    return dataclasses.replace(self, **changed)

  def values(self) -> tuple[Any, ...]:
    return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


def _no_options(args: Args) -> Mapping[str, Any]:
  del args
  return {}


def _no_elements(args: Args) -> bool:
  """Whether any array among the call's arguments has no elements."""
  return any(hasattr(a, "shape") and 0 in tuple(a.shape) for a in args.values())


@dataclasses.dataclass(frozen=True, kw_only=True)
class Op:
  """One public op, declared once in its api.py; :func:`call` runs every call of every op the
  same way. Each hook but ``validate`` takes the call's :class:`Args` (``args``), what
  ``validate`` returned, or a shard's copy of it.

  Fields:
    name: the public op's name, as errors, warnings, :func:`supports` and the tuning tables
      say it.
    kernels: its kernels by implementation (``dispatch.Kernels``).
    validate: ``(**arguments) -> Args``: every argument of the public op but implementation
      and config, by name, checked and normalized (a clear error naming the argument).
    problem: ``(args) -> the call's Problem`` (see ``dispatch.Kernels``), for one device.
    reference: ``(args) -> result``: the pure-jnp reference, XLA's ops (the fallback).
    kernel: ``(plan, args) -> result``: the call on ``plan``'s kernels (the custom_vjp).
    options: ``(args) -> static keyword arguments for every kernel of the call``.
    empty: ``(args) -> bool``: the reference serves the call (default: an array has no
      elements).
    rule: ``(args) -> the split rule`` (``partitioning.Rule``, by argument name), or None for
      an op that never splits itself.
    out: ``(rule, args) -> the result's dims`` (a tree of dims tuples or PartitionSpecs;
      default: the rule's first operand's).
    across: ``(split, rule, local, args) -> result``, for an op whose shards do more than run
      side by side (a row-parallel product's sum, a loss's reduction): ``local`` (a
      :class:`Local`) runs the call on one shard. Default: ``split.run`` of the call on each
      shard, the result laid out by ``out``.
    compose: ``(local, args) -> result or None``: where the call is served by a composition of
      ops (matmul's glu where no kernel takes the gated product whole), its result; else None
      and the call runs as any other.
    composed: ``(args) -> Args``, with ``compose``: the arguments of the call of this op that
      the composition starts with (matmul's glu: the plain product), which :func:`supports`
      asks about where no kernel takes the call whole.
    xla_too: the reference splits with the kernels too (see ``partitioning.split``).
    forward: ``(args) -> result``: what runs under forward-mode differentiation, where the
      reference is itself a custom_vjp (a loss computed chunk by chunk); default: the
      reference.
  """

  name: str
  kernels: Mapping[str, Kernels]
  validate: Callable[..., Args]
  problem: Callable[[Any], Any]
  reference: Callable[[Any], Any]
  kernel: Callable[[Plan, Any], Any]
  options: Callable[[Any], Mapping[str, Any]] = _no_options
  empty: Callable[[Any], bool] = _no_elements
  rule: Callable[[Any], partitioning.Rule] | None = None
  out: Callable[[partitioning.Rule, Any], Any] | None = None
  across: Callable[[partitioning.Split, partitioning.Rule, Local, Any], Any] | None = None
  compose: Callable[[Local, Any], Any] | None = None
  composed: Callable[[Any], Args] | None = None
  xla_too: bool = False
  forward: Callable[[Any], Any] | None = None


@dataclasses.dataclass(frozen=True)
class Local:
  """One call of ``op`` on one device, or one shard: the caller's implementation and config,
  and the validated arguments. Called, it runs (``local(**changed)``: with some arguments
  changed, a shard's arrays say) on the plan's kernels or the reference, as an unsplit call
  would."""

  op: Op
  implementation: str | None
  config: Any
  args: Args

  def __call__(self, **changed: Any) -> Any:
    return _local(self.op, self.implementation, self.config, self.args.replace(**changed))

  def plan(self, **changed: Any) -> Plan | None:
    """The plan (None: the reference) of the call with some arguments changed: for an op that
    runs its kernels more than once a shard (ring attention's blocks), which run on it."""
    chosen = _plan(self.op, self.implementation, self.config, self.args.replace(**changed))
    _record(self.op.name, chosen)
    return chosen

  def unsplit(self) -> bool:
    """Whether the call runs unsplit: no array of it laid out over a mesh, and no mesh of Auto
    axes in context."""
    arrays = [a for a in self.args.values() if hasattr(a, "shape")]
    return not any(partitioning.layout(a) for a in arrays) and partitioning.auto_mesh() is None

  def kernel(self) -> str | None:
    """The kernel dispatch would take for this call as it is, asked quietly: None where it
    would fall back to the reference or refuse (the call that then runs warns or raises)."""
    target = dispatch.target_of(*self.args.values())
    problem = self.op.problem(self.args)
    reasons = dispatch.kernel_reasons(problem, target, self.op.kernels)
    return dispatch.choice(self.implementation, target, reasons,
                           dispatch.on_request(self.op.kernels, problem))


@dataclasses.dataclass(frozen=True)
class _Registered:
  op: Op
  signature: inspect.Signature  # the public op's


_REGISTRY: dict[str, _Registered] = {}
_DISPATCH_ARGUMENTS = ("implementation", "config")


def register(op: Op, public: Callable[..., Any]) -> Op:
  """Registers ``op`` (its kernels with tuning too) and its public function ``public``, whose
  signature :func:`supports` binds a call's arguments to, so that it takes them exactly as the
  op does. Returns ``op``."""
  for k in op.kernels.values():
    tuning.register(k)
  _REGISTRY[op.name] = _Registered(op, inspect.signature(public))
  return op


def _validated(op: Op, arguments: Mapping[str, Any]) -> Args:
  # NumPy arrays as JAX takes them: a float64 one is float32 where x64 is off (dispatched as
  # float64, it fell back to XLA with a warning, for a dtype JAX would never compute in).
  arguments = {name: jnp.asarray(value) if isinstance(value, np.ndarray) else value
               for name, value in arguments.items()}
  args = op.validate(**arguments)
  if not isinstance(args, Args):
    raise TypeError(f"{op.name}: its validate returned {type(args).__name__}, not its Args")
  return args


def call(op: Op, implementation: str | None, config: Any, /, **arguments: Any) -> Any:
  """One call of ``op``: its arguments validated; where they are split (a mesh of Explicit
  axes, or Auto axes in context with the logical axis rules), the op's rule run per shard
  (``partitioning``); then on one device (or shard) the plan for the call (``dispatch``) and
  its kernels, else the reference."""
  args = _validated(op, arguments)
  local = Local(op, implementation, config, args)
  if op.compose is not None and (out := op.compose(local, args)) is not None:
    return out
  if op.rule is not None:
    rule = op.rule(args)
    arrays = {name: getattr(args, name) for name in rule if hasattr(args, name)}
    where = partitioning.split(op.name, implementation, arrays, rule, xla_too=op.xla_too,
                               nest=not interpreter_has_effects())
    if where is not None:
      if op.across is not None:
        return op.across(where, rule, local, args)
      out = op.out(rule, args) if op.out is not None else next(iter(rule.values()))
      return where.run(local, arrays, rule, out)
  return _local(op, implementation, config, args)


def _local(op: Op, implementation: str | None, config: Any, args: Args) -> Any:
  """The validated call on one device, or one shard. Under forward-mode differentiation
  (:func:`forward_mode`) the reference runs, planned or not: the kernels' backward is a
  ``jax.custom_vjp``, which JAX cannot differentiate forward."""
  chosen = _plan(op, implementation, config, args)
  if forward_mode():
    _record(op.name, None)
    return (op.forward or op.reference)(args)
  _record(op.name, chosen)
  return op.reference(args) if chosen is None else op.kernel(chosen, args)


def plan_call(op: Op, implementation: str | None, /, **arguments: Any) -> Plan | None:
  """The plan (None: the reference) that a call of ``op`` with these arguments, unsplit,
  would take: for an op that runs another op's kernels inside its own custom_vjp (matmul's
  gated product runs glu's backward), through the same validation and dispatch as a call."""
  chosen = _plan(op, implementation, None, _validated(op, arguments))
  _record(op.name, chosen)
  return chosen


@dataclasses.dataclass(frozen=True)
class Served:
  """One op call as it was traced: the op, and the implementation whose code ran it ("xla":
  the reference, by choice, by fallback or under forward mode)."""

  op: str
  implementation: str


_SERVED: contextvars.ContextVar[tuple[list[Served], ...]] = contextvars.ContextVar(
    "jaxkernels_served", default=())


@contextlib.contextmanager
def served() -> Iterator[list[Served]]:
  """Records what served each op call traced inside: a list of :class:`Served`, filled as the
  calls are traced (a jitted function that is not traced again, its program cached, adds
  nothing). For tests that must know a kernel ran, not the fallback that computes the same
  numbers: ``with jk.testing.served() as calls: ...``, then assert on ``calls``."""
  calls: list[Served] = []
  token = _SERVED.set((*_SERVED.get(), calls))
  try:
    yield calls
  finally:
    _SERVED.reset(token)


def _record(op: str, chosen: Plan | None) -> None:
  for calls in _SERVED.get():
    calls.append(Served(op, "xla" if chosen is None else chosen.implementation))


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


def _plan(op: Op, implementation: str | None, config: Any, args: Args) -> Plan | None:
  return dispatch.plan(op.name, implementation, dispatch.target_of(*args.values()),
                       op.problem(args), op.kernels, config, empty=op.empty(args),
                       **op.options(args))


def ops() -> list[str]:
  """The registered ops' names (each public op's)."""
  return sorted(_REGISTRY)


def kernels(op: str) -> Mapping[str, Kernels]:
  """``op``'s registered kernels by implementation (for tuning a config by hand, say)."""
  if op not in _REGISTRY:
    raise ValueError(f"unknown op {op!r}; known: {sorted(_REGISTRY)}")
  return _REGISTRY[op].op.kernels


def registered() -> Mapping[str, Op]:
  """Every registered op by name (for the structure tests and the docs)."""
  return {name: r.op for name, r in _REGISTRY.items()}


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
  op = registered.op
  checked = _validated(op, arguments)
  target = dispatch.target_of(*checked.values())
  ask = lambda args: dispatch.reasons(implementation, target, dispatch.kernel_reasons(
      op.problem(args), target, op.kernels))
  reason = ask(checked)
  if reason is not None and op.composed is not None:  # its composition's first call
    reason = ask(op.composed(checked))
  return Support(reason is None, reason or "")
