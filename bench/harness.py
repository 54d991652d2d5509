"""Timing, checking and reporting shared by every suite.

Timing is ``jaxkernels.timing``'s, the autotuner's own (warm-up, rounds of back-to-back calls,
the median; a round's fixed cost cancelled). Every timed function is checked before it is timed
by the numerics rule the tests use (``jaxkernels.testing``: the float64 oracle, twice the naive
computation's error; ``Rule``); a wrong kernel is reported, never timed.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import pathlib
import platform as platform_module
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxkernels import dispatch, hardware, testing, tuning
from jaxkernels.timing import (block, over_sets, time_call, time_rounds, time_sets,  # noqa: F401
                               time_sets_rounds)

RESULTS = pathlib.Path(__file__).parent.parent / "results"  # the repository's, beside the code


@dataclasses.dataclass
class Row:
  suite: str
  name: str  # what was timed: "rms_norm+residual fwd"
  impl: str  # "triton", "xla", "torch", "jax_pallas_triton", ...
  shape: str
  dtype: str
  ms: float | None = None  # host clock, steady state (time_rounds)
  gbps: float | None = None
  tflops: float | None = None
  pct_roofline: float | None = None
  vs_xla: float | None = None  # xla time / this time, same run
  # Device time of the same program: the sum of its kernels' durations (CUPTI), without the
  # gaps between programs that the host clock above also counts (notes/rows.md, run 17).
  kernel_ms: float | None = None
  kernel_gbps: float | None = None
  kernel_vs_xla: float | None = None
  kernels: str | None = None  # "name time" for each kernel of one execution
  # Host clock of a whole round of ``calls`` programs, its fixed cost included (the headline
  # until run 32, notes/rows.md).
  round_ms: float | None = None
  error: float | None = None  # max |out - ref| / max |ref| over outputs
  tolerance: float | None = None
  config: str | None = None
  note: str = ""


@dataclasses.dataclass
class Session:
  """One `python -m bench` run: where it runs and what it found."""

  smoke: bool
  rounds: int
  calls: int
  rows: list[Row] = dataclasses.field(default_factory=list)
  # Called after each row: `python -m bench` rewrites its JSON, so that a run cut off by a time
  # limit keeps every row it measured.
  on_row: Callable[[], Any] | None = None
  printer: "Table | None" = None  # prints each row as it is added

  def __post_init__(self):
    self.device = jax.devices()[0]
    self.platform = dispatch.target_of().platform
    self.chip = hardware.chip_for(self.device.device_kind)
    self.interpret = self.platform == "cpu"

  @property
  def warmup(self) -> int:
    """Calls before a timing's rounds: one where the kernels are interpreted (it compiles; the
    interpreter has no caches to warm), else three (compile, autotune, first touch)."""
    return 1 if self.interpret else 3

  @property
  def kernel(self) -> str | None:
    """The kernel implementation this device runs (interpreted on a CPU)."""
    return {"gpu": "triton", "tpu": "mosaic_tpu"}.get(self.platform, "triton")

  def kernels(self, op: str | None) -> list[str]:
    """The implementations a case of ``op`` times: on a GPU each of the op's GPU kernels side
    by side (Mosaic GPU, then the Triton kernel it replaces); elsewhere, or for a case that
    names no op, :attr:`kernel`."""
    if self.platform != "gpu" or op is None:
      return [self.kernel]
    from jaxkernels import backend
    return [k for k in dispatch.PREFERENCE["gpu"] if k in backend.kernels(op)]

  @property
  def profiles(self) -> bool:
    """Kernel-only times by CUPTI: on a GPU, not in a smoke run (each profile compiles the
    program again: on the H100 the smoke run took over 180 s with them)."""
    return self.platform == "gpu" and not self.smoke

  @property
  def anchors(self) -> bool:
    """The other libraries' rows (cuDNN, torch, JAX's Pallas examples): on a GPU, not in a
    smoke run (a check of our kernels against the references)."""
    return self.platform == "gpu" and not self.smoke

  def add(self, row: Row) -> Row:
    self.rows.append(row)
    if self.printer is not None:  # each row once, as it is measured: a run cut off shows it
      self.printer.row(row)
    if self.on_row is not None:
      self.on_row()
    return row


def kernel_seconds(fn: Callable, arg_sets: Sequence[Sequence[Any]], *,
                   iterations: int = 10) -> tuple[float | None, str | None]:
  """Device seconds per execution of ``fn``, counting only its kernels, and what they were.

  The program of ``time_sets`` (``fn`` on every set back to back) runs ``iterations`` times
  under CUPTI (JAX's Mosaic GPU profiler); the time is the median over iterations of the sum
  of kernel durations, per set. Host-clock timing also counts what passes between kernels and
  programs on the device: at ~0.1 ms a kernel that was 7-12% of the norms' times on the H200
  (notes/rows.md, run 17), for every implementation alike. (None, None) where CUPTI is not
  available (no GPU, or a jaxlib without Mosaic GPU).
  """
  try:
    from jax.experimental.mosaic.gpu import profiler
  except ImportError:
    return None, None
  batched = over_sets(fn)
  sets = [tuple(args) for args in arg_sets]
  try:
    _, runs = profiler.measure(batched, aggregate=False, iterations=iterations)(sets)
  except RuntimeError:  # "CUPTI profiling is not supported on this platform"
    return None, None
  if not runs:
    return None, None
  runs = runs if iterations > 1 else [runs]
  totals = [sum(ms for _, ms in run) for run in runs]
  middle = runs[sorted(range(len(runs)), key=totals.__getitem__)[len(runs) // 2]]
  per_name: dict[str, float] = {}
  for name, ms in middle:
    per_name[name] = per_name.get(name, 0.0) + ms / len(sets)
  names = "; ".join(f"{name} {ms * 1e3:.1f}us" for name, ms in per_name.items())
  return statistics.median(totals) / 1e3 / len(sets), names


def sets_for(session: Session, bytes_per_set: int, budget: int = 3 << 30, most: int = 8) -> int:
  """How many distinct input sets to rotate through: up to ``most``, within ``budget`` bytes.
  A smoke or interpreted run has no timing to trust: one set (it checks that everything
  builds, runs and matches)."""
  if session.interpret or session.smoke:
    return 1
  return max(1, min(most, budget // max(bytes_per_set, 1)))


def memory_bytes(device, default: int = 24 << 30) -> int:
  """The device's memory for arrays (``default`` where it does not say, as on a CPU)."""
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return int((stats or {}).get("bytes_limit", default))


def relative_error(out, ref) -> float:
  """max |out - ref| / max |ref|, the worst over all leaves (jaxkernels.testing's measure)."""
  return max(testing.errors(out, ref), default=0.0)


class Rule:
  """The numerics rule (jaxkernels.testing) on one input set: the float64 oracle and the naive
  computation in the inputs' dtype, forward and every gradient, evaluated once; each timed
  program's outputs (``fwd``: the outputs; ``bwd``: the gradients in ``grads``; ``fwd+bwd``:
  both) are checked leaf by leaf against them.

  ``reference(compute_dtype)`` is a function of the primals. ``naive=False``: no naive
  computation bounds the error (fp8 on tensor cores, whose accuracy is documented instead): the
  tolerance is the floor, ``pointwise_rtol``.
  """

  def __init__(self, reference, primals, cotangent=None, *, dtype, reduction: int,
               grads: Sequence[int] = (), pointwise_rtol: float = 0.0, naive: bool = True):
    self.grads = tuple(grads)
    self.exact = testing.evaluate(reference, jnp.float64, primals, cotangent, host=False)
    self.naive = testing.evaluate(reference, dtype, primals, cotangent) if naive else None
    self.zero_scale = testing.input_scale(primals, cotangent)
    self.options = dict(reduction=reduction, pointwise_rtol=pointwise_rtol,
                        zero_scale=self.zero_scale)
    self.has_grads = cotangent is not None

  def _pick(self, label: str, result):
    if not self.has_grads:
      assert label == "fwd", label
      return result
    out, every = result
    grads = tuple(every[i] for i in self.grads)
    return {"fwd": out, "bwd": grads, "fwd+bwd": (out, grads)}[label]

  def verdict(self, label: str, got) -> tuple[float, float]:
    """(error, tolerance) of ``got``'s worst leaf: the one furthest over, or nearest to, its
    tolerance."""
    want = self._pick(label, self.exact)
    naive = None if self.naive is None else self._pick(label, self.naive)
    errors = testing.errors(got, want, self.zero_scale)
    allowed = testing.allowed(naive, want, **self.options)
    return max(zip(errors, allowed), key=lambda et: et[0] / et[1])


def torch_copy_seconds(session: Session, n_elements: int) -> float:
  """Median seconds of a torch device-to-device copy of n bf16 elements (CUDA events)."""
  import torch

  if not torch.cuda.is_available():
    raise ImportError("torch sees no CUDA device")
  src = torch.randn(n_elements, dtype=torch.bfloat16, device="cuda")
  dst = torch.empty_like(src)
  for _ in range(3):
    dst.copy_(src)
  torch.cuda.synchronize()
  times = []
  for _ in range(session.rounds):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(session.calls):
      dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / 1e3 / session.calls)
  return statistics.median(times)


