"""The train step's lowered program, kept across runs of the CLI.

JAX's persistent compilation cache spares a second run XLA's compile, but not what comes
before it: tracing the step and lowering it to StableHLO, which JAX must do to find the
cache's key. For plain JAX that is ~0.6 s at 350m; for the kernels' step it is most of a
second run (each Mosaic GPU kernel's lowering, 0.3-0.6 s, about 7 s a step on an H200,
notes/paths.md gpu-paths-3). ``jax.export`` serializes a lowered program: :class:`Program`
keeps the step's, keyed by everything that decides it, and a run that finds it calls it
instead of tracing again (and then finds XLA's compile in the compilation cache).

What decides the program, and so the key: the versions of JAX, jaxlib, Flax and optax, the
device kind, count and platform version, the source of ``jaxkernels`` and ``models`` (every
file; a tuned table is data the kernels' configs come from), the environment's
``JAXKERNELS_*`` variables, JAX's configuration, the caller's description of the run (model
and training config, mesh), and the shapes, dtypes and shardings of the step's arguments. A
program that fails to load is written again, not trusted.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import pathlib
import warnings

import jax
from jax import export

from jaxkernels import _triton_files

ROOTS = ("jaxkernels", "models")  # the packages whose source is in the key
SUFFIX = ".jax-exported"


def _versions() -> dict:
  out = {}
  for name in ("jax", "jaxlib", "flax", "optax"):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def sources_digest() -> str:
  """The SHA-256 of every file (path and content) under the packages of ROOTS."""
  digest = hashlib.sha256()
  top = pathlib.Path(__file__).resolve().parent.parent
  for root in ROOTS:
    for path in sorted((top / root).rglob("*")):
      if path.is_file() and "__pycache__" not in path.parts:
        digest.update(str(path.relative_to(top)).encode() + b"\0" + path.read_bytes() + b"\0")
  return digest.hexdigest()


def _aval(x) -> str:
  sharding = getattr(x, "sharding", None)
  return f"{jax.typeof(x)} {sharding}"


def key(described, args) -> str:
  """The key of the program for ``args`` (a pytree of arrays) of a run that ``described``
  (JSON-able) describes; see the module's docstring for what goes in."""
  devices = jax.devices()
  parts = {
      "described": described,
      "versions": _versions(),
      "devices": [devices[0].platform, devices[0].device_kind, len(devices),
                  getattr(devices[0].client, "platform_version", None)],
      "sources": sources_digest(),
      "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("JAXKERNELS_")},
      "config": {k: repr(v) for k, v in sorted(jax.config.values.items())},
      "arguments": [str(jax.tree.structure(args))] + [_aval(x) for x in jax.tree.leaves(args)],
  }
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()


def _custom_calls_allowed() -> list:
  """Custom calls of ours (and cuDNN's attention, the XLA path's) that export's safety checks
  refuse for want of a compatibility promise; a kept program is loaded only by the same
  versions that wrote it, so none is needed."""
  triton = _triton_files.optional("jaxkernels._triton")  # None: no Triton kernels to allow
  targets = [] if triton is None else [triton.CUSTOM_CALL]
  try:  # cuDNN's fused attention's targets, by JAX's own naming of them
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    targets += sorted(set(getattr(cudnn, "_custom_name_maps", {}).values()))
  except Exception:  # noqa: BLE001 - only a narrower list: its export then fails and says so
    pass
  return [export.DisabledSafetyCheck.custom_call(t) for t in targets]


class Program:
  """The step ``fn(state, tokens) -> (state, metrics)`` (unjitted), for arguments like
  ``state`` and ``tokens``, through a program kept in ``directory`` (written there if it is
  not yet). ``lowered`` is its ``jax.stages.Lowered`` (``compile()`` it); ``loaded`` says
  whether it came from the directory; call the compiled program through :meth:`run`."""

  def __init__(self, fn, state, tokens, *, directory, described, donate: bool = True,
               compiler_options: dict | None = None):
    self.treedef = jax.tree.structure(state)
    leaves = jax.tree.leaves(state)
    directory = pathlib.Path(directory)
    path = directory / (key(described, (state, tokens)) + SUFFIX)
    exported = None
    if path.exists():
      try:
        exported = export.deserialize(bytearray(path.read_bytes()))
      except Exception as e:  # noqa: BLE001 - a damaged file is written again
        warnings.warn(f"the kept train step {path} did not load ({type(e).__name__}: {e}); "
                      "lowering it again", stacklevel=2)
    self.loaded = exported is not None
    if exported is None:
      exported = export.export(jax.jit(self._flat(fn)), disabled_checks=_custom_calls_allowed())(
          leaves, tokens)
      directory.mkdir(parents=True, exist_ok=True)
      part = path.with_suffix(f".{os.getpid()}.part")
      part.write_bytes(exported.serialize())
      os.replace(part, path)  # whole or not at all, whoever else writes it
    self.path = path
    self.lowered = jax.jit(exported.call, donate_argnums=0 if donate else (),
                           compiler_options=compiler_options).lower(leaves, tokens)

  def _flat(self, fn):
    treedef = self.treedef

    def flat(leaves, tokens):
      state, metrics = fn(jax.tree.unflatten(treedef, leaves), tokens)
      out, out_def = jax.tree.flatten(state)
      if out_def != treedef:
        raise ValueError(f"the train step's state changed its structure: {treedef} -> {out_def}")
      return out, metrics
    return flat

  def run(self, compiled, state, tokens):
    """``compiled`` (``self.lowered.compile()``) on (state, tokens) -> (state, metrics)."""
    leaves, metrics = compiled(jax.tree.leaves(state), tokens)
    return jax.tree.unflatten(self.treedef, leaves), metrics
