"""Wide-row softmax (vocabularies): which Triton config streams fastest?

Run 26: 1024 x 65536 bf16 forward+backward at 2300 GB/s (54% of copy) with the heuristic's
online path (2 rows x 4096-column chunks, 8 warps). The forward reads each row twice, the
backward reads y and dy twice; at 4 programs an SM x 2 rows x 128 KiB the rows in flight
(135 MB) outgrow the 50 MB L2, so the second read comes from HBM. Run 29 (this script, first
version): one row a program and wider chunks gained at most 10%; one pass in registers spilled
at 65536 and at 32768 fit one program an SM. Now the online kernels keep per-lane statistics
(no cross-warp reduction in the loop) over ``unroll`` chunks a step: which sizes? Run 30:
32 warps (one program an SM, few rows in flight) and 32768 columns a step were best, ~2850 GB/s
both ways at 65536; a program's loads still stop while it computes. Then: with the next step's
loads issued before a step's math (prefetch)? (bench/NOTES.md runs 29-30.) Run 38: the same
configs at 50257 once rows were read from 16-byte boundaries.

  [SOFTMAX_WIDE_COLS=50257,...] python -m bench.experiments.softmax_wide [OUT.json [OUT.pkl]]
"""
from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from bench.experiments import dump_ptx
from jaxkernels import roofline
from jaxkernels.ops.softmax import reference, triton

import jaxkernels as jk

SHAPES = tuple(s for s in ((1024, 65536), (2048, 32768), (1024, 50257))
               if str(s[1]) in os.environ.get("SOFTMAX_WIDE_COLS", str(s[1])).split(","))
N_SETS = 12


def _configs(cols):
  base = triton.heuristic(jax.ShapeDtypeStruct((1024, cols), jnp.bfloat16), None)
  out = {"heuristic": base}
  for bc, w, u, pf in ((8192, 32, 4, False), (4096, 32, 4, False), (4096, 32, 4, True),
                       (4096, 32, 2, True), (4096, 16, 4, True), (8192, 16, 2, True),
                       (2048, 32, 4, True)):
    out[f"1x{bc} w{w} u{u}{' pf' if pf else ''}"] = triton.Config(
        block_rows=1, block_cols=bc, num_warps=w, bwd_block_rows=1, bwd_num_warps=w, unroll=u,
        bwd_unroll=u, prefetch=pf)
  return out


def main(out_path=None, sass_path=None):
  records, executables = [], {}
  for rows, cols in SHAPES:
    keys = jax.random.split(jax.random.key(cols), N_SETS)
    xs = [3 * jax.random.normal(k, (rows, cols), jnp.bfloat16) for k in keys]
    dys = [jax.random.normal(jax.random.fold_in(k, 1), (rows, cols), jnp.bfloat16) for k in keys]
    ys = [jk.softmax(x, implementation="xla") for x in xs]
    x32 = xs[0].astype(jnp.float32)
    y_ref = reference.softmax(x32)
    _, vjp = jax.vjp(reference.softmax, x32)
    dx_ref = vjp(dys[0].astype(jnp.float32))[0]
    fwd_cost, bwd_cost = roofline.softmax_fwd(xs[0]), roofline.softmax_bwd(xs[0])
    for name, cfg in _configs(cols).items():
      fwd = lambda x, cfg=cfg: triton.forward(x, config=cfg)
      bwd = lambda y, dy, cfg=cfg: triton.backward(y, dy, config=cfg)
      for label, fn, sets, cost, ref in (
          ("fwd", fwd, [(x,) for x in xs], fwd_cost, y_ref),
          ("bwd", bwd, list(zip(ys, dys)), bwd_cost, dx_ref)):
        rec = dict(shape=f"{rows}x{cols}", config=name, label=label)
        try:
          out = jax.jit(fn)(*sets[0]).astype(jnp.float32)
          rec["error"] = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
          seconds = harness.time_sets(fn, sets, rounds=15, calls=10)
          kernel, _ = harness.kernel_seconds(fn, sets)
          rec.update(ms=seconds * 1e3, gbps=cost.bytes / seconds / 1e9,
                     kernel_gbps=kernel and cost.bytes / kernel / 1e9)
          if sass_path:
            executables[f"{cols}_{name}_{label}".replace(" ", "_")] = jax.jit(fn).lower(
                *sets[0]).compile()
        except Exception as e:  # noqa: BLE001 - a config that fails is a row
          rec["failed"] = f"{type(e).__name__}: {e}"[:200]
        records.append(rec)
        print(json.dumps(rec), flush=True)
  if out_path:
    with open(out_path, "w") as f:
      json.dump(records, f, indent=1)
  if sass_path:
    dump_ptx.save(executables, sass_path)
  print(f"\n{'shape':12s} {'config':16s} {'pass':4s} {'host GB/s':>9s} {'kernel GB/s':>11s} error")
  for r in records:
    print(f"{r['shape']:12s} {r['config']:16s} {r['label']:4s} {r.get('gbps', np.nan):9.0f} "
          f"{(r.get('kernel_gbps') or np.nan):11.0f} {r.get('error', r.get('failed'))}")


if __name__ == "__main__":
  main(*sys.argv[1:])
