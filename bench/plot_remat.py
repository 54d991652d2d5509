"""Plots the remat table: each policy's step time against its peak memory (GPU, measured), and
each policy's compiled peak on the TPU generations (compiled, not measured).

    python -m bench.plot_remat OUT.png GPU_JSON [GPU_JSON ...] [--tpu TPU_JSON]

Reads ``python -m bench model --remat`` rows (``... train step``, impl ``jaxkernels, remat
<policy>``, a note with ``peak <x> GiB``) and ``python -m bench model --tpu`` rows (``compiled
peak <x> GiB``, or ``does not fit`` with the compiler's own need).
"""

from __future__ import annotations

import json
import re
import sys

PEAK = re.compile(r"peak ([\d.]+) GiB")
NEED = re.compile(r"required for HLO temporaries \(([\d.]+)G\)")


def _rows(paths):
  for path in paths:
    yield from json.load(open(path))["rows"]


def gpu_points(paths, preset: str) -> dict[str, tuple[float, float]]:
  """policy -> (peak GiB, ms) of ``preset``'s kernels rows; a later file's row wins."""
  points = {}
  for row in _rows(paths):
    if row["name"] != f"{preset} train step" or not row["impl"].startswith("jaxkernels, remat"):
      continue
    peak = PEAK.search(row.get("note") or "")
    if row.get("ms") and peak and ", scan" not in row["impl"]:
      points[row["impl"].split("remat ")[1]] = (float(peak.group(1)), row["ms"])
  return points


def tpu_bars(paths) -> dict[str, dict[str, tuple[float, bool]]]:
  """chip -> policy -> (GiB, fits) from the compiled rows."""
  bars: dict[str, dict[str, tuple[float, bool]]] = {}
  for row in _rows(paths):
    match = re.search(r"compiled for (\w+)", row["name"])
    if not match:
      continue
    note = row.get("note") or ""
    policy = row["impl"].split("remat ")[1]
    if (peak := PEAK.search(note)):
      bars.setdefault(match.group(1), {})[policy] = (float(peak.group(1)), True)
    elif (need := NEED.search(note)):
      bars.setdefault(match.group(1), {})[policy] = (float(need.group(1)), False)
  return bars


def main(argv=None) -> int:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  argv = list(sys.argv[1:] if argv is None else argv)
  out, tpu = argv.pop(0), []
  if "--tpu" in argv:
    at = argv.index("--tpu")
    tpu, argv = argv[at + 1:], argv[:at]
  preset = "1b"
  points = gpu_points(argv, preset)
  bars = tpu_bars(tpu) if tpu else {}
  fig, axes = plt.subplots(1, 2 if bars else 1, figsize=(13 if bars else 7, 5), squeeze=False)
  ax = axes[0][0]
  for policy, (gib, ms) in sorted(points.items()):
    ax.scatter(gib, ms, s=40)
    ax.annotate(policy, (gib, ms), textcoords="offset points", xytext=(5, 4))
  ax.set_xlabel("peak memory, GiB (measured)")
  ax.set_ylabel("train step, ms")
  ax.set_title(f"{preset}, batch 4 x 2048, H100: remat policies")
  ax.grid(alpha=0.3)
  if bars:
    ax = axes[0][1]
    policies = sorted({p for chip in bars.values() for p in chip})
    width = 0.8 / len(bars)
    for i, (chip, by_policy) in enumerate(sorted(bars.items())):
      xs = [j + i * width for j in range(len(policies))]
      heights = [by_policy.get(p, (0.0, True))[0] for p in policies]
      hatches = ["" if by_policy.get(p, (0, True))[1] else "//" for p in policies]
      for x, h, hatch in zip(xs, heights, hatches):
        ax.bar(x, h, width, color=f"C{i}", hatch=hatch, label=chip if x == xs[0] else None)
    ax.set_xticks([j + width for j in range(len(policies))], policies, rotation=30)
    ax.set_ylabel("GiB (compiled, not measured; hatched: does not fit)")
    ax.set_title("350m, batch 8 x 2048: the train step compiled for TPUs")
    ax.legend()
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
