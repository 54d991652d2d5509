"""A/B of the residual norms' Triton kernels under ``triton.EXPERIMENT`` switches, in one process.

Each variant is timed on the same input sets (host clock and CUPTI kernel clock, as the
harness does), twice over in ABAB order so the spread between passes shows the noise; every
variant's outputs are checked against the base variant's. With ``--sass OUT.pkl`` the forward
and gradient executables of every variant are serialized as well, for
``python -m bench.experiments.dump_ptx --sass OUT.pkl DIR`` on a machine with cuobjdump.

  python -m bench.experiments.norm_variants [--sass OUT.pkl] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import pickle

import jax
import numpy as np

from bench import harness, norms
from jaxkernels.ops.norms import triton

VARIANTS = {
    "base": {},
    "late_pivot": {"late_pivot": True},  # the pivot loaded after h is stored (as before)
    "early_scale": {"early_scale": True},
    "contiguous_bwd": {"contiguous_bwd": True},
    "early_scale+contiguous": {"early_scale": True, "contiguous_bwd": True},
}
N_SETS = 12


class _Opts:
  smoke = False


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--sass", default=None)
  parser.add_argument("--json", default=None)
  parser.add_argument("--passes", type=int, default=2)
  args = parser.parse_args()

  cases = [c for c in norms.cases(_Opts()) if "+residual" in c.name]
  sets = {c.name: [c.inputs(seed) for seed in range(N_SETS)] for c in cases}
  records, payloads, reference = [], {}, {}
  for p in range(args.passes):
    for variant, flags in VARIANTS.items():
      triton.EXPERIMENT.clear()
      triton.EXPERIMENT.update(flags)
      jax.clear_caches()
      for case in cases:
        costs = {"fwd": case.fwd_cost, "bwd": case.bwd_cost,
                 "fwd+bwd": case.fwd_cost + case.bwd_cost}
        timed = harness._Timed(case.op("triton", None), case.grads)
        for label, cost in costs.items():
          program = timed.programs[label]
          arg_sets = timed.arg_sets(label, sets[case.name])
          out = jax.tree.map(np.asarray, jax.device_get(program(*arg_sets[0])))
          key = (case.name, label)
          if variant == "base" and key not in reference:
            reference[key] = out
          diff = max(float(np.max(np.abs(a.astype(np.float32) - b.astype(np.float32))))
                     for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(reference[key])))
          seconds = harness.time_sets(program, arg_sets, rounds=15, calls=10)
          kernel, names = harness.kernel_seconds(program, arg_sets)
          rec = dict(variant=variant, passno=p, name=f"{case.name} {label}", ms=seconds * 1e3,
                     gbps=cost.bytes / seconds / 1e9, kernel_ms=kernel and kernel * 1e3,
                     kernel_gbps=kernel and cost.bytes / kernel / 1e9, kernels=names,
                     max_abs_diff_vs_base=diff)
          records.append(rec)
          print(json.dumps(rec), flush=True)
          if args.sass and p == 0 and label in ("fwd", "fwd+bwd"):
            from jax.experimental.serialize_executable import serialize
            compiled = program.lower(*arg_sets[0]).compile()
            payloads[f"{variant}_{case.name}_{label}".replace("+", "_")] = serialize(compiled)[0]
  triton.EXPERIMENT.clear()
  if args.sass:
    with open(args.sass, "wb") as f:
      pickle.dump(payloads, f)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(records, f, indent=1)
  print("\nvariant                      op                              pass  host GB/s  kernel GB/s  ms")
  for r in records:
    print(f"{r['variant']:28s} {r['name']:32s} {r['passno']:4d} {r['gbps']:9.0f} "
          f"{(r['kernel_gbps'] or 0):11.0f}  {r['ms']:.4f}  diff {r['max_abs_diff_vs_base']:.1e}")


if __name__ == "__main__":
  main()
