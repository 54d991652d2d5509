"""python -m bench.gpu_check [--out DIR] [--only STEP,...]

The check a developer runs on the GPU machine before resolving anything that touches a kernel,
the model or the CLI: what a user runs, compiled on the GPU.

Steps, each a process of its own with a time limit, its output in the log:
  versions     jax, jaxlib, the device
  tests        the compiled test cases of every kernel family (JAXKERNELS_TEST_COMPILED=1),
               the Flax drop-ins and the model; the ops on a one-device mesh of Explicit axes
  readme       every command the README shows (bench/readme.py), at the README's own sizes: a
               train command for a few steps (then again, where it checkpoints: it must see
               the run whole), `make bench` as what it runs, `python -m bench`
  train-125m   `--preset 125m` with the kernels, killed (SIGKILL) after its step-20 checkpoint and
               run again: it must resume there and give the same losses as before the kill
  interrupt    `--preset tiny` sent SIGINT mid-run: it saves, says so and exits 130; the same
               command resumes
Each step's output reaches the log as it comes; no step runs past the check's budget (--budget,
540 s: a device command's limit is 600; `--only` splits the check over two calls). A table of
the steps closes the output. The log goes to --out (default: a directory under the system's
temporary one, never into the clone; pass results/<device> to commit it) as
<time>_gpu_check_jax<version>.log, with this machine's paths taken out (``harness.scrub``) and
without the tests' per-case lines (the summary names every failure).

Without a GPU it refuses in one line (exit 2). Each step runs in a process group of its own,
which is killed when the step ends, at its limit, and when the check itself ends however it
ends (an exception, Ctrl-C, SIGTERM from a timeout): no training run outlives it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).parent.parent
# The compiled tests: every kernel family, the Flax drop-ins, the model, and the ops on a
# one-device mesh. The CPU-only tests (dispatch, interpret mode, 8 host devices) skip there.
# The slowest first (the model's cases compile whole train steps): with 16 workers, 96% of the
# cases were done in 250 s and the model's, collected last, were still running.
TEST_FILES = ("test_models.py", "test_one_device_mesh.py", "test_flax.py",
              "test_attention_mosaic.py", "test_attention.py", "test_decode.py",
              "test_matmul.py", "test_matmul_glu.py", "test_matmul_fp8.py",
              "test_matmul_schedules.py", "test_cross_entropy.py", "test_norms.py",
              "test_elementwise.py", "test_softmax.py", "test_cases.py", "test_testing.py", "test_forward_mode.py",
              "test_debug_flags.py", "test_fp8.py", "test_value_checks.py", "test_drop_in.py")


# No deprecated JAX API in any call the compiled tests make (a DeprecationWarning fails its
# test), but Pallas Triton's own deprecation: its kernels stay for GPUs before Hopper. CI's
# jax 0.12 leg (.ci/latest-jax) runs the same rule on the CPU.
NO_DEPRECATED_API = ("-W", "error::DeprecationWarning",
                     "-W", "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


# The tests compile hundreds of small XLA programs (references, oracles) whose speed is not the
# point: XLA's GEMM autotuning off for them. The train steps and the bench keep it (a user's).
NO_AUTOTUNING = " ".join(
    f for f in (os.environ.get("XLA_FLAGS", ""), "--xla_gpu_autotune_level=0") if f)


@dataclasses.dataclass
class Outcome:
  name: str
  ok: bool
  seconds: float
  summary: str


# pytest -v's lines for each case (scheduled, passed, skipped): on stdout as they come, so that
# a step cut off by its limit still names its failures there; left out of the committed log
# (~880 cases twice over, 200 KB), whose summary names every failure and error.
_PER_CASE = re.compile(r"^(tests/\S+::\S+ ?|\[gw\d+\] \[ *\d+%\] (PASSED|SKIPPED) .*)\n?$")


class Log:
  def __init__(self, path: pathlib.Path):
    from bench import harness
    self.path, self.scrub = path, harness.scrub
    path.parent.mkdir(parents=True, exist_ok=True)
    self.file = open(path, "w")

  def write(self, text: str) -> None:
    kept = "".join(line for line in text.splitlines(keepends=True)
                   if not _PER_CASE.match(line))
    self.file.write(self.scrub(kept))
    self.file.flush()
    sys.stdout.write(text)
    sys.stdout.flush()


def _env(**extra) -> dict:
  # The repository first, then whatever the caller put on the path (a carried jax wheel's
  # directory: replaced, the steps once ran the machine's jax instead of the one under test).
  path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
  return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


# The whole check's end (time.monotonic()): no step runs past it (main sets it from --budget).
DEADLINE = float("inf")


def _within(limit: float) -> float:
  """``limit`` seconds, or what is left of the check's budget where that is less."""
  return max(1.0, min(limit, DEADLINE - time.monotonic()))