def copy_bandwidth(session: Session) -> Row:
  """Device-to-device copy, bytes read + written per second: the memory ceiling of the run."""
  n = (1 << 30) if not session.smoke else (1 << 24)  # 2 GiB of bf16 (32 MiB smoke)
  try:
    seconds, impl = torch_copy_seconds(session, n), "torch"
  except ImportError:
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    seconds = time_call(jax.jit(lambda a: -a), (x,), rounds=session.rounds, calls=session.calls)
    impl = "xla(-x)"
  gbps = 2 * n * 2 / seconds / 1e9
  # torch's copy is timed with CUDA events over back-to-back copies: its device time, as the
  # kernel columns are; XLA's is host-clock time only.
  kernel = {"kernel_ms": seconds * 1e3, "kernel_gbps": gbps} if impl == "torch" else {}
  return session.add(Row("anchor", "copy", impl, f"({n},)", "bfloat16", ms=seconds * 1e3,
                         gbps=gbps, note="device-to-device copy: the bandwidth ceiling",
                         **kernel))


def git_commit() -> str:
  """The checkout's commit; JAXKERNELS_COMMIT where the tree travelled without .git."""
  if os.environ.get("JAXKERNELS_COMMIT"):
    return os.environ["JAXKERNELS_COMMIT"]
  try:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=pathlib.Path(__file__).parent, check=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, cwd=pathlib.Path(__file__).parent)
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def device_slug(device) -> str:
  kind = device.device_kind if device.platform != "cpu" else "cpu"
  return kind.lower().replace("nvidia ", "").replace(" ", "_")


