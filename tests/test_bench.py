"""The benchmark runs end to end on a CPU (interpret mode) and records what it checked."""

from __future__ import annotations

import json

from bench import __main__ as bench_main


def test_bench_smoke_softmax(tmp_path, capsys):
  assert bench_main.main(["softmax", "--out", str(tmp_path)]) == 0
  printed = capsys.readouterr().out
  assert "INTERPRET mode" in printed  # CPU numbers are labelled as correctness, not speed
  [path] = tmp_path.glob("*.json")
  record = json.loads(path.read_text())
  assert record["interpret_mode"] and record["commit"] and record["command"].startswith(
      "python -m bench")
  kernel_rows = [r for r in record["rows"] if r["suite"] == "softmax" and r["impl"] == "triton"]
  assert len(kernel_rows) == 6  # 2 shapes x (fwd, bwd, fwd+bwd)
  for row in kernel_rows:
    assert row["note"] == "" and row["error"] <= row["tolerance"] and row["ms"] > 0
