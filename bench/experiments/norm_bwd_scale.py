"""TEMPORARY (run 44): the norm backward with its scale reloaded every row block in the tile's
layout (``triton.BWD_SCALE_PER_BLOCK``) instead of held in registers for the whole persistent
loop: 8 registers a thread fewer at 16 warps, where layer_norm's backward holds 75 (one program
of 16 warps an SM) and rms_norm's 64 (two, run 43: 143.6 us against 147.8 at 8 warps). A/B
twice, backward and forward+backward, with register counts from the saved cubins.

  python -m bench.experiments.norm_bwd_scale OUT.json [OUT.pkl]
"""
from __future__ import annotations

import json
import pickle
import sys

SHAPE = (16384, 4096)


def main(out_json, out_pkl=None):
  import jax
  import jax.numpy as jnp

  import jaxkernels as jk
  from bench import harness, norms
  from jaxkernels import hardware
  from jaxkernels.ops.norms import triton

  records, payloads = [], {}
  for rep in range(2):
    for name, layer in (("layer", True), ("rms", False)):
      base = triton.heuristic(jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16), None, None, None,
                              hardware.chip("H200"), layer=layer).__dict__
      sets = [norms._inputs(*SHAPE, jnp.bfloat16, layer, True)(seed) for seed in range(16)]
      for per_block in (False, True):
        for warps in (8, 16):
          triton.BWD_SCALE_PER_BLOCK = per_block
          config = triton.Config(**{**base, "bwd_num_warps": warps})

          def f(x, res, s, b, config=config, layer=layer):
            if layer:
              return jk.layer_norm(x, s, b, residual=res, implementation="triton",
                                   config=config)
            return jk.rms_norm(x, s, residual=res, implementation="triton", config=config)

          timed = harness._Timed(f, (0, 2) + ((3,) if layer else ()))
          rec = {"rep": rep, "op": name, "per_block": per_block, "warps": warps}
          for label in ("bwd", "fwd+bwd"):
            program, arg_sets = timed.programs[label], timed.arg_sets(label, sets)
            rec[label] = harness.time_sets(program, arg_sets, rounds=15, calls=10) * 1e6
            if rep == 0 and label == "bwd":
              out = program(*arg_sets[0])
              triton.BWD_SCALE_PER_BLOCK = False
              ref = harness._Timed(f, (0, 2) + ((3,) if layer else ())).programs[label](
                  *arg_sets[0])
              triton.BWD_SCALE_PER_BLOCK = per_block
              rec["max_diff"] = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) -
                                                          b.astype(jnp.float32))))
                                    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
              if out_pkl:
                from jax.experimental.serialize_executable import serialize
                payloads[f"{name}_bwd_pb{int(per_block)}_w{warps}"] = serialize(
                    program.lower(*arg_sets[0]).compile())[0]
          records.append(rec)
          print("RECORD " + json.dumps(rec), flush=True)
  triton.BWD_SCALE_PER_BLOCK = False
  with open(out_json, "w") as fh:
    json.dump(records, fh, indent=1)
  if out_pkl:
    with open(out_pkl, "wb") as fh:
      pickle.dump(payloads, fh)
  for r in records:
    print(f"rep {r['rep']} {r['op']:5s} per_block {r['per_block']!s:5s} warps {r['warps']:2d} "
          f"bwd {r['bwd']:7.1f} fwd+bwd {r['fwd+bwd']:7.1f} us {r.get('max_diff', '')}")


if __name__ == "__main__":
  main(*sys.argv[1:])