ROOT = RESULTS.parent  # the repository


def shown_path(path) -> str:
  """``path`` as a person (and a committed log) should read it: relative to the repository
  where it lies inside it, else with the home directory as ~."""
  path = pathlib.Path(path).absolute()
  for base, shown in ((ROOT.absolute(), ""), (pathlib.Path.home(), "~/")):
    try:
      return shown + str(path.relative_to(base))
    except ValueError:
      continue
  return str(path)


def scrub(text: str) -> str:
  """``text`` (a log, a recorded command) with this machine's paths taken out, as committed
  results hold them: the repository's files relative to it, Python's as ``python`` and
  ``<site-packages>/...``, temporary directories as ``<tmp>``, the device call's output
  folder as ``$OUT``, the home directory as ``~``."""
  root = str(ROOT.absolute())
  text = text.replace(root + "/", "").replace(root, ".")
  for pattern, replacement in SCRUBBED:
    text = re.sub(pattern, replacement, text)
  return text.replace(str(pathlib.Path.home()) + "/", "~/")


# What ``scrub`` replaces; the results' hygiene test looks for what these leave behind.
SCRUBBED = (
    (r"/\S*?/site-packages/", "<site-packages>/"),
    (r"(?<![\w.~<>$-])/\S*?/lib/python[\d.]+/", "<python-lib>/"),  # a traceback's stdlib frames
    (r"(?<![\w.~<>$-])/\S*/bin/python[\d.]*", "python"),
    (r"(?<![\w.~<>$-])/tmp/[\w.-]+", "<tmp>"),
    (r"(?<![\w.~<>$-])/root/out\b", "$OUT"),
)


