"""Plots a matmul size sweep: TFLOP/s against M = N = K for ours, XLA and cuBLAS.

    python -m bench.plot_sweep OUT.png LOG[:first:last:step] | JSON[:host_clock_from] ...

Reads the ``matmul sweep bf16 <impl>: <ms> ms`` lines that ``python -m bench matmul --sweep``
prints, in the order it runs the sizes (each of first..last by step, then its odd neighbour),
or the rows of a results JSON.
"""

from __future__ import annotations

import json
import re
import sys

LINE = re.compile(r"  matmul sweep bf16 (\S+?)(?:\(torch\))?: ([\d.]+) ms")


def from_log(path: str, first: int, last: int, step: int) -> dict[str, list[tuple[int, float]]]:
  sizes = [s for base in range(first, last + 1, step) for s in (base, base + 1)]
  times = [(m.group(1), float(m.group(2))) for m in map(LINE.match, open(path)) if m]
  impls = list(dict.fromkeys(impl for impl, _ in times))
  series: dict[str, list[tuple[int, float]]] = {impl: [] for impl in impls}
  for i, (impl, ms) in enumerate(times):
    size = sizes[i // len(impls)]
    series[impl].append((size, 2 * size ** 3 / (ms * 1e-3) / 1e12))
  return series


def from_json(path: str, host_clock_from: int = 0) -> dict[str, list[tuple[int, float]]]:
  """Rows below ``host_clock_from`` plot their kernels' device time (``kernel_ms``), and rows
  without one are left out there (bench/matmul.py, SWEEP_HOST_CLOCK_FROM)."""
  series: dict[str, list[tuple[int, float]]] = {}
  for row in json.load(open(path))["rows"]:
    if row["name"] != "sweep bf16":
      continue
    size = int(row["shape"].split("x")[0])
    ms = row.get("kernel_ms") if size < host_clock_from else row["ms"]
    if ms:
      series.setdefault(row["impl"], []).append((size, 2 * size ** 3 / (ms * 1e-3) / 1e12))
  return series


def plot(series, out: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
  for ax, odd in zip(axes, (False, True)):
    for impl, points in sorted(series.items()):
      points = sorted(p for p in points if (p[0] % 2 == 1) == odd)
      ax.plot([p[0] for p in points], [p[1] for p in points], ".-", lw=0.8, ms=3, label=impl)
    ax.set_ylabel("TFLOP/s")
    ax.set_title("odd sizes (128k + 1)" if odd else "aligned sizes (multiples of 128)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  axes[1].set_xlabel("M = N = K, bf16 (NVIDIA H200, jax 0.11.2)")
  fig.tight_layout()
  fig.savefig(out, dpi=110)


def main(argv: list[str]) -> None:
  out, sources = argv[0], argv[1:]
  series: dict[str, list[tuple[int, float]]] = {}
  for source in sources:
    path, *rng = source.split(":")
    if path.endswith(".json"):
      part = from_json(path, *map(int, rng))
    else:
      part = from_log(path, *map(int, rng))
    for impl, points in part.items():
      series.setdefault(impl, []).extend(points)
  plot(series, out)


if __name__ == "__main__":
  main(sys.argv[1:])
