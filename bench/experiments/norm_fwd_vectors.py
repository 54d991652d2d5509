"""TEMPORARY (run 40): where the norm forward loads its scale and bias, A/B twice.

run 33's SASS of the layer_norm+residual forward (2 rows x 8 warps): after the row reduction the
scale is loaded (L2), converted to the tile's layout through shared memory (its STS waits for
the load), and only then is the bias loaded and converted: two L2 round trips in series between
the reduction and the stores, every row block. Modes of ``triton.FWD_VECTORS``:
  late        shipped: scale, then bias, each where it is used
  paired      both loaded after the reduction, before either is used
  early       both loaded with x and the residual, before the reduction
  early_tile  as early, as (rows, cols) tiles in the tile's own layout (no conversion)

  python -m bench.experiments.norm_fwd_vectors OUT.json [OUT.pkl]
"""
from __future__ import annotations

import json
import pickle
import sys

SHAPE = (16384, 4096)
MODES = ("late", "paired", "early", "early_tile")


def main(out_json, out_pkl=None):
  import jax
  import jax.numpy as jnp

  import jaxkernels as jk
  from bench import harness, norms
  from jaxkernels import hardware
  from jaxkernels.ops.norms import triton

  records, payloads = [], {}
  cases = (("layer+bias", True, True), ("layer", True, False), ("rms", False, False))
  inputs = {layer: [norms._inputs(*SHAPE, jnp.bfloat16, layer, True)(seed) for seed in range(16)]
            for layer in (True, False)}
  for rep in range(2):
    for name, layer, with_bias in cases:
      base = triton.heuristic(jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16), None, None, None,
                              hardware.chip("H200"), layer=layer).__dict__
      for mode in MODES:
        if mode == "paired" and not with_bias:
          continue
        for warps in (8, 16):
          triton.FWD_VECTORS = mode
          config = triton.Config(**{**base, "num_warps": warps})

          def f(x, res, s, b, config=config, layer=layer, with_bias=with_bias):
            if layer:
              return jk.layer_norm(x, s, b if with_bias else None, residual=res,
                                   implementation="triton", config=config)
            return jk.rms_norm(x, s, residual=res, implementation="triton", config=config)

          timed = harness._Timed(f, (0, 2))
          program = timed.programs["fwd"]
          arg_sets = timed.arg_sets("fwd", inputs[layer])
          rec = {"rep": rep, "op": name, "mode": mode, "warps": warps}
          try:
            rec["us"] = harness.time_sets(program, arg_sets, rounds=15, calls=10) * 1e6
            if rep == 0:
              out = program(*arg_sets[0])
              triton.FWD_VECTORS = "late"
              ref = harness._Timed(f, (0, 2)).programs["fwd"](*arg_sets[0])
              rec["max_diff_vs_late"] = max(float(jnp.max(jnp.abs(
                  a.astype(jnp.float32) - b.astype(jnp.float32))))
                  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
              if out_pkl:
                from jax.experimental.serialize_executable import serialize
                payloads[f"{name.replace('+', '_')}_{mode}_w{warps}"] = serialize(
                    program.lower(*arg_sets[0]).compile())[0]
          except Exception as e:  # noqa: BLE001 - a variant that fails is a row
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
          records.append(rec)
          print("RECORD " + json.dumps(rec), flush=True)
  triton.FWD_VECTORS = "late"
  with open(out_json, "w") as fh:
    json.dump(records, fh, indent=1)
  if out_pkl:
    with open(out_pkl, "wb") as fh:
      pickle.dump(payloads, fh)
  for r in records:
    print(f"rep {r['rep']} {r['op']:11s} {r['mode']:10s} warps {r['warps']:2d} "
          f"{r.get('us', 0):7.1f} us {r.get('max_diff_vs_late', '')} {r.get('error', '')[:80]}")


if __name__ == "__main__":
  main(*sys.argv[1:])