def default_out(session: Session) -> pathlib.Path:
  """Where a run's JSON goes: results/<device>/ for measurements, to be committed; a
  smoke run's (small shapes, a check that everything runs) to the cache directory, outside the
  clone."""
  if not session.smoke:
    return RESULTS / device_slug(session.device)
  return tuning.cache_dir() / "bench-smoke" / device_slug(session.device)


def save(session: Session, suites: Sequence[str], out_dir: str | None,
         path: pathlib.Path | None = None) -> pathlib.Path:
  """Writes the session's rows as JSON (to ``path``, or a new stamped file) and returns where."""
  record = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "command": scrub(" ".join(["python -m bench", *sys.argv[1:]])),
      "commit": git_commit(),
      "device": session.device.device_kind,
      "platform": session.platform,
      "jax": jax.__version__,
      "jaxlib": getattr(jax.lib, "__version__", None) or jax.__version__,
      "python": platform_module.python_version(),
      "interpret_mode": session.interpret,
      "smoke": session.smoke,
      "timing": (f"ms: host clock, steady state: median over {session.rounds} rounds of (time of "
                 f"{2 * session.calls} back-to-back calls - time of {session.calls}) / "
                 f"{session.calls}; round_ms: the {session.calls}-call round alone, its start-up "
                 "and sync included; kernel_ms (GPU): CUPTI sum of kernel durations, median of "
                 "10 runs"),
      "suites": list(suites),
      "rows": [dataclasses.asdict(r) for r in session.rows],
  }
  if path is None:
    directory = pathlib.Path(out_dir) if out_dir else default_out(session)
    directory.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    path = directory / f"{stamp}_{'-'.join(suites)}{'_smoke' if session.smoke else ''}.json"
  path.write_text(json.dumps(record, indent=1))
  return path


def _fmt(value, spec):
  return "" if value is None else format(value, spec)


def _sig(value, digits=3):
  """``value`` to ``digits`` significant figures, with thousands grouped, never in an
  exponent (a CPU's 0.0004 GB/s reads as that, not as 0)."""
  if value is None:
    return ""
  if value == 0 or not math.isfinite(value):
    return f"{value:g}"
  places = max(digits - 1 - math.floor(math.log10(abs(value))), 0)
  return f"{value:,.{places}f}"


