"""TEMPORARY (run 36): the layer_norm+residual forward with scale and bias loaded as
(block_rows, block_cols) tiles in place of row vectors, with and without a bias, A/B twice.

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
  draw = norms._inputs(*SHAPE, jnp.bfloat16, True, True)
  sets = [draw(seed) for seed in range(16)]
  records, payloads = [], {}
  for rep in range(2):
    for two_d in (False, True):
      for with_bias in (True, False):
        for warps in (8, 16):
          triton.SCALE_2D = two_d
          config = triton.Config(**{**base, "num_warps": warps})

          def f(x, res, s, b, config=config, with_bias=with_bias):
            return jk.layer_norm(x, s, b if with_bias else None, residual=res,
                                 implementation="triton", config=config)

          timed = harness._Timed(f, (0, 2))
          program = timed.programs["fwd"]
          arg_sets = timed.arg_sets("fwd", sets)
          rec = {"rep": rep, "two_d": two_d, "bias": with_bias, "warps": warps,
                 "us": harness.time_sets(program, arg_sets, rounds=15, calls=10) * 1e6}
          if rep == 0 and out_pkl:
            from jax.experimental.serialize_executable import serialize
            payloads[f"layer_fwd_2d{int(two_d)}_bias{int(with_bias)}_w{warps}"] = serialize(
                program.lower(*arg_sets[0]).compile())[0]
          records.append(rec)
          print("RECORD " + json.dumps(rec), flush=True)
  with open(out_json, "w") as fh:
    json.dump(records, fh, indent=1)
  if out_pkl:
    with open(out_pkl, "wb") as fh:
      pickle.dump(payloads, fh)
  for r in records:
    print(f"rep {r['rep']} 2d {r['two_d']!s:5s} bias {r['bias']!s:5s} warps {r['warps']:2d} "
          f"{r['us']:7.1f} us")


if __name__ == "__main__":
  main(*sys.argv[1:])
