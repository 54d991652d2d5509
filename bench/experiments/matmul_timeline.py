"""Do the two compute warpgroups overlap? Per-warpgroup timelines of the Mosaic GPU matmul.

Every kernel marks its "mainloop" and "epilogue" regions (jax.named_scope); with
``mosaic_gpu.PROFILE`` set, Mosaic GPU's in-kernel profiler records when each warpgroup
enters and leaves them. For each schedule this prints, per tile: how long the product and the
epilogue took, and what share of each epilogue ran while the other compute warpgroup was
inside its own product (ping-pong's whole point; cooperative warpgroups run in step, so ~0).

  python -m bench.experiments.matmul_timeline [--size 4096] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import tempfile

import jax
import jax.numpy as jnp

import jaxkernels as jk
from bench.matmul import PINGPONG
from jaxkernels.ops.matmul import mosaic_gpu

BF16 = jnp.bfloat16
WARPGROUPS = 3  # two compute, one TMA


def _intervals(trace):
  """{(sm, block, wg): {name: [(start, end), ...]}} from a Mosaic GPU profile."""
  out = collections.defaultdict(lambda: collections.defaultdict(list))
  open_at = {}
  for e in trace["traceEvents"]:
    block, wg = divmod(e["tid"] - 1, WARPGROUPS)
    key = (e["pid"], block, wg, e["name"])
    if e["ph"] == "B":
      open_at[key] = e["ts"]
    else:
      out[key[:3]][e["name"]].append((open_at.pop(key), e["ts"]))
  return out


def _overlap(a, intervals):
  start, end = a
  return sum(max(0.0, min(end, e) - max(start, s)) for s, e in intervals)


def summarize(trace):
  per_wg = _intervals(trace)
  mains, epis, shares, tiles = [], [], [], collections.Counter()
  for (sm, block, wg), regions in per_wg.items():
    if wg == WARPGROUPS - 1:
      continue
    other = per_wg.get((sm, block, 1 - wg), {})
    for iv in regions.get("mainloop", []):
      mains.append(iv[1] - iv[0])
    for iv in regions.get("epilogue", []):
      epis.append(iv[1] - iv[0])
      if iv[1] > iv[0]:
        shares.append(_overlap(iv, other.get("mainloop", [])) / (iv[1] - iv[0]))
    tiles[wg] += len(regions.get("epilogue", []))
  span = [iv for regions in per_wg.values() for ivs in regions.values() for iv in ivs]
  return dict(
      tiles_per_wg=dict(tiles),
      mainloop_us=statistics.median(mains) if mains else None,
      epilogue_us=statistics.median(epis) if epis else None,
      epilogue_under_other_mainloop=statistics.mean(shares) if shares else None,
      kernel_span_us=(max(e for _, e in span) - min(s for s, _ in span)) if span else None,
  )


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--size", type=int, default=4096)
  parser.add_argument("--out", default=None)
  parser.add_argument("--activations", default=None,
                      help="comma-separated (none,relu,silu,gelu_tanh,gelu): time each one's "
                           "epilogue under the default (cooperative) config instead")
  args = parser.parse_args()
  s = args.size
  ka, kb, kc = jax.random.split(jax.random.key(0), 3)
  a = jax.random.normal(ka, (s, s), BF16) / s ** 0.25
  b = jax.random.normal(kb, (s, s), BF16) / s ** 0.25
  bias = jax.random.normal(kc, (s,), BF16)
  variants = {
      "cooperative plain": dict(config=None, gelu=False),
      "cooperative bias+gelu": dict(config=None, gelu=True),
      "pingpong plain": dict(config=PINGPONG, gelu=False),
      "pingpong bias+gelu": dict(config=PINGPONG, gelu=True),
  }
  if args.activations:
    variants = {f"cooperative bias+{act}": dict(config=None, gelu=act != "none", act=act)
                for act in args.activations.split(",")}
  rows = {}
  for name, v in variants.items():
    with tempfile.TemporaryDirectory() as tmp:
      mosaic_gpu.PROFILE.update(profile_space=64, profile_dir=tmp)
      try:
        fn = jax.jit(lambda a, b, bias, v=v: jk.matmul(
            a, b, bias=bias if v["gelu"] else None,
            activation=v.get("act", "gelu") if v["gelu"] else None,
            implementation="mosaic_gpu", config=v["config"]))
        for _ in range(3):  # the last call's trace: a warm card and caches
          jax.block_until_ready(fn(a, b, bias))
        jax.effects_barrier()
        path = sorted(glob.glob(os.path.join(tmp, "*.json")), key=os.path.getmtime)[-1]
        with open(path) as f:
          trace = json.load(f)
      finally:
        mosaic_gpu.PROFILE.clear()
    rows[name] = summarize(trace)
    print(name, json.dumps(rows[name]), flush=True)
    if args.out:
      with open(os.path.join(args.out, f"timeline_{name.replace(' ', '_')}.json"), "w") as f:
        json.dump(trace, f)
  print(f"\n{s}^3  {'variant':<24} {'tiles/wg':>12} {'product us':>10} {'epilogue us':>11} "
        f"{'epi under other':>15} {'span us':>8}")
  for name, r in rows.items():
    print(f"{'':6}{name:<24} {str(r['tiles_per_wg']):>12} {r['mainloop_us'] or 0:10.2f} "
          f"{r['epilogue_us'] or 0:11.2f} {r['epilogue_under_other_mainloop'] or 0:15.2f} "
          f"{r['kernel_span_us'] or 0:8.1f}")
  if args.out:
    with open(os.path.join(args.out, "matmul_timeline.json"), "w") as f:
      json.dump(dict(size=s, device=jax.devices()[0].device_kind, jax=jax.__version__,
                     commit=os.environ.get("JAXKERNELS_COMMIT"), rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