# The table's columns: (header, width, what it shows, shown on a CPU, the row's text); on a
# CPU only those so marked (the interpreter's times say nothing of speed, rates from them less).
_COLUMNS = (
    ("suite", 13, "the bench suite", True, lambda r: r.suite),
    ("op", 30, "what was timed: the op and its pass (fwd, bwd, fwd+bwd)", True,
     lambda r: r.name),
    ("impl", 18, "who ran it: our kernel backend, xla, or an anchor (cudnn, torch, ...)",
     True, lambda r: r.impl),
    ("shape", 22, "the problem's shape", True, lambda r: r.shape),
    ("dtype", 9, "the inputs' dtype (f8_ for float8_)", True,
     lambda r: r.dtype.replace("float8_", "f8_")),
    ("ms", 9, "milliseconds a call, steady state (median of rounds; host clock)", True,
     lambda r: _sig(r.ms)),
    ("GB/s", 7, "bytes the op must move over ms (the memory-bound ops' measure)", False,
     lambda r: _sig(r.gbps)),
    ("TFLOP/s", 7, "tera floating-point operations a second (the products' measure)", False,
     lambda r: _sig(r.tflops)),
    ("%roof", 6, "percent of the device's roofline for this op (hardware.py)", False,
     lambda r: _fmt(r.pct_roofline, ".1f")),
    ("xla/this", 8, "XLA's ms over this row's ms, same run: above 1 is faster than XLA",
     False, lambda r: _fmt(r.vs_xla, ".2f")),
    ("kernel ms", 9, "the same program's device time alone (CUPTI; GPUs)", False,
     lambda r: _sig(r.kernel_ms)),
    ("error", 16, "max |out - ref| / max |ref| against the float64 oracle, then the "
     "tolerance the numerics rule allows; ! marks one over it", True,
     lambda r: "" if r.error is None else (
         f"{r.error:.1e}" + ("" if r.tolerance is None else
                             f"{' <=' if r.error <= r.tolerance else ' !>'} {r.tolerance:.0e}"))),
    ("note", 0, "[n]: note n below the table (a failure, a predicted figure, a config)", True,
     None),
)


class Table:
  """The rows as one table on stdout, each printed once as it is measured, under a header
  that says what each column is; notes (a row's failure, what a predicted figure counts)
  come after it, numbered."""

  def __init__(self, interpret: bool, stream=None):
    self.stream = sys.stdout if stream is None else stream
    self.columns = [c for c in _COLUMNS if c[3] or not interpret]
    self.interpret, self.notes, self.xla = interpret, [], {}

  def header(self) -> None:
    out = self.stream
    if self.interpret:
      print("On a CPU the Pallas kernels run in INTERPRET mode: each row checks a kernel "
            "against the float64 oracle; its ms is the interpreter's and says nothing of "
            "speed (no rates are shown).", file=out)
    print("Columns:", file=out)
    for name, _, what, *_ in self.columns:
      print(f"  {name:<9} {what}", file=out)
    print(self._line([name for name, *_ in self.columns]), file=out)
    out.flush()

  def _line(self, cells) -> str:
    return "  ".join(str(c).ljust(w) if w else str(c)
                     for c, (_, w, *_) in zip(cells, self.columns)).rstrip()

  def row(self, row: Row) -> None:
    key = (row.suite, row.name, row.shape, row.dtype)
    if row.impl == "xla":
      self.xla[key] = row
    elif row.vs_xla is None and row.ms and key in self.xla and self.xla[key].ms:
      # The suites set it once every way of a case has run; printed as it runs, a row takes
      # it from XLA's row of the same case, timed just before.
      row = dataclasses.replace(row, vs_xla=self.xla[key].ms / row.ms)
    cells = []
    for name, width, _, _, text in self.columns:
      if text is None:  # the note's number
        text_of_note = " | ".join(filter(None, (row.note, row.config and f"config {row.config}")))
        if text_of_note:
          self.notes.append(text_of_note)
        cells.append(f"[{len(self.notes)}]" if text_of_note else "")
      else:
        cell = str(text(row))
        cells.append(cell if len(cell) <= width else cell[:width - 1] + "~")
    print(self._line(cells), file=self.stream, flush=True)

  def footer(self) -> None:
    for i, note in enumerate(self.notes, 1):
      print(f"[{i}] {' '.join(note.split())}", file=self.stream)
    self.stream.flush()


def environment_line(session: Session) -> str:
  mode = "kernels interpreted" if session.interpret else "compiled kernels"
  return (f"device: {session.device.device_kind} ({session.platform}); jax {jax.__version__}; "
          f"{mode}; {os.cpu_count()} CPUs")


