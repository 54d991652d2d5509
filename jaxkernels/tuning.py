"""Kernel configs: tuned tables, an on-device autotuner, and its cache on disk.

``config_for`` answers which Config a kernel runs a problem with, in this order:

1. the user's cache (``$JAXKERNELS_CACHE_DIR``, default ``~/.cache/jaxkernels``),
   filled by :func:`autotune` on their own device;
2. the tables we tuned on our GPUs, shipped in ``jaxkernels/data/tuned/``;
3. the kernel's heuristic for the device kind.

Entries are keyed by implementation, device kind, jax version, operand and
output dtypes, operand layout, and shape bucket (each dimension rounded up to a
power of two up to 1024, to a multiple of 128 past it), so one tuning run covers
the neighbourhood of the shape it timed. The neighbourhood is narrow because a
config's speed turns on the waves of tiles it makes: the CTA tile tuned at 4096^3
(3.9 waves of 132 SMs on an H200) makes 4 waves at 3840^3 with the last 41% full
(bench/NOTES.md, matmul-35). Shipped tables are keyed
without the jax version: they are a better start than a heuristic on any.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkernels._pallas import next_pow2, round_up

_DATA = pathlib.Path(__file__).parent / "data" / "tuned"


def cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get("JAXKERNELS_CACHE_DIR",
                                     pathlib.Path.home() / ".cache" / "jaxkernels"))


def bucket(size: int) -> int:
  return next_pow2(size) if size <= 1024 else round_up(size, 128)


def key(implementation: str, problem: Any, device_kind: str, *, versioned: bool = True) -> str:
  p = problem
  layout = ("t" if p.trans_a else "n") + ("t" if p.trans_b else "n")
  # Problems with an activation are tuned apart from plain and bias/residual-only ones: the
  # epilogue's arithmetic is part of what a config is timed on.
  epilogue = "act" if getattr(p, "activation", None) else "plain"
  dims = "x".join(str(bucket(d)) for d in (p.m, p.n, p.k))
  parts = [implementation, device_kind.lower(), f"{jnp.dtype(p.dtype)}->{jnp.dtype(p.out_dtype)}",
           layout, epilogue, dims]
  if versioned:
    parts.insert(2, f"jax{jax.__version__}")
  return "|".join(parts)


def _module(implementation: str):
  from jaxkernels.ops.matmul.api import _KERNELS
  return _KERNELS[implementation]


def _decode(implementation: str, fields: dict[str, Any]):
  return _module(implementation).Config(**fields)


@functools.cache
def _shipped() -> dict[str, dict[str, Any]]:
  table: dict[str, dict[str, Any]] = {}
  for path in sorted(_DATA.glob("*.json")):
    table.update(json.loads(path.read_text())["entries"])
  return table


def _cache_file() -> pathlib.Path:
  return cache_dir() / "tuning.json"


def _user_cache() -> dict[str, dict[str, Any]]:
  """The user's cache, read again only when the file changes (config_for runs on every trace)."""
  path = _cache_file()
  try:
    stat = path.stat()
  except OSError:
    return {}
  return dict(_parsed(str(path), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=4)
def _parsed(path: str, mtime_ns: int, size: int) -> dict[str, dict[str, Any]]:
  del mtime_ns, size  # the key: a rewritten file is parsed afresh
  try:
    return json.loads(pathlib.Path(path).read_text())
  except (OSError, json.JSONDecodeError):
    return {}  # a damaged cache is a miss, not a crash; the next autotune rewrites it


def config_for(implementation: str, problem: Any, chip: Any, device_kind: str | None = None):
  """The Config ``implementation`` runs ``problem`` with on ``chip``: cached, shipped, or heuristic."""
  kind = device_kind or (chip.device_kinds[0] if chip.device_kinds else chip.name)
  for table, versioned in ((_user_cache(), True), (_shipped(), False)):
    entry = table.get(key(implementation, problem, kind, versioned=versioned))
    if entry is not None:
      try:
        config = _decode(implementation, entry["config"])
        if _module(implementation).config_error(problem, config, chip) is None:
          return config
      except (TypeError, ValueError):
        pass  # a stale entry (fields renamed): fall through to the heuristic
  return _module(implementation).heuristic(problem, chip)


@dataclasses.dataclass(frozen=True)
class Trial:
  config: Any
  seconds: float | None  # None: did not compile or failed the check
  error: str = ""


def over_sets(fn: Callable[..., Any]) -> Callable[[Sequence[tuple]], list[Any]]:
  """One jitted program that runs ``fn(*args)`` for every ``args`` in its list of input sets."""
  return jax.jit(lambda sets: [fn(*args) for args in sets])


def time_on_device(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, rounds: int = 5,
                   calls: int = 1, warmup: int = 1) -> float:
  """Median seconds per call of ``fn`` on the device: one jitted program runs it on every
  input set back to back, so a host dispatch is paid once per ``len(arg_sets)`` calls (a 0.2 ms
  product timed one dispatch at a time measured the dispatch). Each round times ``calls`` such
  programs after ``warmup`` untimed ones; distinct sets keep the L2 from serving repeats."""
  batched = over_sets(fn)
  sets = [tuple(args) for args in arg_sets]
  for _ in range(warmup):
    jax.block_until_ready(batched(sets))
  samples = []
  for _ in range(rounds):
    start = time.perf_counter()
    for _ in range(calls):
      out = batched(sets)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - start) / calls / len(sets))
  return float(np.median(samples))


