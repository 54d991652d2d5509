"""python -m bench.profile: run each headline norm kernel a few times, for `ncu` to profile.

Runs, at (16384, 4096) bf16 with the shipped heuristics, two forwards each of: rms_norm+residual,
layer_norm+residual with a bias, and without one, in that order, then one forward+backward of
each norm with residual. Example (on the GPU machine). Without
XLA_PYTHON_CLIENT_PREALLOCATE=false, JAX holds most of the GPU's memory and ncu saves and
restores all of it for every replay pass (500 s for 14 kernels, notes/rows.md run 3b):
  XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --kernel-name regex:jk_ \\
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
      --section Occupancy --section LaunchStats python -m bench.profile
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxkernels as jk
from bench import shapes


def main():
  rows, cols = shapes.HEADLINE_ROWS
  keys = jax.random.split(jax.random.key(0), 6)
  x, r, dy, dh = (jax.random.normal(k, (rows, cols), jnp.bfloat16) for k in keys[:4])
  s = 1 + 0.1 * jax.random.normal(keys[4], (cols,), jnp.float32)
  b = 0.1 * jax.random.normal(keys[5], (cols,), jnp.float32)
  forwards = {
      "rms": lambda x, r: jk.rms_norm(x, s, residual=r, implementation="triton"),
      "layer+bias": lambda x, r: jk.layer_norm(x, s, b, residual=r, implementation="triton"),
      "layer": lambda x, r: jk.layer_norm(x, s, None, residual=r, implementation="triton"),
  }
  for fn in forwards.values():
    fn = jax.jit(fn)
    for _ in range(2):
      jax.block_until_ready(fn(x, r))
  for name in ("rms", "layer+bias"):
    fwd_bwd = jax.jit(lambda x, r, f=forwards[name]: jax.vjp(f, x, r)[1]((dy, dh)))
    jax.block_until_ready(fwd_bwd(x, r))


if __name__ == "__main__":
  main()
