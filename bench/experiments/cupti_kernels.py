"""Which kernels each timed program launches, and how long each runs on the device (CUPTI),
against the host-clock time of the same program in the harness (bench/NOTES.md run 17).

ncu timed the residual+RMSNorm forward kernel at 137 us, where the harness measures 151 us for
the program: is the difference extra kernels in the program, or gaps between launches?

  python -m bench.experiments.cupti_kernels [name-filter]
"""
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

from bench import elementwise, harness, norms

ITERATIONS = 20


@dataclasses.dataclass
class _Opts:
  smoke: bool = False


def kernels(program, args):
  """[(kernel name, median ms)] over ITERATIONS runs of one program on one argument set."""
  _, runs = profiler.measure(program, aggregate=False, iterations=ITERATIONS)(*args)
  if runs is None:
    return []
  names = [name for name, _ in runs[0]]
  return [(name, float(np.median([run[i][1] for run in runs]))) for i, name in enumerate(names)]


def overhead():
  """Host-clock time per negate against its kernel time, with 1, 4 and 16 negates (of distinct
  128 MiB arrays) in one program: is the excess paid per program or per kernel?"""
  n = 16384 * 4096
  xs = [jnp.full((n,), i + 1, jnp.bfloat16) for i in range(16)]
  for k in (1, 4, 16):
    fn = jax.jit(lambda xs: [-x for x in xs])
    ks = kernels(fn, (xs[:k],))
    per_kernel = sum(t for _, t in ks) / k
    wall = harness.time_sets(lambda *xs: [-x for x in xs], [tuple(xs[:k])], rounds=10, calls=10)
    print(f"negate x{k} in one program: kernel {per_kernel * 1e3:.1f} us, host clock "
          f"{wall * 1e6 / k:.1f} us a negate ({len(ks)} kernels)", flush=True)


def main(pattern=""):
  if pattern == "overhead":
    return overhead()
  records = []
  n = 16384 * 4096
  # -x: x + 0 is simplified away and the input forwarded, launching nothing.
  copies = {"xla negate 128MiB": jax.jit(lambda x: -x), "xla negate 2GiB": jax.jit(lambda x: -x)}
  for name, fn in copies.items():
    x = jnp.ones((n,) if "128" in name else (8 * n,), jnp.bfloat16) * 3
    ks = kernels(fn, (x,))
    ms = sum(t for _, t in ks) or float("nan")
    wall = harness.time_sets(fn, [(x,)], rounds=10, calls=10)  # one set: fine for a copy timing
    records.append(dict(name=name, impl="xla", label="", kernels=ks, kernel_ms=ms,
                        wall_ms=wall * 1e3, gbps_kernel=2 * x.nbytes / ms / 1e6))
    print(records[-1], flush=True)

  cases = norms.cases(_Opts()) + elementwise.cases(_Opts())
  for case in cases:
    if pattern not in case.name:
      continue
    sets = [case.inputs(seed) for seed in range(4)]
    costs = {"fwd": case.fwd_cost, "bwd": case.bwd_cost, "fwd+bwd": case.fwd_cost + case.bwd_cost}
    for impl in ("xla", "triton"):
      timed = harness._Timed(case.op(impl, None), case.grads)
      for label, cost in costs.items():
        program = timed.programs[label]
        args = timed._args(label, *sets[0])
        ks = kernels(program, args)
        ms = sum(t for _, t in ks) or float("nan")
        wall = harness.time_sets(program, timed.arg_sets(label, sets), rounds=10, calls=10)
        records.append(dict(name=case.name, impl=impl, label=label, kernels=ks, kernel_ms=ms,
                            wall_ms=wall * 1e3, gbps_kernel=cost.bytes / ms / 1e6,
                            gbps_wall=cost.bytes / wall / 1e9))
        r = records[-1]
        print(f"{case.name} {label} {impl}: kernels {ms:.4f} ms ({r['gbps_kernel']:.0f} GB/s), "
              f"wall {r['wall_ms']:.4f} ms ({r['gbps_wall']:.0f} GB/s); "
              + ", ".join(f"{k[:40]} {t * 1e3:.1f}us" for k, t in ks), flush=True)
  json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                 commit=os.environ.get("JAXKERNELS_COMMIT", "unknown"), records=records),
            open(f"{os.environ.get('OUT', '/tmp')}/cupti_kernels.json", "w"), indent=1)


if __name__ == "__main__":
  main(*sys.argv[1:])
