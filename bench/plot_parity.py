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
  fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4), squeeze=False)
  for ax, preset in zip(axes[0], presets):
    variants = found[preset]
    for variant in ["xla", "jaxkernels"] + sorted(set(variants) - {"xla", "jaxkernels"}):
      for i, (seed, losses) in enumerate(sorted(variants.get(variant, {}).items())):
        ax.plot(range(1, len(losses) + 1), losses, lw=1 if variant in ("xla", "jaxkernels")
                else 0.6, color={"xla": "C0", "jaxkernels": "C1"}.get(variant),
                label=(("plain JAX (--kernels xla)" if variant == "xla" else variant)
                       if i == 0 else None))
    g = record[preset]["gaps"].get("jaxkernels")
    title = preset if g is None else (f"{preset}: jaxkernels {g['gap_pct_mean']:+.2f}% "
                                      f"(last tenth, seeds: {len(g['gap_pct_per_seed'])})")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_ylim(top=min(6, max(max(c) for c in variants["xla"].values())))
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(directory / "parity.png", dpi=110)
  for preset in presets:
    for variant, g in record[preset]["gaps"].items():
      print(describe(preset, variant, g))
  return 0


if __name__ == "__main__":
  sys.exit(main())
