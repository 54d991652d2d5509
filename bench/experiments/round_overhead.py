"""Where is the host clock's excess over the kernel clock spent: in every program, or once a round?

Run 28 (bench/NOTES.md) found the kernels of one program back to back on the device, so the
host clock's excess (3-4 us a set for ~75 us kernels, 16 sets a program) lies outside the
programs. Two candidates:

  (a) a cost per program: the device idles between consecutive programs of a round;
  (b) a cost per round: the device idles while the host dispatches the round's first program
      (the clock starts with the device idle), plus the final sync.

(a) gives an excess per set that does not depend on how many programs a round holds; (b) one
that falls as 1/calls. This times the same programs with 1, 3, 10 and 30 calls a round, the host
time one dispatch takes with the device idle, and, in a profiler trace of one round of 10 calls,
the gaps between the programs on the device.

  python -m bench.experiments.round_overhead [OUT.json]
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

CALLS = (1, 3, 10, 30)
ROUNDS = 15
SHAPE = tuple(int(v) for v in os.environ.get("ROUND_OVERHEAD_SHAPE", "16384x4096").split("x"))


def _cases():
  import jax
  import jax.numpy as jnp

  import jaxkernels as jk
  from bench import harness, norms
  from jaxkernels import tuning

  out = {}
  for impl in ("triton", "xla"):
    def f(x, r, s, b, impl=impl):
      return jk.rms_norm(x, s, residual=r, implementation=impl)
    draw = norms._inputs(*SHAPE, jnp.bfloat16, False, True)
    for label in ("fwd", "fwd+bwd"):
      timed = harness._Timed(f, (0, 2))
      sets = [draw(seed) for seed in range(16)]
      out[f"{impl} rms_norm+residual {label}"] = (timed.programs[label],
                                                  timed.arg_sets(label, sets))
  x = [jax.random.normal(jax.random.key(i), SHAPE, jnp.bfloat16) for i in range(16)]
  out["xla negate"] = (lambda a: -a, [(a,) for a in x])
  # (fn, batched program over the sets, the sets)
  return {name: (fn, tuning.over_sets(fn), sets) for name, (fn, sets) in out.items()}


def _dispatch_us(program, sets, repeats=10):
  """Host microseconds one call of the batched program takes to return, the device idle."""
  import jax
  samples = []
  for _ in range(repeats):
    jax.block_until_ready(program(sets))
    start = time.perf_counter()
    out = program(sets)
    samples.append((time.perf_counter() - start) * 1e6)
    jax.block_until_ready(out)
  return statistics.median(samples)


def _trace_round(program, sets, calls=10):
  """Device events of one round of ``calls`` programs: the gaps over 5 us between events, the
  span from the first event's start to the last one's end, and the busy time."""
  import jax

  from bench.experiments.launch_gaps import device_events
  jax.block_until_ready(program(sets))
  walls = []

  def run():
    start = time.perf_counter()
    for _ in range(calls):
      out = program(sets)
    jax.block_until_ready(out)
    walls.append((time.perf_counter() - start) * 1e6)

  events = [(start, duration) for start, duration, _ in device_events(run)]
  wall = walls[0]
  if not events:
    return {"wall_us": round(wall, 1), "events": 0, "span_us": 0, "busy_us": 0,
            "gaps_over_5us": []}
  gaps = [(s - ps - pd) / 1e3 for (ps, pd), (s, _) in zip(events, events[1:])]
  return {"wall_us": round(wall, 1), "events": len(events),
          "span_us": round((events[-1][0] + events[-1][1] - events[0][0]) / 1e3, 1),
          "busy_us": round(sum(d for _, d in events) / 1e3, 1),
          "gaps_over_5us": [round(g, 1) for g in gaps if g > 5]}


def main(out_path=None):
  from bench import harness
  from jaxkernels import tuning
  records = []
  cases = _cases()
  for name, (fn, program, sets) in cases.items():
    rec = {"op": name, "sets": len(sets), "dispatch_us": round(_dispatch_us(program, sets), 1)}
    kernel, kernels = harness.kernel_seconds(fn, sets)
    rec["kernel_us"] = kernel and round(kernel * 1e6, 2)
    rec["kernels"] = kernels
    for calls in CALLS:  # the whole-round clock, as the bench's headline was until this run
      rec[f"host_us_calls{calls}"] = round(
          tuning.time_on_device(fn, sets, rounds=ROUNDS, calls=calls) * 1e6, 2)
    records.append(rec)
    print("RECORD " + json.dumps(rec), flush=True)
  # Traces last: CUPTI measurements after a trace abort the process (launch_gaps.py).
  for rec, (_, program, sets) in zip(records, cases.values()):
    rec["trace"] = _trace_round(program, sets)
    print("TRACE " + json.dumps({"op": rec["op"], **rec["trace"]}), flush=True)
  if out_path:
    with open(out_path, "w") as f:
      json.dump(records, f, indent=1)
  print(f"{'op':34s} {'disp us':>8s} {'kernel':>7s} " + " ".join(f"{'c' + str(c):>7s}"
                                                            for c in CALLS))
  for r in records:
    print(f"{r['op']:34s} {r['dispatch_us']:8.1f} {(r['kernel_us'] or 0):7.1f} "
          + " ".join(f"{r[f'host_us_calls{c}']:7.1f}" for c in CALLS))
    t = r["trace"]
    print(f"    trace of 10 calls: wall {t['wall_us']} span {t['span_us']} busy {t['busy_us']} "
          f"events {t['events']} gaps>5us {t['gaps_over_5us'][:12]}")


if __name__ == "__main__":
  main(*sys.argv[1:])
