"""python -m bench.gpu_check where a newcomer may first run it: without a GPU it refuses in
one line and writes nothing; however it ends, no step's process outlives it."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from bench import gpu_check

ROOT = pathlib.Path(__file__).parent.parent


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A zombie (killed, not yet reaped by its parent) counts as gone.
  stat = pathlib.Path(f"/proc/{pid}/stat")
  return not (stat.exists() and stat.read_text().split(") ")[1].startswith("Z"))


def _gone(pid: int, within: float = 10.0) -> bool:
  deadline = time.monotonic() + within
  while _alive(pid) and time.monotonic() < deadline:
    time.sleep(0.05)
  return not _alive(pid)


@pytest.mark.cpu_only
def test_without_a_gpu_it_refuses_in_one_line_and_writes_nothing(tmp_path):
  results = ROOT / "results"
  stamp = max((p.stat().st_mtime for p in results.rglob("*")), default=0)
  done = subprocess.run([sys.executable, "-m", "bench.gpu_check"], cwd=tmp_path,
                        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 2, done.stderr
  assert done.stderr.count("\n") == 1 and done.stderr.startswith(
      "python -m bench.gpu_check: no GPU here"), done.stderr
  assert "make test" in done.stderr and not done.stdout
  assert max((p.stat().st_mtime for p in results.rglob("*")), default=0) == stamp
  assert not list(tmp_path.iterdir())


class _Log:
  def __init__(self):
    self.text = ""

  def write(self, text):
    self.text += text


def _leaves_a_child(seconds: float) -> list[str]:
  """A step that starts a grandchild (as pytest starts its workers, or a train run), prints
  its pid and runs ``seconds`` before it exits (leaving the grandchild running)."""
  return [sys.executable, "-c", textwrap.dedent(f"""
      import subprocess, sys, time
      child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
      print(child.pid, flush=True)
      time.sleep({seconds})
      """)]


@pytest.mark.parametrize("seconds, limit, code", [(0.2, 60, 0), (60, 2, 124)],
                         ids=["ends", "at its limit"])
def test_a_steps_whole_group_ends_with_it(seconds, limit, code):
  log = _Log()
  got, out, _ = gpu_check._run(log, "step", _leaves_a_child(seconds), limit)
  assert got == code, log.text
  assert _gone(int(out.split()[0])), "the step's child outlived it"
  assert not gpu_check._CHILDREN


def test_a_signal_to_the_check_ends_every_step(tmp_path):
  """SIGTERM (a timeout's) to the check while a step runs: the step's group is killed with
  it (a 125m train run once grew to 18.7 GB after the check was gone)."""
  script = textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {str(ROOT)!r})
      from bench import gpu_check
      class Log:
        def write(self, text):
          sys.stdout.write(text); sys.stdout.flush()
      gpu_check._ends_its_steps()
      gpu_check._run(Log(), "step", {_leaves_a_child(300)!r}, 300)
      """)
  check = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
  line = ""
  while not line.strip().isdigit():
    line = check.stdout.readline()
    assert line or check.poll() is None, check.stderr.read()
  grandchild = int(line)
  check.send_signal(signal.SIGTERM)
  assert check.wait(timeout=30) == 128 + signal.SIGTERM
  assert "SIGTERM: the steps' processes were killed" in check.stderr.read()
  assert _gone(grandchild)
