"""The committed results, read: each result file as a :class:`Run`, and per (device, suite,
op, shape, dtype) the :class:`Line` the report shows (our best kernel beside the best anchor of
the newest run that timed both), stale where a kernel came after it. ``bench.report`` renders
them."""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
from typing import Any

# Our implementations, as result rows name them; every other name below is an anchor.
OURS = ("mosaic_gpu", "triton", "mosaic_tpu", "jaxkernels")
ANCHORS = ("xla", "cublas(torch)", "cudnn", "torch", "torch_sdpa", "optax", "jax_pallas_tpu",
           "jax_pallas_triton", "jax_pallas_mgpu", "jax_pallas_mgpu_example",
           "jax_splash_tpu", "jax_splash_maxtext",  # splash bare, and as MaxText calls it
           "plain JAX")  # plain JAX: bench/plain_llama.py, the model step's
FAMILIES = (("norms, elementwise, softmax", ("norms", "elementwise", "softmax")),
            ("cross-entropy", ("cross_entropy",)), ("matmul", ("matmul",)),
            ("attention", ("attention",)), ("model step", ("model",)))


@dataclasses.dataclass(frozen=True)
class Run:
  """One result file: where it came from and its rows."""

  path: pathlib.Path
  device: str
  date: str
  commit: str
  jax: str
  rows: tuple[dict[str, Any], ...]

  @property
  def short_commit(self) -> str:
    """The commit as ``git rev-parse --short`` gives it (JAXKERNELS_COMMIT may be a whole
    hash), with any "-dirty"."""
    word = self.commit.split()[0] if self.commit.split() else "?"
    sha, _, rest = word.partition("-")
    if len(sha) == 40 and all(c in "0123456789abcdef" for c in sha):
      word = sha[:7] + ("-" + rest if rest else "")
    return word


def load(results: pathlib.Path) -> list[Run]:
  """Every full-size result file of the standard schema under ``results`` (one folder a
  device), oldest first. Smoke runs, config sweeps and files of another schema (an
  experiment's own records) are left out."""
  runs = []
  for path in sorted(results.glob("*/*.json")):
    if "sweep" in path.stem or "smoke" in path.stem:
      continue
    try:
      record = json.loads(path.read_text())
    except (OSError, ValueError):
      continue
    rows = record.get("rows") if isinstance(record, dict) else None
    if (not isinstance(rows, list) or record.get("smoke") or record.get("interpret_mode")
        or not all(isinstance(r, dict) and {"suite", "name", "impl", "ms"} <= r.keys()
                   for r in rows)):
      continue
    runs.append(Run(path, record.get("device", path.parent.name), record.get("date", ""),
                    record.get("commit", "?"), record.get("jax", "?"), tuple(rows)))
  return sorted(runs, key=lambda run: run.date)


def impl_of(row) -> str:
  """The implementation a row times: its impl, but for the model step's rows, which name the
  remat policy after a comma ("jaxkernels, remat dots": each side's best policy competes)."""
  return row["impl"].split(",")[0] if row["suite"] == "model" else row["impl"]


def _key(row) -> tuple:
  return row["suite"], row["name"], row.get("shape") or "", row.get("dtype") or ""


@dataclasses.dataclass(frozen=True)
class Line:
  """One shape of one op on one device: our best kernel and the best anchor of one run."""

  run: Run
  suite: str
  name: str
  shape: str
  dtype: str
  ours: dict[str, Any]
  anchor: dict[str, Any]
  others: tuple[dict[str, Any], ...]  # every timed row of the key in that run
  # Our kernels that a run of the suite on the device first timed after this line's run (a
  # kernel added since, Mosaic GPU's on Hopper, say): the line measures a library that is gone,
  # and is marked and left out of the summary.
  stale: tuple[str, ...] = ()

  @property
  def speedup(self) -> float:
    """The best anchor's time over ours: > 1 where we are faster."""
    return self.anchor["ms"] / self.ours["ms"]


def lines(runs: list[Run]) -> dict[str, list[Line]]:
  """By device, one Line per (suite, op, shape, dtype): from the newest run that timed one of
  our kernels and every anchor an older run timed there (a run cut short, or one without
  torch, does not put a weaker baseline in the best one's place)."""
  newest: dict[tuple[str, tuple], Line] = {}
  for run in runs:  # oldest first: a newer run replaces an older one's line
    timed = collections.defaultdict(list)
    for row in run.rows:
      # Timed, and not wrong; a compile time (bench model --compile) is no step's time.
      if row["ms"] is not None and within_tolerance(row) and ": compile" not in row["name"]:
        timed[_key(row)].append(row)
    for key, rows in timed.items():
      ours = [r for r in rows if impl_of(r) in OURS]
      anchors = [r for r in rows if impl_of(r) in ANCHORS]
      if not ours or not anchors:
        continue
      older = newest.get((run.device, key))
      if older is not None and not ({impl_of(r) for r in older.others if impl_of(r) in ANCHORS}
                                    <= {impl_of(r) for r in anchors}):
        continue
      best = lambda rs: min(rs, key=lambda r: r["ms"])
      newest[run.device, key] = Line(run, *key, best(ours), best(anchors),
                                     tuple(r for r in rows if impl_of(r) in OURS + ANCHORS))
  first = {}  # (device, suite, one of our impls) -> the date a run first timed it
  for run in runs:  # oldest first
    for row in run.rows:
      if row["ms"] is not None and impl_of(row) in OURS and within_tolerance(row):
        first.setdefault((run.device, row["suite"], impl_of(row)), run.date)
  by_device: dict[str, list[Line]] = collections.defaultdict(list)
  for (device, _), line in sorted(newest.items(), key=lambda kv: kv[0]):
    added = tuple(sorted(impl for (d, suite, impl), date in first.items()
                         if d == device and suite == line.suite and date > line.run.date))
    by_device[device].append(dataclasses.replace(line, stale=added))
  return dict(by_device)


def within_tolerance(row) -> bool:
  """A row checked against its reference and found within its tolerance (or not checked)."""
  error, tolerance = row.get("error"), row.get("tolerance")
  return error is None or tolerance is None or error <= tolerance
