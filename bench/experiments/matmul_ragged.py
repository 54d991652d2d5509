"""Where does an 8193^3 product's time go? (matmul, Mosaic GPU, H200)

The wrapper pads A and B (TMA needs 16-byte row strides; 8193 bf16 rows have 16386 bytes),
runs the aligned kernel on 65 x 33 = 2145 CTA tiles where 8192^3 has 2048, and slices C.
This times, round-robin on the steady clock (bench/harness.time_rounds), each piece alone:

  xla 8193             XLA's a @ b
  ours 8193            jk.matmul, everything included (C cut by crop.crop)
  ours 8193 xla slice  the same with C cut by XLA's slice (mosaic_gpu.CROP = "xla")
  pads                 the two jnp.pad copies the wrapper makes
  kernel padded        the kernel on operands already padded as the wrapper pads them
  slice xla / triton   C's padded rows and columns cut off, by XLA's slice or by crop.crop
  kernel 8192x8192xK   the kernel with 8192 rows and columns over the padded K: no extra wave
  ours 8192            jk.matmul at 8192^3

so that ours 8193 ~ pads + kernel padded + slice, and kernel padded - kernel 8192x8192xK is
the extra wave. At the power cap the memory-bound copies let the kernel run at a higher clock,
so the parts need not add up (they did not: bench/NOTES.md, matmul-30/31). The 4x bar at
8193^3 is XLA's time / 4, 1.6-1.73 ms.

Runs matmul-30/31 took the wrapper's padding before f705fcc, which padded A, B and C to whole
CTA tiles (8320 x 8448 for C); it now pads rows to 8200 and columns to 8256.

  python -m bench.experiments.matmul_ragged [OUT.json]
"""
from __future__ import annotations

import json
import random
import statistics
import sys

S = 8193
ROUNDS = 12
CALLS = 5
N_SETS = 3
# crop.crop's tile and warps, beside the shipped 16 x 512 on 4 warps.
CROP_VARIANTS = ((8, 1024, 4), (32, 256, 4), (16, 512, 8), (64, 256, 8), (4, 2048, 4))


