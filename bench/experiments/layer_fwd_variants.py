"""TEMPORARY (runs 36-37): layer_norm+residual forward variants, A/B twice. Run 37: a
persistent forward (scale and bias loaded once a program) against one program a row block.

  python -m bench.experiments.layer_fwd_variants OUT.json [OUT.pkl]
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

  base = triton.heuristic(jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16), None, None, None,
                          hardware.chip("H200"), layer=True).__dict__
  records, payloads = [], {}
  variants = [(True, 2, 8, 0), (True, 1, 8, 528), (True, 1, 8, 512), (True, 1, 16, 264),
              (True, 1, 16, 256), (True, 1, 4, 1024), (True, 2, 16, 264),
              (False, 2, 16, 0), (False, 1, 8, 512), (False, 1, 16, 256)]
  for layer in (True, False):
    draw = norms._inputs(*SHAPE, jnp.bfloat16, layer, True)
    sets = [draw(seed) for seed in range(16)]
    for rep in range(2):
      for v_layer, rows, warps, programs in variants:
        if v_layer != layer:
          continue
        config = triton.Config(**{**base, "block_rows": rows, "num_warps": warps,
                                  "programs": programs})

        def f(x, res, s, b, config=config, layer=layer):
          if layer:
            return jk.layer_norm(x, s, b, residual=res, implementation="triton", config=config)
          return jk.rms_norm(x, s, residual=res, implementation="triton", config=config)

        timed = harness._Timed(f, (0, 2))
        program = timed.programs["fwd"]
        arg_sets = timed.arg_sets("fwd", sets)
        rec = {"rep": rep, "layer": layer, "rows": rows, "warps": warps, "programs": programs,
               "us": harness.time_sets(program, arg_sets, rounds=15, calls=10) * 1e6}
        if rep == 0 and out_pkl:
          from jax.experimental.serialize_executable import serialize
          payloads[f"{'layer' if layer else 'rms'}_fwd_r{rows}w{warps}p{programs}"] = serialize(
              program.lower(*arg_sets[0]).compile())[0]
        records.append(rec)
        print("RECORD " + json.dumps(rec), flush=True)
  with open(out_json, "w") as fh:
    json.dump(records, fh, indent=1)
  if out_pkl:
    with open(out_pkl, "wb") as fh:
      pickle.dump(payloads, fh)
  for r in records:
    print(f"rep {r['rep']} {'layer' if r['layer'] else 'rms'} rows {r['rows']} warps "
          f"{r['warps']:2d} programs {r['programs']:4d} {r['us']:7.1f} us")


if __name__ == "__main__":
  main(*sys.argv[1:])