# --------------------------------------------------------------------------- #
# One op, forward and forward+backward, every implementation, against the oracle
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Case:
  """What a suite times for one op at one shape.

  ``op(implementation, config)`` and ``reference(compute_dtype)`` return
  functions of the primal arguments; ``inputs(seed)`` draws (primals,
  cotangents); ``grads`` picks the gradients the timed step returns (a fused
  residual's gradient is dx's array: returning it twice would add a copy).
  """

  suite: str
  name: str
  inputs: Callable[[int], tuple[tuple, Any]]
  op: Callable[[str, Any], Callable]
  reference: Callable[[Any], Callable]
  fwd_cost: Any
  bwd_cost: Any
  grads: tuple[int, ...]
  dtype: Any
  reduction: int  # the longest reduction, forward or backward (the rule's float32 floor)
  sweep: dict[str, list] = dataclasses.field(default_factory=dict)  # label -> kernel configs
  anchors: dict[str, Callable] = dataclasses.field(default_factory=dict)  # fwd-only extras
  pointwise_rtol: float = 0.0  # documented per-element accuracy (the activations')
  registered: str | None = None  # the registered op timed (its GPU kernels side by side)


class Timed:
  """An implementation's forward, backward and forward+backward as jitted programs.

  Forward+backward is one program with an optimization barrier between the
  two halves: the forward's outputs and residuals reach HBM before the
  backward starts, as in a training step, where the rest of the network runs
  in between. Without it XLA fuses the forward into the backward (glu: 5275
  GB/s, above the copy); as two programs, jit boundaries add copies of
  residuals that are also inputs or outputs.
  """

  def __init__(self, fn, grads):
    # vjp_fn runs once: called once per gradient, XLA merged the Triton calls but ran a Mosaic
    # GPU attention backward kernel of two outputs twice (notes/attn.md attention-5).
    def bwd(vjp_fn, cts):
      every = vjp_fn(cts)
      return tuple(every[i] for i in grads)

    def fwd_bwd(primals, cts):
      out, vjp_fn = jax.vjp(fn, *primals)
      out, vjp_fn = jax.lax.optimization_barrier((out, vjp_fn))
      return out, bwd(vjp_fn, cts)

    self.programs = {"fwd": jax.jit(lambda primals, cts: fn(*primals)),
                     "fwd+bwd": jax.jit(fwd_bwd), "bwd": jax.jit(bwd)}
    self.vjp_fwd = jax.jit(lambda primals: jax.vjp(fn, *primals)[1])

  def _args(self, label, primals, cts):
    return (self.vjp_fwd(primals), cts) if label == "bwd" else (primals, cts)

  def outputs(self, label, primals, cts):
    return self.programs[label](*self._args(label, primals, cts))

  def arg_sets(self, label, sets):
    """The program's arguments for each input set (the backward's: the forward's residuals)."""
    return [self._args(label, *s) for s in sets]


