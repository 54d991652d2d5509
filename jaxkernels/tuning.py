"""Kernel configs for every op: tuned tables, an on-device autotuner, and its cache on disk.

``config_for`` answers which Config an op's kernel runs a problem with, in this order:

1. the user's cache (``$JAXKERNELS_CACHE_DIR``, default ``~/.cache/jaxkernels``),
   filled by :func:`autotune` on their own device;
2. the tables we tuned on our GPUs, shipped in ``jaxkernels/data/tuned/<device>/<op>.json``;
3. the kernel's heuristic for the chip.

An op's kernels reach this module by registration (``dispatch.Kernels``, registered by the op's
api): this module imports no op. Entries are keyed by op, implementation, device kind, jax
version and the problem's own key (``problem.key()``: for the matmul, operand and output
dtypes, operand layout, epilogue and shape bucket). A dimension's bucket is the next power of
two up to 1024, a multiple of 128 past it (``_tiling.bucket``), so one tuning run covers the
neighbourhood of the shape it timed. The neighbourhood is narrow because a config's speed
turns on the waves of tiles it makes: the CTA tile tuned at 4096^3 (3.9 waves of 132 SMs on an
H200) makes 4 waves at 3840^3 with the last 41% full (notes/tiles.md, matmul-35). Shipped
tables are keyed without the jax version: they are a better start than a heuristic on any.

The autotuner times with ``jaxkernels.timing``, the timer the benchmarks judge configs by.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
from collections.abc import Callable, Iterable
from typing import Any

import jax

from jaxkernels import timing

_DATA = pathlib.Path(__file__).parent / "data" / "tuned"
# (op, implementation) -> the registered kernels (``dispatch.Kernels``): what a cached or
# shipped entry decodes into and is checked against.
_REGISTERED: dict[tuple[str, str], Any] = {}


def register(kernels: Any) -> None:
  """Makes ``kernels`` (op, implementation, Config, heuristic, config_error) tunable."""
  _REGISTERED[(kernels.op, kernels.implementation)] = kernels


def registered() -> list[tuple[str, str]]:
  """The (op, implementation) pairs that can be tuned."""
  return sorted(_REGISTERED)


def cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get("JAXKERNELS_CACHE_DIR",
                                     pathlib.Path.home() / ".cache" / "jaxkernels"))


def key(kernels: Any, problem: Any, device_kind: str, *, versioned: bool = True) -> str:
  parts = [kernels.op, kernels.implementation, device_kind.lower(), problem.key()]
  if versioned:
    parts.insert(3, f"jax{jax.__version__}")
  return "|".join(parts)


@functools.cache
def _shipped() -> dict[str, dict[str, Any]]:
  table: dict[str, dict[str, Any]] = {}
  for path in sorted(_DATA.glob("*/*.json")):
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


def config_for(kernels: Any, problem: Any, chip: Any, device_kind: str | None = None):
  """The Config ``kernels`` run ``problem`` with on ``chip``: cached, shipped, or heuristic."""
  kind = device_kind or (chip.device_kinds[0] if chip.device_kinds else chip.name)
  for table, versioned in ((_user_cache(), True), (_shipped(), False)):
    entry = table.get(key(kernels, problem, kind, versioned=versioned))
    if entry is not None:
      try:
        config = kernels.Config(**entry["config"])
        if kernels.config_error(problem, config, chip) is None:
          return config
      except (TypeError, ValueError):
        pass  # a stale entry (fields renamed): fall through to the heuristic
  return kernels.heuristic(problem, chip)


@dataclasses.dataclass(frozen=True)
class Trial:
  config: Any
  seconds: float | None  # None: did not compile or failed the check
  error: str = ""


def autotune(kernels: Any, problem: Any, candidates: Iterable[Any], *, chip: Any,
             make_inputs: Callable[[int], tuple], run: Callable[..., Any],
             check: Callable[[Any, tuple], bool] | None = None, save: bool = True,
             rounds: int = 5, calls: int = 2) -> tuple[Any, list[Trial]]:
  """Times each candidate config on the default device; caches and returns the fastest.

  Args:
    kernels: the op's registered kernels for one implementation (``dispatch.Kernels``).
    make_inputs: seed -> operands tuple (distinct sets defeat the L2 cache).
    run: (config, *operands) -> output, the kernel call to time.
    check: optional (output, operands) -> bool; a config whose output fails is skipped.
    rounds, calls: as for :func:`jaxkernels.timing.time_sets`.
  """
  device_kind = jax.devices()[0].device_kind
  arg_sets = [make_inputs(seed) for seed in range(4)]
  trials = []
  for config in candidates:
    if (error := kernels.config_error(problem, config, chip)) is not None:
      trials.append(Trial(config, None, error))
      continue
    fn = functools.partial(run, config)
    try:
      if check is not None and not check(jax.jit(fn)(*arg_sets[0]), arg_sets[0]):
        trials.append(Trial(config, None, "wrong result"))
        continue
      trials.append(Trial(config, timing.time_sets(fn, arg_sets, rounds=rounds, calls=calls)))
    except Exception as e:  # noqa: BLE001 - a config the compiler rejects is just a loser
      trials.append(Trial(config, None, f"{type(e).__name__}: {str(e)[:200]}"))
  timed = [t for t in trials if t.seconds is not None]
  if not timed:
    raise RuntimeError(f"autotune: no candidate ran for {problem}: "
                       + "; ".join(t.error for t in trials[:3]))
  best = min(timed, key=lambda t: t.seconds)
  if save:
    record(kernels, problem, device_kind, best.config, best.seconds)
  return best.config, trials


def record(kernels: Any, problem: Any, device_kind: str, config: Any, seconds: float) -> None:
  """Writes one winner into the user's cache (atomically: a reader never sees half a file)."""
  path = _cache_file()
  path.parent.mkdir(parents=True, exist_ok=True)
  table = _user_cache()
  table[key(kernels, problem, device_kind)] = {
      "config": dataclasses.asdict(config), "seconds": seconds}
  tmp = path.with_suffix(f".{os.getpid()}.tmp")
  tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
  tmp.replace(path)


def ship(cache_file: str | os.PathLike, out_dir: str | os.PathLike = _DATA, note: str = "") -> int:
  """Copies an autotune cache's entries into the shipped tables (keys without the jax version),
  one file per device kind and op: ``out_dir/<device>/<op>.json``.

  Run on what a tuning run on our GPU machine brought back; returns the number of entries.
  """
  entries = json.loads(pathlib.Path(cache_file).read_text())
  for k, v in entries.items():
    op, implementation, device_kind, *rest = k.split("|")
    parts = [op, implementation, device_kind, *(p for p in rest if not p.startswith("jax"))]
    out_path = pathlib.Path(out_dir) / device_kind.replace(" ", "_") / f"{op}.json"
    table = (json.loads(out_path.read_text()) if out_path.exists()
             else {"note": note, "entries": {}})
    table["entries"]["|".join(parts)] = v
    if note:
      table["note"] = note
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
  _shipped.cache_clear()
  return len(entries)
