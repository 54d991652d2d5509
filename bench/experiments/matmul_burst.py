"""Does the 8192^3 ratio to XLA depend on how long a timed burst of products runs?

Run 35 (bench/NOTES.md) timed the matmul headline with the steady clock (time of 20 programs
minus time of 10, bench/harness.time_rounds) and read 0.94x XLA at 8192^3, where the whole-round
clock of 10 programs had read 0.98-1.00x in every run since matmul-9. At 64 ms a round the
round's fixed cost is under 1%, so the two clocks differ in what they sample: the steady one the
second half of a 128 ms burst, on a card held longer at its 700 W cap. This times ours and XLA's
8192^3 round-robin (random order) with bursts of 5, 10, 20 and 40 programs (4 input sets each),
the whole burst and its steady difference.

  python -m bench.experiments.matmul_burst [OUT.json]
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import time

S = 8192
BURSTS = (5, 10, 20, 40)
ROUNDS = 8


def main(out_path=None):
  import jax
  import jax.numpy as jnp

  import jaxkernels as jk
  from jaxkernels import tuning

  keys = jax.random.split(jax.random.key(0), 8)
  sets = [(jax.random.normal(keys[2 * i], (S, S), jnp.bfloat16),
           jax.random.normal(keys[2 * i + 1], (S, S), jnp.bfloat16)) for i in range(4)]
  programs = {"xla": tuning.over_sets(lambda a, b: a @ b),
              "mosaic_gpu": tuning.over_sets(
                  lambda a, b: jk.matmul(a, b, implementation="mosaic_gpu"))}
  for p in programs.values():
    jax.block_until_ready(p(sets))

  def burst(program, n):
    jax.block_until_ready(program(sets))  # the same warm start for every burst
    start = time.perf_counter()
    for _ in range(n):
      out = program(sets)
    jax.block_until_ready(out)
    return time.perf_counter() - start

  samples = {(impl, n): [] for impl in programs for n in BURSTS}
  order = random.Random(0)
  for _ in range(ROUNDS):
    for impl, n in order.sample(list(samples), len(samples)):
      samples[impl, n].append(burst(programs[impl], n))
  flops = 2.0 * S ** 3 * len(sets)
  records = []
  for (impl, n), times in samples.items():
    whole = statistics.median(times) / n
    records.append({"impl": impl, "burst": n, "whole_ms": whole / len(sets) * 1e3,
                    "whole_tflops": flops / whole / 1e12})
  for impl in programs:  # steady: the marginal cost of the second half of each longer burst
    for short, long in zip(BURSTS, BURSTS[1:]):
      t = (statistics.median(samples[impl, long]) - statistics.median(samples[impl, short]))
      t /= long - short
      records.append({"impl": impl, "burst": f"{short}->{long}", "whole_ms": t / len(sets) * 1e3,
                      "whole_tflops": flops / t / 1e12})
  if out_path:
    with open(out_path, "w") as f:
      json.dump(records, f, indent=1)
  xla = {r["burst"]: r["whole_tflops"] for r in records if r["impl"] == "xla"}
  print(f"{'impl':12s} {'burst':>8s} {'ms/product':>10s} {'TFLOP/s':>8s} {'vs xla':>7s}")
  for r in records:
    print(f"{r['impl']:12s} {str(r['burst']):>8s} {r['whole_ms']:10.4f} {r['whole_tflops']:8.0f} "
          f"{r['whole_tflops'] / xla[r['burst']]:7.3f}")


if __name__ == "__main__":
  main(*sys.argv[1:])
