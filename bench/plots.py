"""The report's plots, from the committed results (``python -m bench report`` calls these).

* ``roofline``: per GPU, every shape's kernel (ours) and best anchor as attained FLOP/s against
  arithmetic intensity (FLOPs per byte moved), under the memory roof (the copy measured on that
  device) and the compute roof (the fastest bf16 matmul measured there), the datasheet peaks
  dashed. A point's FLOPs and bytes: the row's own rate times its time where the suite records
  it (GB/s for the memory-bound ops, TFLOP/s for the products); the other from the shape, by
  roofline.py's counts (a product's operands and output read and written once; a memory-bound
  op's arithmetic per element). A memory-bound op's height under the roof is its fraction of
  the copy whatever its FLOP count.
* ``waves``: the matmul size sweep on the H200 (ours, XLA, cuBLAS) with the wave model's
  prediction for our kernel's heuristic tiles (jaxkernels/ops/matmul/mosaic_gpu/config.py).
"""

from __future__ import annotations

import math
import pathlib
import re

from jaxkernels import hardware, roofline

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
            "int8": 1}


def _elements(shape: str) -> int:
  return math.prod(int(d) for d in re.findall(r"\d+", shape))


def _flops_per_element(name: str) -> float | None:
  """A memory-bound op's arithmetic per element of its main input (roofline.py's counts)."""
  backward = 2.5 if "fwd+bwd" in name else 1.0
  if name.startswith(("rms_norm", "layer_norm")):
    return backward * ((8 if name.startswith("layer") else 5) + ("residual" in name))
  if name.startswith("softmax"):
    return backward * 4
  if name.startswith("cross_entropy"):
    return backward * 5
  for activation, flops in roofline.ACTIVATION_FLOPS.items():
    if activation in name and name.startswith(("bias+", "glu")):
      return backward * (flops + 1)
  return None


def flops_and_bytes(row) -> tuple[float, float] | None:
  """(FLOPs, bytes) of one timed row, or None where neither the row nor its shape says."""
  seconds = row["ms"] * 1e-3
  name, shape, dtype = row["name"], row.get("shape") or "", row.get("dtype") or ""
  item = ITEMSIZE.get(dtype, 2)
  if row.get("gbps") and row.get("tflops"):
    return row["tflops"] * 1e12 * seconds, row["gbps"] * 1e9 * seconds
  if row.get("gbps"):
    per_element = _flops_per_element(name)
    if per_element is None or not shape:
      return None
    return per_element * _elements(shape), row["gbps"] * 1e9 * seconds
  if row.get("tflops") and row["suite"] == "matmul":
    dims = [int(d) for d in re.findall(r"\d+", shape)]
    if len(dims) < 3:
      return None
    m, n, k = math.prod(dims[:-2]), dims[-2], dims[-1]
    passes = 3 if "fwd+bwd" in name else 1
    return row["tflops"] * 1e12 * seconds, passes * item * (m * k + k * n + m * n)
  if row.get("tflops") and row["suite"] == "attention":
    match = re.match(r"(\d+)x(\d+)x(\d+)/(\d+)x(\d+)", shape)
    if not match:
      return None
    b, t, heads, kv_heads, h = map(int, match.groups())
    moved = item * b * t * h * (2 * heads + 2 * kv_heads)  # q, o; k, v
    return row["tflops"] * 1e12 * seconds, moved * (2.5 if "bwd" in name else 1.0)
  return None


def _points(lines):
  ours, anchors = [], []
  for line in lines:
    for row, into in ((line.ours, ours), (line.anchor, anchors)):
      counted = flops_and_bytes(row)
      if counted and counted[1] > 0:
        flops, moved = counted
        into.append((flops / moved, flops / (row["ms"] * 1e-3), line.suite))
  return ours, anchors


