"""Loss parity: the kernels' training curves against plain JAX's (``--kernels xla``), same seed and
batches, from ``bench/parity.sh``'s JSON lines (``PRESET_VARIANT_sSEED.jsonl``).

    python -m bench.plot_parity DIR [PRESET ...]

The gap of a variant (``jaxkernels``, or ``ref-OPS``: the kernels with OPS on XLA's path) is its
mean loss over the last tenth of the steps against xla's with the same seed, in percent: a
single step's loss is one batch's, too noisy to compare. Two runs whose arithmetic differs at
all (another kernel, another summation order) part ways within a few steps, so one seed's gap
is one draw: with several seeds the gap's mean and standard error say whether it is more than
that. Writes DIR/parity.json and DIR/parity.png.
"""

from __future__ import annotations

import collections
import json
import math
import pathlib
import re
import statistics
import sys


def curve(path: pathlib.Path) -> list[float]:
  rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  return [row["loss"] for row in sorted(rows, key=lambda r: r["step"])]


SMOOTH = 20  # steps in the plot's running mean (one step's loss is one batch's)


def smooth(losses: list[float]) -> list[float]:
  out, total = [], 0.0
  for i, loss in enumerate(losses):
    total += loss - (losses[i - SMOOTH] if i >= SMOOTH else 0.0)
    out.append(total / min(i + 1, SMOOTH))
  return out


def tail_mean(losses: list[float]) -> float:
  tail = max(1, len(losses) // 10)
  return sum(losses[-tail:]) / tail


def runs(directory: pathlib.Path) -> dict[str, dict[str, dict[int, list[float]]]]:
  """preset -> variant -> seed -> losses."""
  found = collections.defaultdict(lambda: collections.defaultdict(dict))
  for path in sorted(directory.glob("*.jsonl")):
    match = re.fullmatch(r"(\w+?)_(.+)_s(\d+)\.jsonl", path.name)
    if match:
      preset, variant, seed = match.groups()
      found[preset][variant][int(seed)] = curve(path)
  return found


def gaps(variants: dict[str, dict[int, list[float]]]) -> dict[str, dict]:
  """Each variant's gap to xla (same seed), per seed and over the seeds."""
  xla = variants["xla"]
  out = {}
  for variant, by_seed in sorted(variants.items()):
    if variant == "xla":
      continue
    per_seed = {seed: 100 * (tail_mean(losses) / tail_mean(xla[seed]) - 1)
                for seed, losses in sorted(by_seed.items()) if seed in xla}
    if not per_seed:
      continue
    values = list(per_seed.values())
    out[variant] = {
        "gap_pct_per_seed": per_seed,
        "final": {seed: [by_seed[seed][-1], xla[seed][-1]] for seed in per_seed},
        "gap_pct_mean": statistics.mean(values),
        "gap_pct_stderr": (statistics.stdev(values) / math.sqrt(len(values))
                           if len(values) > 1 else None)}
  return out


def describe(preset: str, variant: str, g: dict) -> str:
  seeds = g["gap_pct_per_seed"]
  spread = (f" ± {g['gap_pct_stderr']:.2f} (standard error over {len(seeds)} seeds: "
            + ", ".join(f"{v:+.2f}" for v in seeds.values()) + ")"
            if g["gap_pct_stderr"] is not None else " (one seed)")
  return f"{preset} {variant} vs xla, last tenth: {g['gap_pct_mean']:+.2f}%{spread}"


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  directory = pathlib.Path(argv[0])
  found = runs(directory)
  presets = argv[1:] or sorted(p for p in found if "xla" in found[p])
  record = {preset: {"gaps": gaps(found[preset]),
                     "curves": {v: {str(s): c for s, c in by_seed.items()}
                                for v, by_seed in found[preset].items()}}
            for preset in presets}
  (directory / "parity.json").write_text(json.dumps(record, indent=1))

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  # Top: each variant's loss, the mean over seeds, smoothed; bottom: each seed's gap to xla
  # (smoothed losses, in percent), the kernels' beside the control's (xla run again).
  fig, axes = plt.subplots(2, len(presets), figsize=(6 * len(presets), 7), squeeze=False)
  colors = {"xla": "C0", "jaxkernels": "C1", "xla-again": "C2"}
  for column, preset in enumerate(presets):
    variants = found[preset]
    top, bottom = axes[0][column], axes[1][column]
    order = ["xla", "jaxkernels"] + sorted(set(variants) - {"xla", "jaxkernels"})
    for variant in order:
      by_seed = variants.get(variant, {})
      if not by_seed:
        continue
      steps = min(len(c) for c in by_seed.values())
      mean = [statistics.mean(c[i] for c in by_seed.values()) for i in range(steps)]
      top.plot(range(1, steps + 1), smooth(mean), lw=1.5 if variant != "xla-again" else 1,
               color=colors.get(variant),
               label=f"{'plain JAX (--kernels xla)' if variant == 'xla' else variant}, mean of "
                     f"{len(by_seed)} seeds")
      if variant == "xla":
        continue
      for i, (seed, losses) in enumerate(sorted(by_seed.items())):
        if seed not in variants["xla"]:
          continue
        ours, theirs = smooth(losses), smooth(variants["xla"][seed])
        bottom.plot(range(1, len(ours) + 1), [100 * (a / b - 1) for a, b in zip(ours, theirs)],
                    lw=0.8, color=colors.get(variant), label=variant if i == 0 else None)
    g = record[preset]["gaps"].get("jaxkernels")
    control = record[preset]["gaps"].get("xla-again")
    title = preset if g is None else (f"{preset}: jaxkernels {g['gap_pct_mean']:+.2f}% "
                                      f"(last tenth, {len(g['gap_pct_per_seed'])} seeds)")
    if control is not None:
      title += f"; xla again {control['gap_pct_mean']:+.2f}%"
    top.set_title(title, fontsize=9)
    top.set_ylabel(f"loss (running mean of {SMOOTH} steps)")
    top.set_ylim(top=min(6, max(max(c) for c in variants["xla"].values())))
    top.legend(fontsize=7)
    bottom.axhline(0, color="k", lw=0.5)
    bottom.set_xlabel("step")
    bottom.set_ylabel("gap to xla, same seed (%)")
    bottom.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(directory / "parity.png", dpi=110)
  for preset in presets:
    for variant, g in record[preset]["gaps"].items():
      print(describe(preset, variant, g))
  return 0


if __name__ == "__main__":
  sys.exit(main())
