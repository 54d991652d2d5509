"""Is the fused epilogue's cost in cycles or in energy? (matmul, H200 at its 700 W cap)

For the cooperative and ping-pong Mosaic GPU schedules, plain and with bias+gelu, this takes
  * the kernel time on a cool card (CUPTI after 5 s idle), where the clock is at its boost;
  * the host-clock time per product over 3 s of back-to-back products, with nvidia-smi
    sampling SM clock and power meanwhile; time x clock is then the product's cycles.
If ping-pong hides the epilogue in cycles, its bias+gelu and plain rows spend the same cycles
and differ only by the clock the extra arithmetic's power leaves.

``--variants epilogue`` instead takes the cooperative schedule's plain product and activation
epilogues under the heuristic's config and under two others (64x64 pieces in 2 slots, whole
128x128 pieces in 1 slot, both over 3 stages).

  python -m bench.experiments.matmul_power [--sizes 8192,4096] [--variants schedules|epilogue]
      [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp

import jaxkernels as jk
from bench import harness
from bench.matmul import PINGPONG
from jaxkernels import hardware, tuning
from jaxkernels.ops.matmul import mosaic_gpu
from jaxkernels.ops.matmul.common import Problem

BF16 = jnp.bfloat16


def _sets(s, n_sets=4):
  out = []
  for seed in range(n_sets):
    ka, kb, kc = jax.random.split(jax.random.key(seed), 3)
    out.append((jax.random.normal(ka, (s, s), BF16) / s ** 0.25,
                jax.random.normal(kb, (s, s), BF16) / s ** 0.25,
                jax.random.normal(kc, (s,), BF16)))
  return out


def _sample(proc):
  proc.terminate()
  text, _ = proc.communicate()
  rows = []
  for line in text.strip().splitlines():
    parts = [p.strip() for p in line.split(",")]
    try:
      rows.append((time.time(), float(parts[0]), float(parts[1])))
    except (ValueError, IndexError):
      continue
  return rows


def measure(fn, sets, seconds=3.0):
  batched = tuning.over_sets(fn)
  harness.block(batched(sets))
  time.sleep(5)
  cool, _ = harness.kernel_seconds(fn, sets, iterations=3)
  smi = subprocess.Popen(["nvidia-smi", "--query-gpu=power.draw,clocks.sm",
                          "--format=csv,noheader,nounits", "-lms", "50"],
                         stdout=subprocess.PIPE, text=True)
  start = time.perf_counter()
  marks = []
  while time.perf_counter() - start < seconds:
    t0 = time.perf_counter()
    for _ in range(5):
      out = batched(sets)
    harness.block(out)
    marks.append((t0, time.perf_counter(), 5 * len(sets)))
  samples = _sample(smi)
  # The last two thirds: the card has settled at its cap.
  steady = marks[len(marks) // 3:]
  hot = sum(t1 - t0 for t0, t1, _ in steady) / sum(n for *_, n in steady)
  tail = samples[len(samples) // 3:] or samples
  watts = statistics.mean(w for _, w, _ in tail) if tail else None
  mhz = statistics.mean(m for *_, m in tail) if tail else None
  return dict(cool_ms=cool and cool * 1e3, hot_ms=hot * 1e3, watts=watts, sm_mhz=mhz)


def _epilogue_variants(s):
  """Plain, and each activation epilogue with bias, under the heuristic's config, under 64x64
  epilogue pieces in 2 slots and under whole-tile pieces in 1 slot, both over 3 stages."""
  chip = hardware.chip_for(jax.devices()[0].device_kind)
  def config(act, **changes):
    problem = Problem(m=s, n=s, k=s, dtype=jnp.dtype(BF16), out_dtype=jnp.dtype(BF16),
                      activation=act, has_bias=act is not None)
    return dataclasses.replace(mosaic_gpu.heuristic(problem, chip), **changes)
  variants = {}
  for act in (None, "silu", "gelu"):
    for label, changes in (("", {}),
                           (" epi 64x64x2 s3", dict(epi_tile_m=64, epi_tile_n=64, epi_slots=2,
                                                    stages=3)),
                           (" epi 128x128x1 s3", dict(epi_tile_m=128, epi_tile_n=128,
                                                      epi_slots=1, stages=3))):
      variants[f"bias+{act or 'nothing'}{label}" if act else f"plain{label}"] = functools.partial(
          lambda a, b, bias, act, c: jk.matmul(a, b, bias=bias if act else None, activation=act,
                                               implementation="mosaic_gpu", config=c),
          act=act, c=config(act, **changes))
  variants["xla plain"] = lambda a, b, bias: a @ b
  return variants


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=None)
  parser.add_argument("--sizes", default="8192,4096")
  parser.add_argument("--variants", default="schedules", choices=("schedules", "epilogue"))
  args = parser.parse_args()
  schedules = {
      "cooperative plain": lambda a, b, bias: jk.matmul(a, b, implementation="mosaic_gpu"),
      "cooperative bias+gelu": lambda a, b, bias: jk.matmul(
          a, b, bias=bias, activation="gelu", implementation="mosaic_gpu"),
      "pingpong plain": lambda a, b, bias: jk.matmul(a, b, implementation="mosaic_gpu",
                                                     config=PINGPONG),
      "pingpong bias+gelu": lambda a, b, bias: jk.matmul(
          a, b, bias=bias, activation="gelu", implementation="mosaic_gpu", config=PINGPONG),
      "xla plain": lambda a, b, bias: a @ b,
  }
  rows = []
  for s in (int(v) for v in args.sizes.split(",")):
    sets = _sets(s)
    variants = schedules if args.variants == "schedules" else _epilogue_variants(s)
    for name, fn in variants.items():
      r = dict(size=s, variant=name, **measure(fn, sets))
      flops = 2.0 * s ** 3
      r["hot_tflops"] = flops / (r["hot_ms"] * 1e-3) / 1e12
      r["cool_tflops"] = r["cool_ms"] and flops / (r["cool_ms"] * 1e-3) / 1e12
      r["hot_mcycles"] = r["sm_mhz"] and r["hot_ms"] * 1e-3 * r["sm_mhz"]
      rows.append(r)
      print(json.dumps(r), flush=True)
  print(f"{'size':>5} {'variant':<24} {'cool ms':>8} {'hot ms':>8} {'hot TF':>7} {'MHz':>6} "
        f"{'W':>5} {'Mcycles':>8}")
  for r in rows:
    print(f"{r['size']:>5} {r['variant']:<24} {r['cool_ms'] or 0:8.4f} {r['hot_ms']:8.4f} "
          f"{r['hot_tflops']:7.0f} {r['sm_mhz'] or 0:6.0f} {r['watts'] or 0:5.0f} "
          f"{r['hot_mcycles'] or 0:8.3f}")
  if args.out:
    with open(os.path.join(args.out, f"matmul_power_{args.variants}.json"), "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                     commit=os.environ.get("JAXKERNELS_COMMIT"), rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
