"""Helpers for the tests that run ``python -m models.train``: in a process of its own (the
tiny preset, short), or in this one through ``train.main``."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

from models import train

ROOT = pathlib.Path(__file__).parent.parent
# Tiny, short and small: 8 sequences (one a device on the test run's 8 host devices).
ARGS = ["--preset", "tiny", "--steps", "24", "--warmup", "3", "--batch", "8", "--seq-len", "32",
        "--checkpoint-every", "6", "--log-every", "6"]


def launch(tmp_path, name, *extra, args=ARGS):
  """``python -m models.train`` with ``args`` and ``extra``, its metrics into
  ``tmp_path/name.jsonl``, stdout and stderr on one pipe: (process, the metrics' path)."""
  metrics = tmp_path / f"{name}.jsonl"
  process = subprocess.Popen(
      [sys.executable, "-m", "models.train", *args, "--metrics", str(metrics), *extra],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "PYTHONUNBUFFERED": "1"})
  return process, metrics


def wait_for_steps(process, metrics, steps: int, timeout: float = 300) -> None:
  """Returns once ``metrics`` holds ``steps`` steps' lines; fails, with the run's output, where
  the run ends first or ``timeout`` seconds pass."""
  deadline = time.monotonic() + timeout
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
    assert process.poll() is None, process.stdout.read()
    assert time.monotonic() < deadline
    time.sleep(0.05)


def curve(metrics) -> dict[int, float]:
  """step -> loss; a step run twice (after a resume) must give the same loss both times."""
  out = {}
  for line in metrics.read_text().splitlines():
    row = json.loads(line)
    assert out.setdefault(row["step"], row["loss"]) == row["loss"], row
  return out


def main_err(capsys, *argv) -> tuple[int, str]:
  """``train.main(argv)`` in this process: (its exit status, what it wrote on stderr)."""
  code = train.main(list(argv))
  return code, capsys.readouterr().err
