"""Residual+RMSNorm backward variants at (16384, 4096) bf16, timed round-robin against XLA's
own 3->1 elementwise pass over the same arrays (h + dy + dh -> dx: the backward's memory
traffic with no reductions) (bench/NOTES.md runs 16, 20).

Variants (triton.BWD_VARIANT): the shipped kernel; dh kept in bfloat16 through the row
reduction; h, dy and dh all kept in bfloat16 through it and n, g rebuilt after it (fewer
registers: does a third program fit an SM, 396 programs?).
"""
import json
import os
import random
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from jaxkernels.ops.norms import reference, triton

M, N = (int(v) for v in os.environ.get("SHAPE", "16384,4096").split(","))
SETS = 4
ROUNDS = int(os.environ.get("ROUNDS", 15))
CALLS = int(os.environ.get("CALLS", 12))  # 48 launches a sample: dispatch and sync amortized
INTERPRET = jax.default_backend() == "cpu"  # a smoke test here: SHAPE=64,256 ROUNDS=1


def main():
  base = triton.heuristic(jax.ShapeDtypeStruct((M, N), jnp.bfloat16), None, None, None,
                          harness.hardware.chip("H200"))
  sets = []
  for i in range(SETS):
    k = jax.random.split(jax.random.key(i), 5)
    x, r, dy, dh = (jax.random.normal(k[j], (M, N), jnp.bfloat16) for j in range(4))
    s = 1 + 0.1 * jax.random.normal(k[4], (N,), jnp.float32)
    _, h, stats = triton.forward(x, s, None, r, layer=False, eps=1e-6, config=base,
                                  interpret=INTERPRET)
    sets.append(dict(x=x, r=r, s=s, dy=dy, dh=dh, h=h, rstd=stats[0]))

  def bwd(config, variant):
    def f(d):
      triton.BWD_VARIANT = variant  # read while tracing
      return triton.backward(d["h"], d["s"], None, (d["rstd"],), d["dy"], d["dh"], layer=False,
                             eps=1e-6, config=config, interpret=INTERPRET)[:3]
    return f

  def fwd(config):
    return lambda d: triton.forward(d["x"], d["s"], None, d["r"], layer=False, eps=1e-6,
                                    config=config, interpret=INTERPRET)[:2]

  def cfg(**kw):
    return triton.Config(**{**base.__dict__, **kw})

  variants = {
      "bwd shipped": (bwd(base, "shipped"), 4),
      "bwd dh raw": (bwd(base, "dh_raw"), 4),
      "bwd recompute": (bwd(base, "recompute"), 4),
      "bwd shipped 396": (bwd(cfg(bwd_programs=396), "shipped"), 4),
      "bwd dh raw 396": (bwd(cfg(bwd_programs=396), "dh_raw"), 4),
      "bwd recompute 396": (bwd(cfg(bwd_programs=396), "recompute"), 4),
      "bwd recompute 16 warps": (bwd(cfg(bwd_num_warps=16), "recompute"), 4),
      "xla 3->1 (h+dy+dh)": (lambda d: (d["h"].astype(jnp.float32) + d["dy"] + d["dh"]).astype(
          jnp.bfloat16), 4),
  }

  # Check: every backward against the reference's vjp on set 0.
  d = sets[0]
  _, vjp = jax.vjp(lambda x, r, s: reference.rms_norm(x, s, residual=r, eps=1e-6),
                   d["x"], d["r"], d["s"])
  want = vjp((d["dy"], d["dh"]))
  programs, rows = {}, {}
  for name, (fn, arrays) in variants.items():
    jitted = jax.jit(lambda sets, fn=fn: [fn(s) for s in sets])
    out = jitted(sets)[0]
    err = (harness.relative_error(out[0], want[0]) if name.startswith("bwd") else 0.0)
    rows[name] = dict(name=name, arrays=arrays, error=err, samples=[])
    programs[name] = jitted
    jax.block_until_ready(jitted(sets))

  rng = random.Random(0)
  for _ in range(ROUNDS):
    for name in rng.sample(list(programs), len(programs)):
      start = time.perf_counter()
      for _ in range(CALLS):
        out = programs[name](sets)
      jax.block_until_ready(out)
      rows[name]["samples"].append((time.perf_counter() - start) / CALLS / SETS)

  print(f"\n{'variant':42s} {'ms':>8s} {'GB/s':>6s}  error")
  for row in rows.values():
    t = float(np.median(row["samples"]))
    row["ms"], row["gbps"] = t * 1e3, row["arrays"] * M * N * 2 / t / 1e9
    print(f"{row['name']:42s} {row['ms']:8.4f} {row['gbps']:6.0f}  {row['error']:.1e}")
  json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                 commit=os.environ.get("JAXKERNELS_COMMIT", "unknown"), rows=list(rows.values())),
            open(f"{os.environ.get('OUT', '/tmp')}/norm_bwd_variants.json", "w"), indent=1)


if __name__ == "__main__":
  main()
