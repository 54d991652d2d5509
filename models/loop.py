"""The training loop: steps, progress bar (loss, tokens/s, MFU), metrics, checkpoints on a
schedule and on SIGINT/SIGTERM, and the outcome of a run."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import queue
import signal
import sys
import threading
import time

import jax
from flax import nnx

from jaxkernels import hardware
from models import llama
from models.checkpointing import Checkpoints, resumed_warmup, run_identity
from models.hparams import TrainConfig, UsageError
from models.batches import batch_at, batch_on, corpus
from models.placement import describe_shape, device_limit, held, in_bytes, layout, mesh
from models.train_step import abstract_state, auto_remat, init, lower_step

class Progress:
  """Every ``every`` steps and at the last: one line redrawn in place on a terminal, on a
  pipe a line each."""

  def __init__(self, total: int, every: int, stream=sys.stderr):
    self.total, self.every, self.stream = total, every, stream
    self.live = stream.isatty()

  def due(self, step: int) -> bool:
    """Whether step ``step`` gets a line."""
    return step % self.every == 0 or step == self.total

  def show(self, step: int, text: str) -> None:
    if self.live:
      done = int(30 * step / self.total)
      self.stream.write(f"\r[{'#' * done}{'.' * (30 - done)}] {step}/{self.total} {text}")
      if step == self.total:
        self.stream.write("\n")
      self.stream.flush()
    else:
      print(f"step {step}/{self.total} {text}", file=self.stream, flush=True)


def peak_flops(devices) -> float | None:
  chip = hardware.chip_for(devices[0].device_kind)
  return None if chip is None else chip.peak_flops["bfloat16"] * len(devices)


class Interrupted(KeyboardInterrupt):
  """A second SIGINT or SIGTERM while training: the run stops at once, unsaved."""

  def __init__(self, number: int):
    super().__init__(signal.Signals(number).name)
    self.number = number


class Stopper:
  """SIGINT (Ctrl-C) and SIGTERM while training: the first says at once that the run stops
  after the step in flight (and saves it, with a checkpoint directory); the loop then
  finishes that step, saves and returns instead of dying mid-step. A second raises
  :class:`Interrupted` at once (unless a save is being written: then as it ends, so that a
  checkpoint is never left half-written). The loop waits for the device through
  :func:`waited`, so that a signal is handled as it arrives, not when the wait returns."""

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self, stream=sys.stderr, saves: bool = False):
    self.stream, self.saves = stream, saves
    self.received: int | None = None
    self.again: int | None = None  # a second signal that arrived during a save
    self.saving = False
    self._before = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():  # signals reach only it
      for number in self.SIGNALS:
        self._before[number] = signal.signal(number, self._receive)
    return self

  def _receive(self, number, frame):
    del frame
    name = signal.Signals(number).name
    if self.received is None:
      self.received = number
      then = ("then saves it" if self.saves else "and saves nothing (no --checkpoint-dir)")
      print(f"\n{name}: the run stops once the step in flight ends, {then}; {name} again "
            "stops it at once, unsaved", file=self.stream, flush=True)
    elif self.saving:
      self.again = number
      print(f"\n{name} again: a checkpoint is being written; the run stops as it ends",
            file=self.stream, flush=True)
    else:
      raise Interrupted(number)

  @contextlib.contextmanager
  def save(self):
    """A checkpoint's save: a second signal waits for it to end."""
    self.saving = True
    try:
      yield
    finally:
      self.saving = False
    if self.again is not None:
      raise Interrupted(self.again)

  def __exit__(self, *exc):
    for number, handler in self._before.items():
      signal.signal(number, handler)


def waited(fn, *args):
  """``fn(*args)`` (a wait for the device, a compile) on a worker thread, waited for here: the
  main thread then handles a signal as it arrives (a lock's wait is interrupted by one), not
  when a call into XLA returns, seconds later on a slow step. One worker for the process,
  fed by a queue (a thread started a call cost ~100 us, 3% of a tiny step)."""
  if threading.current_thread() is not threading.main_thread():
    return fn(*args)
  global _jobs
  if _jobs is None:
    _jobs = queue.SimpleQueue()
    threading.Thread(target=_work, args=(_jobs,), daemon=True, name="jaxkernels-wait").start()
  done, out = threading.Event(), {}
  _jobs.put((fn, args, done, out))
  done.wait()
  if "error" in out:
    raise out["error"]
  return out["value"]