_CHILDREN: set[subprocess.Popen] = set()  # the steps' processes, each leading its group


def _die_with_parent() -> None:  # in the child, before exec: Linux's PR_SET_PDEATHSIG
  try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
  except (OSError, AttributeError):  # not Linux: the group's kill on exit still holds
    pass


def _spawn(argv, **env) -> subprocess.Popen:
  """``argv`` from the repository's root, in a process group of its own (its own children,
  pytest's workers say, go with it), stdout and stderr on one pipe; killed with the check."""
  process = subprocess.Popen(argv, cwd=ROOT, env=_env(**env), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True,
                             preexec_fn=_die_with_parent)
  _CHILDREN.add(process)
  return process


def _end(process: subprocess.Popen) -> None:
  """Kills ``process``'s group (what the step left running, or all of it)."""
  _CHILDREN.discard(process)
  try:
    os.killpg(process.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _end_all(number=None, frame=None) -> None:
  """Every step's group killed; as a signal's handler, the check then exits 128 + it."""
  del frame
  for process in list(_CHILDREN):
    _end(process)
  if number is not None:
    sys.stderr.write(f"\npython -m bench.gpu_check: {signal.Signals(number).name}: the steps' "
                     "processes were killed\n")
    os._exit(128 + number)


def _ends_its_steps() -> None:
  """SIGINT, SIGTERM and SIGHUP kill every step's group, then end the check."""
  for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(number, _end_all)


def _run(log: Log, name: str, argv, limit: float, **env) -> tuple[int, str, float]:
  """Runs ``argv`` for at most ``limit`` seconds (or what is left of the budget), its output into the log line by line as it
  comes (a step cut off by the step's limit, or the whole call by the device's, keeps what it
  printed); at the limit its whole process group (pytest's workers too) is killed."""
  log.write(f"\n==== {name}: {' '.join(argv)}\n")
  limit = _within(limit)
  start = time.perf_counter()
  process = _spawn(argv, **env)
  lines = []

  def pump():
    for line in process.stdout:
      lines.append(line)
      log.write(line)

  reader = threading.Thread(target=pump, daemon=True)
  reader.start()
  try:
    code = process.wait(timeout=limit)
  except subprocess.TimeoutExpired:
    code = 124
  _end(process)  # at its limit all of it; else what it left behind
  process.wait()
  reader.join(timeout=10)
  if code == 124:
    lines.append(f"\n[timed out after {limit:.0f} s]\n")
    log.write(lines[-1])
  seconds = time.perf_counter() - start
  log.write(f"==== {name}: exit {code} in {seconds:.1f} s\n")
  return code, "".join(lines), seconds


def _last(pattern: str, text: str, default: str = "") -> str:
  found = re.findall(pattern, text)
  return found[-1] if found else default


def versions(log: Log) -> Outcome:
  code, out, seconds = _run(log, "versions", [sys.executable, "-c", (
      "import jax, jaxlib; d = jax.devices()[0]; "
      "print(f'jax {jax.__version__} jaxlib {jaxlib.__version__} {d.platform} {d.device_kind} "
      "x{jax.device_count()}')")], 60)
  line = out.strip().splitlines()[-1] if out.strip() else ""
  return Outcome("versions", code == 0 and " gpu " in line, seconds, line)


def tests(log: Log, limit: float) -> Outcome:
  # A worker per core, up to 16: compiling the kernels (Triton, Mosaic GPU) is the CPU's work
  # and most of the time; the GPU is shared, each process allocating as it goes (one process
  # ran half the cases in 270 s on an H100; eight ran 85% in 250 s). -v: each case's name and
  # verdict in the log as it ends, so a step cut off by its limit still names its failures;
  # -rs: every skip's reason in the summary, which the committed log keeps.
  workers = str(max(1, min(16, os.cpu_count() or 1)))
  code, out, seconds = _run(
      log, "tests", [sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider",
                     "-n", workers, "--dist", "worksteal", "-p", "no:benchmark", *NO_DEPRECATED_API,
                     "--durations=15", *[f"tests/{f}" for f in TEST_FILES]], limit,
      JAXKERNELS_TEST_COMPILED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false",
      XLA_FLAGS=NO_AUTOTUNING)
  summary = _last(r"\n=* ?(\d+ (?:passed|failed).*?) =*\n", out, "no summary")
  return Outcome("tests", code == 0, seconds, summary.strip("= "))


def _metrics(path: pathlib.Path) -> dict[int, float]:
  if not path.exists():
    return {}
  rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  return {row["step"]: row["loss"] for row in rows}


def _signalled(argv, number: int, limit: float, ready) -> tuple[int, str]:
  """Starts ``argv``, sends it signal ``number`` once ``ready()`` holds (or it ended, or
  ``limit`` seconds passed), and returns (its exit code, its output)."""
  process = _spawn(argv)
  deadline = time.monotonic() + _within(limit)
  while not ready() and process.poll() is None and time.monotonic() < deadline:
    time.sleep(0.1)
  process.send_signal(number)
  try:
    out = process.communicate(timeout=120)[0]
  finally:
    _end(process)
  return process.returncode, out


def readme_commands(log: Log, workdir: pathlib.Path) -> Outcome:
  """Every command the README shows, at its own sizes: a train command for a few steps, and
  where it checkpoints, again (it must find the run whole); the bench as ``make bench`` runs
  it. Each must exit 0; a train command must end on its final loss, the bench with none of
  its rows over its tolerance."""
  from bench import readme
  start, said, ok = time.perf_counter(), [], True
  for command in readme.commands():
    if not command.argv:  # make test (the tests step runs them compiled), make setup
      continue
    argv = readme.on_gpu(command, workdir / f"line{command.line}")
    code, out, _ = _run(log, f"readme line {command.line}", [sys.executable, *argv[1:]],
                        420 if command.kind == "bench" else 300)
    if command.kind == "train":
      loss, rate = _last(r"final loss ([\d.]+)", out), _last(r"([\d,]+) tokens/s\)", out)
      good = code == 0 and loss != ""
      if good and "--checkpoint-dir" in argv:
        code, again, _ = _run(log, f"readme line {command.line} again",
                              [sys.executable, *argv[1:]], 120)
        good = code == 0 and "nothing to do" in again
      said.append(f"{' '.join(command.argv[3:5])}: " + (f"loss {loss}, {rate} tokens/s"
                                                         if good else "FAILED"))
    else:  # its results beside the log, to be committed with it
      for result in (workdir / f"line{command.line}").rglob("*.json"):
        shutil.copy(result, log.path.parent / result.name)
      counts = re.search(r"^(\d+) rows, (\d+) over their tolerance", out, re.M)
      good = code == 0 and counts is not None and counts.group(2) == "0"
      said.append(f"bench: {counts.group(0) if counts else 'no summary'}")
    ok = ok and good
  return Outcome("readme", ok, time.perf_counter() - start, "; ".join(said))


def train_125m(log: Log, workdir: pathlib.Path) -> Outcome:
  """Killed after its step-20 checkpoint, resumed: the same losses at steps 21..25."""
  checkpoints, metrics = workdir / "ckpt-125m", workdir / "125m.jsonl"
  argv = [sys.executable, "-m", "models.train", "--preset", "125m", "--steps", "60", "--batch",
          "8", "--seq-len", "1024", "--checkpoint-every", "20", "--log-every", "5",
          "--checkpoint-dir", str(checkpoints), "--metrics", str(metrics),
          "--compilation-cache", str(workdir / "xla")]
  log.write(f"\n==== train-125m: {' '.join(argv[1:])} (SIGKILL mid-run, after step 20's checkpoint)\n")
  start = time.perf_counter()
  # Killed once step 20's checkpoint is whole (orbax writes it in the background and renames
  # its directory when done: killed before, the run starts over) and step 25 has run. On the
  # H100 the directory appeared as step 40's save began: 60 steps, so the kill lands mid-run.
  _, first_out = _signalled(argv, signal.SIGKILL, 240, lambda: (
      (checkpoints / "20").is_dir() and max(_metrics(metrics), default=0) >= 25))
  log.write(first_out)
  before = _metrics(metrics)
  code, out, _ = _run(log, "train-125m resumed", argv, 240)
  seconds = time.perf_counter() - start
  after = _metrics(metrics)  # the resumed run's rows came last: they win in the dict
  resumed_at = _last(r"resumed at step (\d+)", out)
  killed_at = max(before, default=0)
  # Resumed at the last whole checkpoint before the kill (20, or 40 where its save finished):
  # the five steps after it, run before the kill and again after it.
  resumed = int(resumed_at) if resumed_at else 0
  compared = [s for s in range(resumed + 1, resumed + 6) if s in before]
  # Same batches, same state: the same numbers up to the order of the GPU's atomic sums (the
  # embedding's gradient is a scatter-add): two runs from step 0 differed by 0.2% at step 20.
  same = compared and all(abs(after[s] - before[s]) <= 2e-3 * abs(before[s]) for s in compared)
  ok = (code == 0 and 20 <= resumed <= killed_at < 60 and resumed % 20 == 0 and bool(same)
        and max(after, default=0) == 60)
  loss = _last(r"final loss ([\d.]+)", out)
  rate = _last(r"([\d,]+) tokens/s", out)
  return Outcome("train-125m", ok, seconds,
                 f"killed at step {killed_at}, resumed at {resumed_at or '?'}, "
                 f"steps {compared[0] if compared else '?'}-{compared[-1] if compared else '?'} "
                 f"{'match' if same else 'DIFFER'}; final loss {loss or '?'}, {rate} tokens/s")


def interrupt(log: Log, workdir: pathlib.Path) -> Outcome:
  checkpoints, metrics = workdir / "ckpt-tiny", workdir / "tiny.jsonl"
  argv = [sys.executable, "-m", "models.train", "--preset", "tiny", "--steps", "200",
          "--log-every", "5", "--checkpoint-dir", str(checkpoints), "--metrics", str(metrics),
          "--compilation-cache", str(workdir / "xla")]
  log.write(f"\n==== interrupt: {' '.join(argv[1:])} (SIGINT after step 10)\n")
  start = time.perf_counter()
  returncode, out = _signalled(argv, signal.SIGINT, 180,
                               lambda: max(_metrics(metrics), default=0) >= 10)
  log.write(out + f"==== interrupt: exit {returncode}\n")
  stopped = _last(r"stopped at step (\d+) by SIGINT; saved", out)
  code, again, _ = _run(log, "interrupt resumed", argv, 180)
  ok = (returncode == 130 and stopped != "" and "Traceback" not in out and code == 0
        and f"resumed at step {stopped}" in again)
  return Outcome("interrupt", ok, time.perf_counter() - start,
                 f"SIGINT: exit {returncode}, saved at step {stopped or '?'}; resumed "
                 f"{'there' if ok else '?'}")


STEPS = ("versions", "tests", "readme", "train-125m", "interrupt")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=None, help="directory for the log (default: "
                      "<the system's temporary directory>/jaxkernels-gpu-check/<device>; "
                      "results/<device> to commit it)")
  parser.add_argument("--only", default=None, help=f"steps, comma-separated: {', '.join(STEPS)}")
  parser.add_argument("--tests-limit", type=float, default=400,
                      help="seconds for the compiled tests")
  parser.add_argument("--budget", type=float, default=540,
                      help="seconds for the whole check: a step still running at its end is "
                      "cut off and fails")
  args = parser.parse_args(argv)
  global DEADLINE
  DEADLINE = time.monotonic() + args.budget
  only = args.only.split(",") if args.only else list(STEPS)
  unknown = sorted(set(only) - set(STEPS))
  if unknown:
    parser.error(f"--only: unknown steps {unknown}; steps: {', '.join(STEPS)}")

  if not _on_a_gpu():
    print("python -m bench.gpu_check: no GPU here (jax finds no CUDA device): the check "
          "compiles and runs the kernels on a GPU; on this machine `make test` checks them",
          file=sys.stderr)
    return 2
  import jax  # here, not at import: the steps run in processes of their own

  from bench import harness
  if "tests" in only and importlib.util.find_spec("pytest") is None:
    print("python -m bench.gpu_check: the tests step needs pytest (pip install -e "
          "\".[test]\"), or leave it out with --only", file=sys.stderr)
    return 2
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%M%S")
  out_dir = pathlib.Path(args.out) if args.out else (
      pathlib.Path(tempfile.gettempdir()) / "jaxkernels-gpu-check"
      / harness.device_slug(jax.devices()[0]))
  _ends_its_steps()
  try:
    return _check(args, only, out_dir, stamp)
  finally:
    _end_all()


