"""Does the L1/shared-memory split change the norms' speed?

ncu (bench/NOTES.md run 40b) shows every jk_ norm kernel launched with a 233 KB shared-memory
carve-out ("CachePreferShared") though each block uses 8-9 KB: L1 keeps ~23 KB, the L1 hit
rate is 0-2%, and every program rereads its float32 scale (and bias) rows from L2, 16 KB each
per row block, while L2 runs at 85-90% of its throughput. Each setting below runs in its own
process: the context's cache preference is set through the driver API (cuCtxSetCacheConfig on
JAX's primary context) before anything is compiled, then the headline norms (ours and XLA's)
are timed on the steady host clock.

  python -m bench.experiments.l1_carveout [OUT.json]
"""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

SHAPE = (16384, 4096)
# CUfunc_cache: PREFER_NONE 0, PREFER_SHARED 1, PREFER_L1 2, PREFER_EQUAL 3.
SETTINGS = {"default": None, "prefer_shared": 1, "prefer_l1": 2, "prefer_equal": 3}


def set_context_cache_config(config: int) -> None:
  """cuCtxSetCacheConfig on device 0's primary context (the one XLA uses)."""
  cuda = ctypes.CDLL("libcuda.so.1")
  dev, ctx = ctypes.c_int(), ctypes.c_void_p()
  for call, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(dev), 0)),
                     ("cuDevicePrimaryCtxRetain", (ctypes.byref(ctx), dev)),
                     ("cuCtxSetCurrent", (ctx,)), ("cuCtxSetCacheConfig", (config,))):
    status = getattr(cuda, call)(*args)
    if status:
      raise RuntimeError(f"{call} returned CUresult {status}")


def child(setting):
  import jax
  import jax.numpy as jnp

  import jaxkernels as jk
  from bench import harness, norms

  jax.devices()
  if SETTINGS[setting] is not None:
    set_context_cache_config(SETTINGS[setting])
  for layer in (False, True):
    draw = norms._inputs(*SHAPE, jnp.bfloat16, layer, True)
    sets = [draw(seed) for seed in range(16)]
    for impl in ("triton", "xla"):
      for with_bias in ((True, False) if layer else (False,)):
        def f(x, res, s, b, impl=impl, layer=layer, with_bias=with_bias):
          if layer:
            return jk.layer_norm(x, s, b if with_bias else None, residual=res,
                                 implementation=impl)
          return jk.rms_norm(x, s, residual=res, implementation=impl)

        grads = (0, 2) + ((3,) if layer and with_bias else ())
        timed = harness._Timed(f, grads)
        for label in ("fwd", "bwd", "fwd+bwd"):
          us = harness.time_sets(timed.programs[label], timed.arg_sets(label, sets), rounds=10,
                                 calls=10) * 1e6
          name = ("layer" if layer else "rms") + ("+bias" if with_bias else "")
          rec = {"setting": setting, "op": name, "impl": impl, "pass": label, "us": us}
          print("RECORD " + json.dumps(rec), flush=True)


def main(out_path=None):
  records = []
  for setting in SETTINGS:
    proc = subprocess.run([sys.executable, "-m", "bench.experiments.l1_carveout", "--child",
                           setting], capture_output=True, text=True, timeout=400,
                          env=dict(os.environ))
    records += [json.loads(ln[7:]) for ln in proc.stdout.splitlines()
                if ln.startswith("RECORD ")]
    if proc.returncode:
      print(setting, "FAILED", proc.stderr[-2000:], flush=True)
  if out_path:
    with open(out_path, "w") as fh:
      json.dump(records, fh, indent=1)
  rows = sorted({(r["op"], r["impl"], r["pass"]) for r in records})
  print(f"{'op':11s} {'impl':7s} {'pass':8s} " + " ".join(f"{s:>13s}" for s in SETTINGS))
  for op, impl, label in rows:
    us = {r["setting"]: r["us"] for r in records
          if (r["op"], r["impl"], r["pass"]) == (op, impl, label)}
    print(f"{op:11s} {impl:7s} {label:8s} " + " ".join(f"{us.get(s, 0):13.1f}" for s in SETTINGS))


if __name__ == "__main__":
  if sys.argv[1:2] == ["--child"]:
    child(sys.argv[2])
  else:
    main(*sys.argv[1:])