_jobs: queue.SimpleQueue | None = None
_busy = threading.Event()  # the worker is in a call (one a second signal left behind)


def abandoned() -> bool:
  """Whether a call :func:`waited` stopped waiting for (a second signal) is still running: the
  process must then leave with ``os._exit``, since an interpreter that finalizes while its
  thread waits inside XLA aborts ("terminate called ... FATAL: exception not rethrown")."""
  return _busy.is_set()


def _work(jobs: queue.SimpleQueue) -> None:
  while True:
    fn, args, done, out = jobs.get()
    _busy.set()
    try:
      out["value"] = fn(*args)
    except BaseException as e:  # noqa: BLE001 - raised again in the waiting thread
      out["error"] = e
    finally:
      _busy.clear()
      done.set()


@dataclasses.dataclass
class Outcome:
  """What a call of :func:`train` did: the losses of the steps it ran, and why it stopped
  early (None where it reached ``tc.steps``)."""

  losses: list[float]
  stopped: str | None = None
  code: int = 0  # the CLI's exit status: 0, 1 (the loss diverged), 128 + a signal's number
  tokens_per_s: float | None = None  # over the last interval shown
  step: int | None = None  # the last step run
  saved: int | None = None  # the step of the last checkpoint (None: none in the directory)


def train(cfg: llama.Config, tc: TrainConfig, *, corpus_path: str | None = None,
          checkpoint_dir: str | None = None, checkpoint_every: int = 100,
          mesh_sizes: dict[str, int] | None = None, metrics_path: str | None = None,
          log_every: int = 10,
          remat_budget: int | None = None, stream=None) -> Outcome:
  """Trains to ``tc.steps``, resuming from ``checkpoint_dir``'s latest checkpoint.
  ``remat_budget``: bytes a device for remat="auto" (default: 95% of the device's memory).

  Stops early, saying why, where a step's loss or gradient norm is not finite (no checkpoint
  is written from that step on: the last one holds the last good state) or where SIGINT or
  SIGTERM arrives (the step in flight finishes and is saved)."""
  stream = sys.stderr if stream is None else stream
  if jax.process_index() != 0:  # one process of several speaks and writes the metrics
    stream, metrics_path = open(os.devnull, "w"), None  # noqa: SIM115 - for the whole run
  if checkpoint_every < 1 or log_every < 1:
    raise UsageError(f"--checkpoint-every {checkpoint_every} and --log-every {log_every}: "
                     "each must be at least 1")
  data, described = corpus(corpus_path)
  batch_at(data, 0, tc)  # a corpus shorter than one batch fails here, before anything is written
  where = mesh(**(mesh_sizes or {}))
  cfg = cfg.for_platform(where.devices.flat[0].platform)
  on = f"--mesh {describe_shape(where.shape)} ({where.size} devices)"
  rows = math.prod(where.shape[a] for a in llama.BATCH)
  if tc.batch % rows:
    raise UsageError(f"--batch {tc.batch} must be a multiple of the {rows} devices of data x "
                     f"fsdp that split it ({on})")
  if cfg.fp8 and where.size > 1:
    raise UsageError(f"--fp8 runs on one device ({on}): its blocks' quantization is not yet "
                     "laid out over a mesh; use --mesh data=1 with one device, or leave --fp8 "
                     "out")
  if tc.seq_len % where.shape["sequence"]:
    raise UsageError(f"--seq-len {tc.seq_len} must be a multiple of the sequence axis' "
                     f"{where.shape['sequence']} devices that split it ({on})")
  abstract = abstract_state(cfg, tc)
  try:  # before anything is written: the layout of the model's shapes alone
    llama.check_divides(abstract, where)
  except ValueError as e:
    raise UsageError(f"{on}: {e}") from e
  params, moments = held(abstract, where)
  if (limit := device_limit(where)) is not None and params + moments > limit:
    raise UsageError(
        f"{on}: a device would hold {in_bytes(params)} of parameters and {in_bytes(moments)} of "
        f"optimizer state, more than its {in_bytes(limit)}; spread them over more devices (a "
        "larger fsdp or tensor axis)")
  checkpoints = None
  if checkpoint_dir is not None:
    checkpoints = Checkpoints(checkpoint_dir)
    tc = resumed_warmup(tc, checkpoints.there)
    checkpoints.check(run_identity(cfg, tc, data))
  start = (checkpoints.latest() if checkpoints is not None else None) or 0  # where it resumes
  if cfg.remat == "auto" and start >= tc.steps:
    # No step will run, so none to fit: no probe (each candidate is a compile of the step).
    # Remat changes no shape: the state restores as it would under any policy.
    cfg = dataclasses.replace(cfg, remat="none")
  elif cfg.remat == "auto":
    try:
      cfg, choice = auto_remat(cfg, tc, remat_budget, where)
    except ValueError as e:  # no plan fits --remat-budget
      raise UsageError(str(e)) from e
    print(choice, file=stream, flush=True)
  graphdef, state = init(cfg, tc, where)
  if start:
    state = checkpoints.restore(start, state)
  kernels = cfg.kernels + (f" (on XLA: {', '.join(cfg.reference_ops)})"
                           if cfg.reference_ops and cfg.kernels != "xla" else "")
  print(f"kernels={kernels}; corpus: {described}; mesh {dict(where.shape)}; "
        f"{sum(x.size for x in jax.tree.leaves(nnx.state(state, nnx.Param)))/1e6:.1f}M "
        f"parameters; " + (f"resumed at step {start}" if start else "from step 0"),
        file=stream, flush=True)
  print("layout:\n" + "\n".join(layout(state, where)), file=stream, flush=True)
  if start >= tc.steps:
    print(f"nothing to do: the checkpoint is at step {start} of {tc.steps} (a larger --steps "
          "trains on)", file=stream)
  progress = Progress(tc.steps, log_every, stream)
  peak = peak_flops(list(where.devices.flat))
  report = functools.partial(report_step, cfg=cfg, tc=tc, peak=peak, progress=progress)
  outcome = Outcome([], saved=start if checkpoints is not None and start else None)
  with contextlib.ExitStack() as stack:
    if metrics_path:
      os.makedirs(os.path.dirname(os.path.abspath(metrics_path)), exist_ok=True)
    metrics_file = stack.enter_context(open(metrics_path, "a")) if metrics_path else None
    stopper = stack.enter_context(Stopper(stream, saves=checkpoints is not None))
    stack.enter_context(jax.set_mesh(where))
    try:
      run_steps(outcome, stopper, start, cfg, tc, graphdef, state, data, where, checkpoints,
                checkpoint_every, report, progress, metrics_file, stream)
    except Interrupted as e:
      kept = (f"the last checkpoint, step {outcome.saved}: the same command resumes there"
              if outcome.saved is not None else "nothing saved")
      outcome.stopped = (f"stopped during step {(outcome.step or start) + 1} by a second "
                         f"{signal.Signals(e.number).name}; {kept}")
      outcome.code = 128 + e.number
  if checkpoints is not None:
    checkpoints.close()
  return outcome