def _roofs(runs, device):
  """(copy bytes/s, fastest bf16 product FLOP/s) measured on ``device``, or None each."""
  copy = product = None
  for run in runs:
    if run.device != device:
      continue
    for row in run.rows:
      if not row.get("ms"):
        continue
      if row["suite"] == "anchor" and row["name"] == "copy" and row.get("gbps"):
        copy = max(copy or 0.0, row["gbps"] * 1e9)
      if (row["suite"] == "matmul" and row.get("dtype") == "bfloat16" and row.get("tflops")
          and row["name"] in ("bf16", "scaled bf16")):
        product = max(product or 0.0, row["tflops"] * 1e12)
  return copy, product


def roofline_plot(runs, device: str, lines, out: pathlib.Path) -> bool:
  """The roofline of ``device``'s lines into ``out``; False where nothing could be placed."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ours, anchors = _points(lines)
  if not ours:
    return False
  copy, product = _roofs(runs, device)
  chip = hardware.chip_for(device)
  fig, ax = plt.subplots(figsize=(8, 5.5))
  x = [10 ** (e / 10) for e in range(-10, 41)]
  for bandwidth, flops, style, label in (
      (copy, product, "-", "measured: copy, fastest bf16 matmul"),
      (chip.hbm_bandwidth if chip else None, chip.flops("bfloat16") if chip else None, "--",
       "datasheet: HBM, dense bf16")):
    if bandwidth and flops:
      ax.plot(x, [min(flops, bandwidth * i) / 1e12 for i in x], style, color="gray", lw=1.2,
              label=label)
  colors = {"norms": "C0", "elementwise": "C0", "softmax": "C0", "cross_entropy": "C1",
            "matmul": "C2", "attention": "C3"}
  for points, marker, who in ((ours, "o", "ours"), (anchors, "x", "best anchor")):
    for suite in sorted({p[2] for p in points}):
      chosen = [p for p in points if p[2] == suite]
      ax.scatter([p[0] for p in chosen], [p[1] / 1e12 for p in chosen], marker=marker, s=22,
                 color=colors.get(suite, "C4"), label=f"{suite}, {who}")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("arithmetic intensity (FLOPs per byte moved)")
  ax.set_ylabel("attained TFLOP/s")
  ax.set_title(f"{device}: each op and pass, ours and the best anchor (same run)", fontsize=10)
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=7, loc="lower right")
  fig.tight_layout()
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return True


def waves_plot(results: pathlib.Path, out: pathlib.Path) -> bool:
  """The H200's matmul sweep (the "final" runs, read and drawn as ``plot_sweep`` does) and
  the wave model's prediction for our kernel; False where the sweep's files are not there."""
  import jax.numpy as jnp

  from bench import plot_sweep
  from bench.matmul import SWEEP_HOST_CLOCK_FROM
  from jaxkernels.ops.matmul import mosaic_gpu
  from jaxkernels.ops.matmul.common import Problem

  series: dict[str, dict[int, float]] = {}
  for path in sorted((results / "nvidia_h200").glob("*_matmul-sweep-final-*.json")):
    for impl, points in plot_sweep.from_json(str(path), SWEEP_HOST_CLOCK_FROM).items():
      series.setdefault(impl, {}).update(points)
  if "mosaic_gpu" not in series:
    return False
  chip = hardware.chip_for("NVIDIA H200")
  bf16 = jnp.dtype(jnp.bfloat16)
  model = {}
  for size in sorted(series["mosaic_gpu"]):
    problem = Problem(m=size, n=size, k=size, dtype=bf16, out_dtype=bf16)
    config = mosaic_gpu.heuristic(problem, chip)
    model[size] = 2 * size ** 3 / mosaic_gpu.predicted_seconds(problem, config, chip.cores) / 1e12
  plot_sweep.plot({impl: sorted(points.items()) for impl, points in series.items()}, str(out),
                  model=model, dpi=100,
                  xlabel="M = N = K, bf16 (NVIDIA H200; the model's constants were fitted to it)")
  return True