def run_case(session: Session, case: Case, *, sweep: bool = False) -> None:
  import contextlib

  import jaxkernels as jk

  context = jk.interpret_mode if session.interpret else contextlib.nullcontext
  first = case.inputs(0)
  # Many sets a program: what a program costs beyond its kernels (dispatch, the first launch,
  # the sync) is then shared by many kernels, as in a training step. With 4 sets of the norms
  # it was 7-12% of the time; 16 negates a program ran at 87 us a negate against 105 for one,
  # 81 us of kernel (notes/rows.md, run 17). A set is each input twice over (the residuals
  # the backward reads), so an eighth of the device's memory holds 4 x budget / 8 sets' worth.
  n_sets = sets_for(
      session, 2 * sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(first)),
      budget=memory_bytes(session.device) // 8, most=16)
  sets = [first] + [case.inputs(seed) for seed in range(1, n_sets)]
  shape = "x".join(map(str, jax.tree.leaves(first[0])[0].shape))
  costs = {"fwd": case.fwd_cost, "bwd": case.bwd_cost,
           "fwd+bwd": case.fwd_cost + case.bwd_cost}
  if session.interpret:  # a check, not a timing: forward+backward checks every output and
    costs = {"fwd+bwd": costs["fwd+bwd"]}  # gradient at once (a CPU's make bench: 3x sooner)
  # The float64 oracle and the naive computation's error, forward and backward, once.
  rule = Rule(case.reference, *first, dtype=case.dtype, reduction=case.reduction,
              grads=case.grads, pointwise_rtol=case.pointwise_rtol)
  for label, cost in costs.items():

    def measure(impl, fn, config=None, check=True):
      row = Row(case.suite, f"{case.name} {label}", impl, shape, jnp.dtype(case.dtype).name,
                config=repr(config) if config is not None else None)
      try:
        with context():
          timed = Timed(fn, case.grads)
          if check:
            row.error, row.tolerance = rule.verdict(label, timed.outputs(label, *first))
            if not row.error <= row.tolerance:
              row.note = (f"WRONG: error {row.error:.2e} > tolerance {row.tolerance:.2e}; "
                          "not timed")
              return session.add(row)
          program, arg_sets = timed.programs[label], timed.arg_sets(label, sets)
          seconds, whole = time_sets_rounds(program, arg_sets, rounds=session.rounds,
                                            calls=session.calls, warmup=session.warmup)
          row.round_ms = whole * 1e3
          if session.profiles:
            kernel, row.kernels = kernel_seconds(program, arg_sets)
            if kernel:
              row.kernel_ms, row.kernel_gbps = kernel * 1e3, cost.bytes / kernel / 1e9
      except Exception as e:  # noqa: BLE001 - a kernel that fails to build is a row
        row.note = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
        return session.add(row)
      row.ms = seconds * 1e3
      row.gbps = cost.bytes / seconds / 1e9
      if session.chip is not None:
        row.pct_roofline = cost.percent_of_roofline(seconds, session.chip)
      return session.add(row)

    xla = measure("xla", case.op("xla", None))
    kernels = session.kernels(case.registered)
    rows = [measure(k, case.op(k, None)) for k in kernels]
    sweep_label = "fwd+bwd" if label == "bwd" else label
    if sweep and not session.interpret and label != "fwd+bwd":
      rows += [measure(session.kernel, case.op(session.kernel, c), c)  # the sweep's configs
               for c in case.sweep.get(sweep_label, [])]  # are the Triton kernel's
    if label == "fwd" and session.anchors:
      rows += [measure(name, fn, check=False) for name, fn in case.anchors.items()]
    for row in rows:
      if row.ms and xla.ms:
        row.vs_xla = xla.ms / row.ms
      if row.kernel_ms and xla.kernel_ms:
        row.kernel_vs_xla = xla.kernel_ms / row.kernel_ms


def child(module: str, function: str, args: dict, timeout: float = 540) -> dict:
  """``bench.<module>.<function>(**args)`` in a process of its own (its peak memory its own,
  an out-of-memory its own), its JSON result; where it fails, {"error": what}."""
  code = (f"import json, sys; from bench import {module}; "
          f"print('RESULT ' + json.dumps({module}.{function}(**json.loads(sys.argv[1]))))")
  try:
    done = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True,
                          text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout:.0f} s"}
  for line in done.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT "):])
  tail = (done.stderr or done.stdout).strip().splitlines()
  if any("RESOURCE_EXHAUSTED" in line or "out of memory" in line.lower() for line in tail):
    return {"error": "out of memory"}
  errors = [line for line in tail if "Error" in line and not line.startswith("For simplicity")]
  return {"error": (errors or tail or [f"exit {done.returncode}"])[-1][:400]}