def run_steps(outcome, stopper, start, cfg, tc, graphdef, state, data, where, checkpoints,
              checkpoint_every, report, progress, metrics_file, stream) -> None:
  """Compiles the step and runs it from ``start`` to ``tc.steps``, into ``outcome``."""
  if start < tc.steps:  # compiled here, to say how long it took (the calls below reuse it)
    began = time.perf_counter()
    lowered, run, loaded = lower_step(cfg, tc, graphdef, state,
                                      batch_on(data, start, tc, where), where)
    lowered_at = time.perf_counter()
    compiled = waited(lowered.compile)
    step = run(compiled)
    how = " (the program kept by an earlier run)" if loaded else ""
    print(f"train step: traced and lowered in {lowered_at - began:.1f} s{how}, compiled in "
          f"{time.perf_counter() - lowered_at:.1f} s", file=stream, flush=True)
    if (memory := compiled.memory_analysis()) is not None:
      print(f"  a device's step needs {memory.temp_size_in_bytes / 2**20:.1f} MiB beyond its "
            "arguments (activations and the gradients' buffers, as compiled)", file=stream,
            flush=True)
  pending, meter = None, Meter(start, tc.batch * tc.seq_len)

  def flush():
    """Reports the pending step; False where its numbers are not finite."""
    nonlocal pending
    done, metrics = pending
    loss, grad_norm = report(done, metrics, meter, metrics_file=metrics_file)
    outcome.losses.append(loss)
    outcome.tokens_per_s, outcome.step = meter.shown or meter.step_rate, done
    pending = None
    if math.isfinite(loss) and math.isfinite(grad_norm):
      return True
    kept = (f"the last checkpoint, step {outcome.saved}, holds the last good state"
            if outcome.saved else "no checkpoint was written")
    outcome.stopped = (f"stopped at step {done}: its loss is {loss} and its gradients' norm "
                       f"{grad_norm}; {kept}. Try a lower --learning-rate or --clip")
    outcome.code = 1
    return False

  for s in range(start, tc.steps):
    state, metrics = step(state, batch_on(data, s, tc, where))
    if pending is not None and not flush():  # the previous step's, read while this one runs
      return
    pending = (s + 1, metrics)
    # The signal read once a step: one landing between the save's decision and the stop's
    # (while the step was waited for, say) stopped the run unsaved, saying it had saved (the
    # GPU check: SIGINT at step 55, resumed from 0). One that lands after this read is the
    # next step's.
    received = stopper.received
    save = checkpoints is not None and (
        received is not None or s + 1 == tc.steps or (s + 1) % checkpoint_every == 0)
    # A step that gets a line is waited for here, right after it is dispatched: its clock
    # is then read as it finishes whether the device or the host is the slower, and each
    # line's interval holds its own steps (read one step behind, as the others are, a run
    # whose host is the slower showed the last line at twice the rate: nothing followed it).
    if save or received is not None or progress.due(s + 1):
      if not flush():  # never save a state that a non-finite step made
        return
      if save:
        with stopper.save():
          checkpoints.save(s + 1, state)
          outcome.saved, meter.saves = s + 1, meter.saves + 1
    if received is not None and s + 1 < tc.steps:
      name = signal.Signals(received).name
      outcome.stopped = (f"stopped at step {s + 1} by {name}; " + (
          "saved: the same command resumes" if checkpoints is not None else
          "nothing saved (no --checkpoint-dir)"))
      outcome.code = 128 + received
      return
  if pending is not None:
    flush()


