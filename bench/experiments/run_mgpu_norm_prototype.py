"""Times the Mosaic GPU rms_norm+residual forward prototype against XLA, our Triton kernel and an
XLA 2->2 copy (bench/NOTES.md, run 12). Kept as the record of a measured, rejected design."""
import functools
import json
import os

import jax
import jax.numpy as jnp
from jax import lax

import jaxkernels as jk
from bench import harness
from bench.experiments import mgpu_norm_prototype as E

M, N = 16384, 4096
SETS = 6


def xla(x, r, s):
  h = x.astype(jnp.float32) + r.astype(jnp.float32)
  y = h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * s
  return y.astype(x.dtype), h.astype(r.dtype)


def main():
  keys = jax.random.split(jax.random.key(0), 3 * SETS)
  arg_sets = [(jax.random.normal(keys[3 * i], (M, N), jnp.bfloat16),
               jax.random.normal(keys[3 * i + 1], (M, N), jnp.bfloat16),
               jax.random.normal(keys[3 * i + 2], (N,), jnp.float32)) for i in range(SETS)]
  nbytes = 4 * M * N * 2
  variants = {"xla": xla,
              "triton": lambda x, r, s: jk.rms_norm(x, s, residual=r, implementation="triton"),
              "xla_copy2": lambda x, r, s: (x + 0, r + 0)}
  if os.environ.get("STREAMS_ONLY"):  # run 15: which ring streams at the copy's rate?
    # (rows a step, slots, CTAs): 1 CTA an SM up to ~200 KiB of slots, 2 CTAs an SM up to ~100.
    for rows, steps, ncta in ((4, 3, 132), (2, 4, 132), (2, 6, 132), (1, 8, 132),
                              (1, 12, 132), (1, 4, 264), (1, 6, 264), (2, 3, 264)):
      variants[f"mgpu-stream rows{rows} s{steps} c{ncta}"] = functools.partial(
          E.fwd, steps=steps, ncta=ncta, math=False, block_rows=rows)
  else:
    for steps in (2, 3):
      for ncta in (128, 132):
        for nobar in (False, True):
          variants[f"mgpu s{steps} c{ncta} nobar{int(nobar)}"] = functools.partial(
              E.fwd, steps=steps, ncta=ncta, nobar=nobar)
      variants[f"mgpu-stream s{steps} c128"] = functools.partial(E.fwd, steps=steps, ncta=128,
                                                                 math=False)
  ref = jax.jit(xla)(*arg_sets[0])
  rows = []
  for name, fn in variants.items():
    try:
      out = jax.jit(fn)(*arg_sets[0])
      want = tuple(arg_sets[0][:2]) if ("stream" in name or "copy" in name) else ref
      err = harness.relative_error(out, want)  # a stream must return its inputs exactly
      t = harness.time_sets(fn, arg_sets, rounds=15, calls=5)
      rows.append((name, t * 1e3, nbytes / t / 1e9, err))
    except Exception as e:  # noqa: BLE001
      rows.append((name, float("nan"), float("nan"), repr(e)[:300]))
    print(rows[-1], flush=True)
  json.dump(rows, open(f"{os.environ.get('OUT', '/tmp')}/exp.json", "w"), indent=1, default=str)


if __name__ == "__main__":
  main()
