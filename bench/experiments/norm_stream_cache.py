"""TEMPORARY (runs 44-45): the norms with their streamed tiles (x, residual; h, dy, dh) loaded
with ``.cg`` (cached in L2 only) so that L1 keeps the float32 scale and bias rows each program
rereads, and the backward with its scale reloaded every row block (8 registers fewer: layer_norm
at 16 warps then fits two programs an SM). Run 44 found the per-block reload 8-12 us slower,
from L2. A/B twice.

  python -m bench.experiments.norm_stream_cache OUT.json
"""
from __future__ import annotations

import json
import sys

SHAPE = (16384, 4096)
# (op, passes, num_warps field, warps, scale per block)
# Run 46: the layer forward's bias past L1 too (scale 16 KB fits the ~23 KB L1 alone, not with
# the bias), whole forward+backward of both norms as the bench runs them.
VARIANTS = (
    ("layer", ("fwd", "fwd+bwd"), "num_warps", 8, False),
    ("rms", ("fwd", "fwd+bwd"), "num_warps", 16, False),
)
CACHES = ((None, None), (".cg", None), (".cg", ".cg"))


def main(out_json):
  import jax
  import jax.numpy as jnp

  import jaxkernels as jk
  from bench import harness, norms
  from jaxkernels import hardware
  from jaxkernels.ops.norms import triton

  # jax 0.11's Pallas Triton accepts ".cg" but looks it up in a table keyed by str() of the
  # enum, which does not match: register the spelling it checks for.
  from jax._src.pallas.triton import lowering
  print("cache modifiers:", list(lowering._STR_TO_CACHE_MODIFIER), flush=True)
  lowering._STR_TO_CACHE_MODIFIER.setdefault(".cg", lowering.tt_dialect.CacheModifier.CG)
  inputs = {layer: [norms._inputs(*SHAPE, jnp.bfloat16, layer, True)(seed) for seed in range(16)]
            for layer in (True, False)}
  records = []
  for rep in range(2):
    for name, passes, field, warps, per_block in VARIANTS:
      layer = name == "layer"
      base = triton.heuristic(jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16), None, None, None,
                              hardware.chip("H200"), layer=layer).__dict__
      for cache, bias_cache in CACHES:
        if bias_cache and not layer:
          continue
        triton.STREAM_CACHE, triton.BWD_SCALE_PER_BLOCK = cache, per_block
        triton.BIAS_CACHE = bias_cache
        config = triton.Config(**{**base, field: warps})

        def f(x, res, s, b, config=config, layer=layer):
          if layer:
            return jk.layer_norm(x, s, b, residual=res, implementation="triton", config=config)
          return jk.rms_norm(x, s, residual=res, implementation="triton", config=config)

        timed = harness._Timed(f, (0, 2) + ((3,) if layer else ()))
        rec = {"rep": rep, "op": name, "warps": warps, "per_block": per_block,
               "cache": (cache or "default") + ("/bias" + bias_cache if bias_cache else "")}
        for label in passes:
          rec[label] = harness.time_sets(timed.programs[label],
                                         timed.arg_sets(label, inputs[layer]), rounds=15,
                                         calls=10) * 1e6
        records.append(rec)
        print("RECORD " + json.dumps(rec), flush=True)
  triton.STREAM_CACHE, triton.BWD_SCALE_PER_BLOCK = None, False
  with open(out_json, "w") as fh:
    json.dump(records, fh, indent=1)
  for r in records:
    times = " ".join(f"{k} {r[k]:7.1f}" for k in ("fwd", "bwd", "fwd+bwd") if k in r)
    print(f"rep {r['rep']} {r['op']:5s} w{r['warps']:2d} per_block {r['per_block']!s:5s} "
          f"{r['cache']:12s} {times}")


if __name__ == "__main__":
  main(*sys.argv[1:])