class Meter:
  """Tokens/s over each shown interval of steps. The clock is read as soon as a step's result
  is on the host, before anything is printed or written: read after the report, the report's
  own time fell out of the next interval and the rate was over-counted. (The loop waits for
  each shown step as it is dispatched, so that its clock is read as it finishes.)"""

  def __init__(self, step: int, tokens_per_step: int):
    self.tokens_per_step = tokens_per_step
    self.step, self.at = step, time.perf_counter()  # the last step ready, and when
    self.since, self.since_at = self.step, self.at  # where the shown interval began
    self.step_rate: float = 0.0  # the last step's tokens/s
    self.shown: float | None = None  # the last shown interval's tokens/s
    self.saves = 0  # checkpoints written in the interval: their time is in its rate

  def ready(self, step: int) -> None:
    """Step ``step``'s result is on the host."""
    now = time.perf_counter()
    self.step_rate = (step - self.step) * self.tokens_per_step / max(now - self.at, 1e-9)
    self.step, self.at = step, now

  def interval(self) -> float:
    """Tokens/s since the last shown interval ended, which this one now ends."""
    rate = (self.step - self.since) * self.tokens_per_step / max(self.at - self.since_at, 1e-9)
    self.since, self.since_at, self.shown = self.step, self.at, rate
    return rate

  def said(self) -> str:
    """What the shown interval held beside its steps (then forgotten)."""
    saves, self.saves = self.saves, 0
    return f" (with {saves} checkpoint save{'s' * (saves > 1)})" if saves else ""


def report_step(step, metrics, meter, *, cfg, tc, peak, progress, metrics_file):
  metrics = waited(jax.device_get, metrics)  # waits for the step
  meter.ready(step)
  loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
  if progress.due(step):
    rate = meter.interval()
    mfu = f"{llama.mfu(cfg, rate, tc.seq_len, peak):.1f}%" if peak else "n/a"
    progress.show(step, f"loss {loss:.4f} | {rate:,.0f} tokens/s | MFU {mfu}{meter.said()}")
  if metrics_file:
    metrics_file.write(json.dumps({"step": step, "loss": loss, "grad_norm": grad_norm,
                                   "tokens_per_s": meter.step_rate}) + "\n")
    metrics_file.flush()
  return loss, grad_norm