def main(out_path=None):
  import jax
  import jax.numpy as jnp

  import jaxkernels as jk
  from bench import harness
  from jaxkernels import hardware, tuning
  from jaxkernels.ops.matmul import crop, mosaic_gpu
  from jaxkernels.ops.matmul.common import Problem, pad_to

  bf16 = jnp.dtype(jnp.bfloat16)
  chip = hardware.chip_for(jax.devices()[0].device_kind)
  problem = Problem(m=S, n=S, k=S, dtype=bf16, out_dtype=bf16)
  config = tuning.config_for("mosaic_gpu", problem, chip)
  # The wrapper's padding (mosaic_gpu.padded_shapes): A's rows and K, B's columns, with B's
  # rows padded as far as A's K so that the kernel on pre-padded operands runs unpadded.
  (m_pad, k_pad), (_, n_pad), _ = mosaic_gpu.padded_shapes(problem, config)
  print(f"config {config}\npadded: m {m_pad} n {n_pad} k {k_pad}", flush=True)

  def kernel(m, n, k):
    p = Problem(m=m, n=n, k=k, dtype=bf16, out_dtype=bf16)
    return lambda a, b: mosaic_gpu.matmul(a, b, problem=p, config=config)

  def draw(seed, m, k, n):
    ka, kb = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(ka, (m, k), bf16), jax.random.normal(kb, (k, n), bf16))

  raw = [draw(i, S, S, S) for i in range(N_SETS)]
  padded = [(pad_to(a, (m_pad, k_pad)), pad_to(b, (k_pad, n_pad))) for a, b in raw]
  out_padded = [(jnp.zeros((m_pad, n_pad), bf16),) for _ in range(N_SETS)]
  aligned_rows = [(a[:8192], b[:, :8192]) for a, b in padded]
  square = [draw(i, 8192, 8192, 8192) for i in range(N_SETS)]
  def ours(how):
    def run(a, b):
      was, mosaic_gpu.CROP = mosaic_gpu.CROP, how
      try:
        return jk.matmul(a, b, implementation="mosaic_gpu")
      finally:
        mosaic_gpu.CROP = was
    return run

  def crop_with(rows, cols, warps):
    def run(y):
      was = crop.BLOCK_ROWS, crop.BLOCK_COLS, crop.NUM_WARPS
      crop.BLOCK_ROWS, crop.BLOCK_COLS, crop.NUM_WARPS = rows, cols, warps
      try:
        return crop.crop(y, S, S)
      finally:
        crop.BLOCK_ROWS, crop.BLOCK_COLS, crop.NUM_WARPS = was
    return run

  cases = {
      "xla 8193": (lambda a, b: a @ b, raw),
      "ours 8193": (ours("triton"), raw),
      "ours 8193 xla slice": (ours("xla"), raw),
      "pads": (lambda a, b: (pad_to(a, (m_pad, k_pad)), pad_to(b, (k_pad, n_pad))), raw),
      "kernel padded": (kernel(m_pad, n_pad, k_pad), padded),
      "slice xla": (lambda y: y[:S, :S], out_padded),
      "slice triton": (lambda y: crop.crop(y, S, S), out_padded),
      **{f"slice triton {r}x{c} {w} warps": (crop_with(r, c, w), out_padded)
         for r, c, w in CROP_VARIANTS},
      f"kernel 8192x8192x{k_pad}": (kernel(8192, 8192, k_pad), aligned_rows),
      "ours 8192": (lambda a, b: jk.matmul(a, b, implementation="mosaic_gpu"), square),
  }
  want = jax.jit(lambda a, b: jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                                      precision="highest"))(*raw[0])
  for name in ("ours 8193", "ours 8193 xla slice", "xla 8193"):
    err = harness.relative_error(jax.jit(cases[name][0])(*raw[0]), want)
    print(f"{name}: error {err:.1e}", flush=True)
    assert err < 8e-3, name
  err = harness.relative_error(jax.jit(cases["kernel padded"][0])(*padded[0])[:S, :S], want)
  print(f"kernel padded: error {err:.1e}", flush=True)
  assert err < 8e-3

  timers = {}
  for name, (fn, sets) in cases.items():
    batched = tuning.over_sets(fn)
    harness.block(batched(sets))

    def run(n, batched=batched, sets=sets):
      for _ in range(n):
        out = batched(sets)
      return out

    timers[name] = run
  samples = {name: [] for name in timers}
  order = random.Random(0)
  for _ in range(ROUNDS):
    for name in order.sample(list(timers), len(timers)):
      steady, _ = harness.time_rounds(timers[name], rounds=1, calls=CALLS, warmup=0)
      samples[name].append(steady / N_SETS)
  ms = {name: statistics.median(t) * 1e3 for name, t in samples.items()}
  records = [{"case": name, "ms": ms[name], "spread_ms": [min(t) * 1e3, max(t) * 1e3]}
             for name, t in samples.items()]
  if out_path:
    with open(out_path, "w") as f:
      json.dump({"config": str(config), "padded": [m_pad, n_pad, k_pad], "rounds": ROUNDS,
                 "calls": CALLS, "sets": N_SETS, "records": records}, f, indent=1)
  print(f"{'case':28s} {'ms':>8s} {'xla/this':>9s}")
  for r in records:
    print(f"{r['case']:28s} {r['ms']:8.4f} {ms['xla 8193'] / r['ms']:9.2f}")
  for how in ("xla", "triton"):
    parts = ms["pads"] + ms["kernel padded"] + ms[f"slice {how}"]
    print(f"pads + kernel padded + slice {how} = {parts:.4f} ms")
  print(f"4x XLA needs {ms['xla 8193'] / 4:.4f} ms")


if __name__ == "__main__":
  main(*sys.argv[1:])
