"""Forward and backward tile configs of both norms at 16384x4096 bf16 (steady host clock, 16
input sets), each compiled program saved so that its cubins give register counts here:

  python -m bench.experiments.norm_configs OUT.json [OUT.pkl]
  python -m bench.experiments.dump_ptx --sass OUT.pkl DIR   # then cuobjdump -res-usage

Run 33 (bench/NOTES.md) asked whether the layer_norm+residual forward's gap to rms_norm's
(145 vs 138 us) is occupancy (74 registers a thread, three programs of 8 warps an SM, against
64 and four). Partly for rms_norm: at 16 warps (40 registers, three programs of 16 warps) it ran
134-136 us. For layer_norm, 16 warps held 42 registers, one allocation step over three programs,
and ran 159-162 us; with 40 (a pivot-free variance) 148, no better than 8 warps.
"""
from __future__ import annotations

import json
import os
import sys

SHAPE = tuple(int(v) for v in os.environ.get("NORM_CONFIGS_SHAPE", "16384x4096").split("x"))
# (block_rows, num_warps) and (bwd_block_rows, bwd_num_warps, bwd_programs); run 33 timed
# FWD (2, 8), (2, 16), (1, 8), (1, 4), (4, 16), (4, 32) and BWD (1, 8, 264), (1, 8, 256),
# (2, 16, 132), (1, 16, 132), (1, 4, 528) (bench/NOTES.md); run 43 these, after the FMAs.
FWD = ((2, 8), (2, 16), (2, 32), (1, 8), (1, 16), (4, 32))
BWD = ((1, 8, 264), (1, 16, 264), (1, 16, 132), (1, 4, 528), (2, 8, 264), (1, 32, 132))


def main(out_json, out_pkl=None):
  import jax
  import jax.numpy as jnp

  import jaxkernels as jk
  from bench import harness, norms
  from bench.experiments import dump_ptx
  from jaxkernels import hardware
  from jaxkernels.ops.norms import triton

  on_gpu = jax.devices()[0].platform == "gpu"
  records, executables = [], {}
  for name, layer in (("rms_norm+residual", False), ("layer_norm+residual", True)):
    base = triton.heuristic(jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16), None, None, None,
                            hardware.chip("H200"), layer=layer).__dict__
    fwd = ((base["block_rows"], base["num_warps"]),) + FWD  # the heuristic's own first
    bwd = ((base["bwd_block_rows"], base["bwd_num_warps"], base["bwd_programs"]),) + BWD
    draw = norms._inputs(*SHAPE, jnp.bfloat16, layer, True)
    sets = [draw(seed) for seed in range(16 if on_gpu else 1)]
    variants = [("fwd", r, w, base["bwd_programs"], {"block_rows": r, "num_warps": w})
                for r, w in fwd]
    variants += [("bwd", r, w, p, {"bwd_block_rows": r, "bwd_num_warps": w,
                                   "bwd_programs": p}) for r, w, p in bwd]
    for label, r, w, p, fields in variants:
      config = triton.Config(**{**base, **fields})

      def f(x, res, s, b, config=config, layer=layer):
        if layer:
          return jk.layer_norm(x, s, b, residual=res, implementation="triton", config=config)
        return jk.rms_norm(x, s, residual=res, implementation="triton", config=config)

      timed = harness._Timed(f, (0, 2) + ((3,) if layer else ()))
      arg_sets = timed.arg_sets(label, sets)
      rec = {"op": name, "pass": label, "rows": r, "warps": w, "programs": p}
      try:
        program = timed.programs[label]
        rec["us"] = harness.time_sets(program, arg_sets, rounds=15, calls=10) * 1e6
        if on_gpu and out_pkl:
          executables[f"{name.replace('+', '_')}_{label}_r{r}w{w}p{p}"] = program.lower(
              *arg_sets[0]).compile()
      except Exception as e:  # noqa: BLE001 - a config that fails is a row
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      records.append(rec)
      print("RECORD " + json.dumps(rec), flush=True)
  with open(out_json, "w") as fh:
    json.dump(records, fh, indent=1)
  if out_pkl:
    dump_ptx.save(executables, out_pkl)
  print(f"{'op':22s} {'pass':4s} {'rows':>4s} {'warps':>5s} {'progs':>5s} {'us':>8s}")
  for rec in records:
    print(f"{rec['op']:22s} {rec['pass']:4s} {rec['rows']:4d} {rec['warps']:5d} "
          f"{rec['programs']:5d} {rec.get('us', 0):8.1f} {rec.get('error', '')[:60]}")


if __name__ == "__main__":
  main(*sys.argv[1:])