def _on_a_gpu() -> bool:
  """Whether jax finds a CUDA device, asked of that backend alone (on a machine with libtpu,
  asking every backend printed TPU's start-up errors before the answer)."""
  before = os.environ.get("JAX_PLATFORMS")
  os.environ["JAX_PLATFORMS"] = "cuda"
  try:
    import jax
    return bool(jax.devices())
  except Exception:  # noqa: BLE001 - no CUDA backend: jax 0.10 raises AssertionError there
    return False
  finally:  # the steps' processes pick their own
    if before is None:
      os.environ.pop("JAX_PLATFORMS")
    else:
      os.environ["JAX_PLATFORMS"] = before


def _check(args, only, out_dir: pathlib.Path, stamp: str) -> int:
  import jax

  from bench import harness
  log = Log(out_dir / f"{stamp}_gpu_check_jax{jax.__version__}.log")
  log.write(f"python -m bench.gpu_check at {harness.git_commit()}, {stamp} UTC\n")
  outcomes = []
  with tempfile.TemporaryDirectory(prefix="jaxkernels-gpu-check-") as tmp:
    workdir = pathlib.Path(tmp)
    runs = {"versions": lambda: versions(log), "tests": lambda: tests(log, args.tests_limit),
            "readme": lambda: readme_commands(log, workdir),
            "train-125m": lambda: train_125m(log, workdir),
            "interrupt": lambda: interrupt(log, workdir)}
    for name in STEPS:
      if name in only:
        outcomes.append(runs[name]())
  lines = ["", "| step | ok | seconds | what |", "| --- | --- | ---: | --- |"]
  lines += [f"| {o.name} | {'yes' if o.ok else 'NO'} | {o.seconds:.0f} | {o.summary} |"
            for o in outcomes]
  verdict = "GPU check: all green" if all(o.ok for o in outcomes) else "GPU check: FAILED"
  log.write("\n".join(lines) + f"\n\n{verdict}\nlog: {log.path}\n")
  return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
  sys.exit(main())
