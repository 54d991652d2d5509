"""Loss parity: the kernels' training curve against plain JAX's (``--kernels xla``), same seed and
batches, from ``bench/parity.sh``'s JSON lines.

    python -m bench.plot_parity DIR [PRESET ...]

Writes DIR/parity.json (each preset's two curves, and their gap: the mean loss of the last
tenth of the steps, which a single step's batch of 2048 tokens makes noisy) and DIR/parity.png.
"""

from __future__ import annotations

import json
import pathlib
import sys


def curve(path: pathlib.Path) -> list[float]:
  rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  return [row["loss"] for row in sorted(rows, key=lambda r: r["step"])]


def gap(ours: list[float], xla: list[float]) -> dict:
  tail = max(1, len(ours) // 10)
  mean = lambda xs: sum(xs[-tail:]) / tail
  return {"final": [ours[-1], xla[-1]], "final_gap": ours[-1] / xla[-1] - 1,
          f"mean_last_{tail}": [mean(ours), mean(xla)], "mean_gap": mean(ours) / mean(xla) - 1,
          "stepwise_mean_gap": sum(o / x - 1 for o, x in zip(ours, xla)) / len(ours)}


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  directory = pathlib.Path(argv[0])
  presets = argv[1:] or sorted({p.name.split("_")[0] for p in directory.glob("*_xla.jsonl")})
  record = {}
  for preset in presets:
    ours, xla = (curve(directory / f"{preset}_{k}.jsonl") for k in ("jaxkernels", "xla"))
    record[preset] = {"jaxkernels": ours, "xla": xla, **gap(ours, xla)}
  (directory / "parity.json").write_text(json.dumps(record, indent=1))

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4), squeeze=False)
  for ax, preset in zip(axes[0], presets):
    r = record[preset]
    steps = range(1, len(r["xla"]) + 1)
    ax.plot(steps, r["xla"], label="plain JAX (--kernels xla)", lw=1)
    ax.plot(steps, r["jaxkernels"], label="jaxkernels", lw=1)
    ax.set_title(f"{preset}: last tenth {r['mean_gap'] * 100:+.2f}%, final "
                 f"{r['final_gap'] * 100:+.2f}%")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_ylim(top=min(6, max(r["xla"])))
    ax.legend()
  fig.tight_layout()
  fig.savefig(directory / "parity.png", dpi=110)
  for preset in presets:
    r = record[preset]
    print(f"{preset}: final {r['final'][0]:.4f} vs {r['final'][1]:.4f} "
          f"({r['final_gap'] * 100:+.2f}%), last tenth {r['mean_gap'] * 100:+.2f}%, "
          f"every step {r['stepwise_mean_gap'] * 100:+.2f}%")
  return 0


if __name__ == "__main__":
  sys.exit(main())