def autotune(implementation: str, problem: Any, candidates: Iterable[Any], *, chip: Any,
             make_inputs: Callable[[int], tuple], run: Callable[..., Any],
             check: Callable[[Any, tuple], bool] | None = None, save: bool = True,
             rounds: int = 5) -> tuple[Any, list[Trial]]:
  """Times each candidate config on the default device; caches and returns the fastest.

  Args:
    make_inputs: seed -> operands tuple (distinct sets defeat the L2 cache).
    run: (config, *operands) -> output, the kernel call to time.
    check: optional (output, operands) -> bool; a config whose output fails is skipped.
  """
  device_kind = jax.devices()[0].device_kind
  arg_sets = [make_inputs(seed) for seed in range(4)]
  trials = []
  for config in candidates:
    if (error := _module(implementation).config_error(problem, config, chip)) is not None:
      trials.append(Trial(config, None, error))
      continue
    fn = jax.jit(functools.partial(run, config))
    try:
      if check is not None and not check(fn(*arg_sets[0]), arg_sets[0]):
        trials.append(Trial(config, None, "wrong result"))
        continue
      trials.append(Trial(config, time_on_device(fn, arg_sets, rounds=rounds)))
    except Exception as e:  # noqa: BLE001 - a config the compiler rejects is just a loser
      trials.append(Trial(config, None, f"{type(e).__name__}: {str(e)[:200]}"))
  timed = [t for t in trials if t.seconds is not None]
  if not timed:
    raise RuntimeError(f"autotune: no candidate ran for {problem}: "
                       + "; ".join(t.error for t in trials[:3]))
  best = min(timed, key=lambda t: t.seconds)
  if save:
    record(implementation, problem, device_kind, best.config, best.seconds)
  return best.config, trials


def record(implementation: str, problem: Any, device_kind: str, config: Any,
           seconds: float) -> None:
  """Writes one winner into the user's cache (atomically: a reader never sees half a file)."""
  path = _cache_file()
  path.parent.mkdir(parents=True, exist_ok=True)
  table = _user_cache()
  table[key(implementation, problem, device_kind)] = {
      "config": dataclasses.asdict(config), "seconds": seconds}
  tmp = path.with_suffix(f".{os.getpid()}.tmp")
  tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
  tmp.replace(path)


def ship(cache_file: str | os.PathLike, out_file: str | os.PathLike, note: str = "") -> int:
  """Copies an autotune cache's entries into a shipped table (keys without the jax version).

  Run on what a tuning run on our GPU machine brought back; returns the number of entries.
  """
  entries = json.loads(pathlib.Path(cache_file).read_text())
  out_path = pathlib.Path(out_file)
  table = json.loads(out_path.read_text()) if out_path.exists() else {"note": note, "entries": {}}
  for k, v in entries.items():
    parts = k.split("|")
    table["entries"]["|".join(p for p in parts if not p.startswith("jax"))] = v
  if note:
    table["note"] = note
  out_path.parent.mkdir(parents=True, exist_ok=True)
  out_path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
  return len(entries)
