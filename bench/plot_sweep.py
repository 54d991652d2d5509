"""Plots a matmul size sweep: TFLOP/s against M = N = K for ours, XLA and cuBLAS.

    python -m bench.plot_sweep OUT.png LOG:first:last:step[:host_clock_from] ...
    python -m bench.plot_sweep OUT.png JSON[:host_clock_from] ...

Reads the ``matmul sweep bf16 <impl>: <ms> ms`` lines that ``python -m bench matmul --sweep``
prints, in the order it runs the sizes (each of first..last by step, then its odd neighbour),
or the rows of a results JSON. Where sources share a size (a run cut short and its
completion), the later one wins.
"""

from __future__ import annotations

import json
import re
import sys

LINE = re.compile(r"  matmul sweep bf16 (\S+?)(?:\(torch\))?: ([\d.]+) ms")
KERNELS = re.compile(r"  matmul sweep bf16 (\S+) kernels: ([\d.]+) ms")


def _tflops(size: int, ms: float) -> float:
  return 2 * size ** 3 / (ms * 1e-3) / 1e12


def from_log(path: str, first: int, last: int, step: int,
             host_clock_from: int = 0) -> dict[str, list[tuple[int, float]]]:
  """Each size's block of lines opens with XLA's; below ``host_clock_from`` the kernels'
  device time (the ``kernels:`` lines) is plotted, and implementations without one are left
  out there (bench/matmul.py, SWEEP_HOST_CLOCK_FROM). A log cut short yields what it holds."""
  sizes = [s for base in range(first, last + 1, step) for s in (base, base + 1)]
  host: list[dict[str, float]] = []
  device: list[dict[str, float]] = []
  for line in open(path):
    if m := LINE.match(line):
      if m.group(1) == "xla":
        host.append({})
        device.append({})
      host[-1][m.group(1)] = float(m.group(2))
    elif m := KERNELS.match(line):
      device[-1][m.group(1)] = float(m.group(2))
  series: dict[str, list[tuple[int, float]]] = {}
  for size, on_host, on_device in zip(sizes, host, device):
    for impl, ms in (on_device if size < host_clock_from else on_host).items():
      series.setdefault(impl, []).append((size, _tflops(size, ms)))
  return series


def from_json(path: str, host_clock_from: int = 0) -> dict[str, list[tuple[int, float]]]:
  """The rows of a results JSON, chosen as :func:`from_log` chooses."""
  series: dict[str, list[tuple[int, float]]] = {}
  for row in json.load(open(path))["rows"]:
    if row["name"] != "sweep bf16":
      continue
    size = int(row["shape"].split("x")[0])
    ms = row.get("kernel_ms") if size < host_clock_from else row["ms"]
    if ms:
      impl = row["impl"].removesuffix("(torch)")
      series.setdefault(impl, []).append((size, _tflops(size, ms)))
  return series


def plot(series, out: str, *, model: dict[int, float] | None = None,
         xlabel: str = "M = N = K, bf16 (NVIDIA H200, jax 0.11.2)", dpi: int = 110) -> None:
  """Aligned and odd sizes in two panels; ``model``: a predicted TFLOP/s by size, drawn over
  them (the report's wave model, bench/plots.py)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
  for ax, odd in zip(axes, (False, True)):
    for impl, points in sorted(series.items()):
      points = sorted(p for p in points if (p[0] % 2 == 1) == odd)
      ax.plot([p[0] for p in points], [p[1] for p in points], ".-", lw=0.8, ms=3, label=impl)
    if model:
      xs = [s for s in sorted(model) if (s % 2 == 1) == odd]
      ax.plot(xs, [model[s] for s in xs], "-", color="black", lw=0.8, alpha=0.6,
              label="wave model, ours (heuristic tiles)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title("odd sizes (128k + 1)" if odd else "aligned sizes (multiples of 128)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  axes[1].set_xlabel(xlabel)
  fig.tight_layout()
  fig.savefig(out, dpi=dpi)
  plt.close(fig)


def main(argv: list[str]) -> None:
  out, sources = argv[0], argv[1:]
  series: dict[str, dict[int, float]] = {}
  for source in sources:
    path, *rng = source.split(":")
    read = from_json if path.endswith(".json") else from_log
    for impl, points in read(path, *map(int, rng)).items():
      series.setdefault(impl, {}).update(points)
  plot({impl: sorted(points.items()) for impl, points in series.items()}, out)


if __name__ == "__main__":
  main(sys.argv[1:])
