"""What separates our Triton kernels on the device, where XLA's fusions sit closer together?

In run 26 the host clock of a program running one op over 16 input sets exceeded the sum of its
kernels (CUPTI) by 3.1-3.6 us a kernel for our Pallas Triton kernels and by 1.0-1.5 us a kernel
for XLA's fusions. Hypothesis: XLA records runs of its own fusions into CUDA graphs (command
buffers) but launches a Pallas custom call from the host, one by one. Test: the same programs
with command buffers turned off (``--xla_gpu_enable_command_buffer=``): if XLA's gap rises to
ours, that is the difference. A profiler trace of our program lists whatever else runs between
our kernels (memsets, copies).

Outcome (bench/NOTES.md run 28): not the graphs (every row moved by under 1 us without them);
the traces show the kernels of a program back to back for ours and XLA's alike, so the excess
is spent between programs.

  python -m bench.experiments.launch_gaps [OUT.json]
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile

FLAG_SETS = {
    "default": "",
    "no_command_buffers": "--xla_gpu_enable_command_buffer=",
    "trace": "",
}
SHAPE = (16384, 4096)
N_SETS = 16


def _ops():
  import jaxkernels as jk
  return {
      "triton bias+gelu fwd": lambda x, b: jk.bias_activation(x, b, activation="gelu",
                                                              implementation="triton"),
      "xla bias+gelu fwd": lambda x, b: jk.bias_activation(x, b, activation="gelu",
                                                           implementation="xla"),
      "triton rms_norm fwd": lambda x, b: jk.rms_norm(x, b + 1, implementation="triton"),
      "xla rms_norm fwd": lambda x, b: jk.rms_norm(x, b + 1, implementation="xla"),
  }


def _sets():
  import jax
  import jax.numpy as jnp
  keys = jax.random.split(jax.random.key(0), N_SETS)
  return [(jax.random.normal(k, SHAPE, jnp.bfloat16),
           jax.random.normal(jax.random.fold_in(k, 1), SHAPE[-1:], jnp.bfloat16))
          for k in keys]


def device_events(run):
  """(start_ns, duration_ns, name) of every event on the GPU's streams while ``run()`` runs under
  a profiler trace, sorted by start."""
  import jax
  from jax.profiler import ProfileData
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      run()
    path = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0]
    data = ProfileData.from_file(path)
  events = []
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if "Stream" in line.name:
        events += [(e.start_ns, e.duration_ns, e.name) for e in line.events]
  return sorted(events)


def _trace_gaps(fn, sets):
  """Events on the GPU's streams during three runs of the batched program: per name, count
  and total time, and the idle time between consecutive events."""
  import jax

  from jaxkernels import tuning
  program = tuning.over_sets(fn)
  jax.block_until_ready(program(sets))

  def run():
    for _ in range(3):
      jax.block_until_ready(program(sets))

  events = device_events(run)
  names, gaps = {}, []
  for i, (start, dur, name) in enumerate(events):
    count, total = names.get(name, (0, 0.0))
    names[name] = (count + 1, total + dur / 1e3)
    if i:
      prev_start, prev_dur, _ = events[i - 1]
      gaps.append((start - prev_start - prev_dur) / 1e3)
  gaps.sort()
  return {"events": {k: [c, round(t, 1)] for k, (c, t) in names.items()},
          "gap_us_median": gaps[len(gaps) // 2] if gaps else None,
          "gap_us_quartiles": [gaps[len(gaps) // 4], gaps[3 * len(gaps) // 4]] if gaps else None,
          "gaps_over_5us": [round(g, 1) for g in gaps if g > 5],
          "span_us": round((events[-1][0] + events[-1][1] - events[0][0]) / 1e3, 1) if events else None,
          "busy_us": round(sum(e[1] for e in events) / 1e3, 1)}


def child(flags_name):
  """Host clock and CUPTI kernel time of each op; with flags_name "trace", a profiler trace
  instead (in its own process: CUPTI measurements after a trace abort the process)."""
  from bench import harness
  sets = _sets()
  for name, fn in _ops().items():
    if flags_name == "trace":
      rec = {"flags": flags_name, "op": name, "host_us": 0.0, "kernel_us": None,
             "gap_us_per_set": None, "trace": _trace_gaps(fn, sets)}
    else:
      host = harness.time_sets(fn, sets, rounds=15, calls=10)
      kernel, kernels = harness.kernel_seconds(fn, sets)
      rec = {"flags": flags_name, "op": name, "host_us": host * 1e6,
             "kernel_us": kernel and kernel * 1e6, "kernels": kernels,
             "gap_us_per_set": kernel and (host - kernel) * 1e6}
    print("RECORD " + json.dumps(rec), flush=True)


def main(out_path=None):
  records = []
  for flags_name, flags in FLAG_SETS.items():
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
    proc = subprocess.run([sys.executable, "-m", "bench.experiments.launch_gaps", "--child",
                           flags_name], env=env, capture_output=True, text=True, timeout=400)
    lines = [ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RECORD ")]
    records += [json.loads(ln) for ln in lines]
    if proc.returncode:
      print(flags_name, "FAILED", proc.stderr[-2000:], flush=True)
  if out_path:
    with open(out_path, "w") as f:
      json.dump(records, f, indent=1)
  print(f"{'flags':20s} {'op':24s} {'host us':>8s} {'kernel us':>9s} {'excess/set':>10s}")
  for r in records:
    print(f"{r['flags']:20s} {r['op']:24s} {r['host_us']:8.1f} {(r['kernel_us'] or 0):9.1f} "
          f"{(r['gap_us_per_set'] or 0):10.2f}")
    if isinstance(r.get("trace"), dict):
      t = r["trace"]
      print(f"    trace: median gap {t['gap_us_median']} us, quartiles {t['gap_us_quartiles']}, "
            f"over 5 us: {t['gaps_over_5us']}, span {t['span_us']} us, busy {t['busy_us']} us, "
            f"events {t['events']}")


if __name__ == "__main__":
  if len(sys.argv) > 2 and sys.argv[1] == "--child":
    child(sys.argv[2])
  else:
    main(*sys.argv[1:])
