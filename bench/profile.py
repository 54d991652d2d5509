"""python -m bench.profile: run each headline norm kernel a few times, for `ncu` to profile.

Example (on the GPU machine). Without XLA_PYTHON_CLIENT_PREALLOCATE=false, JAX holds most of
the GPU's memory and ncu saves and restores all of it for every replay pass (500 s for 14
kernels, bench/NOTES.md run 3b); profile few kernels:
  XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --kernel-name regex:jk_rms \\
      --launch-skip 4 --launch-count 2 --section SpeedOfLight --section Occupancy \\
      --section LaunchStats --section WarpStateStats python -m bench.profile
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import jaxkernels as jk
from bench import ceilings, shapes
from jaxkernels.ops.norms import triton as norms_triton


def main():
  rows, cols = shapes.HEADLINE_ROWS
  keys = jax.random.split(jax.random.key(0), 4)
  x, r, dy, dh = (jax.random.normal(k, (rows, cols), jnp.bfloat16) for k in keys)
  s = jnp.ones((cols,), jnp.float32)
  b = jnp.zeros((cols,), jnp.float32)
  config = norms_triton.Config(block_rows=2, block_cols=cols, num_warps=8, bwd_block_rows=1,
                               bwd_num_warps=8, bwd_programs=264)
  stream = jax.jit(functools.partial(ceilings.stream, block_rows=2, num_warps=8))
  rms = jax.jit(lambda x, r, s, dy, dh: jax.vjp(
      lambda x, r: jk.rms_norm(x, s, residual=r, config=config), x, r)[1]((dy, dh)))
  ln = jax.jit(lambda x, s, b: jk.layer_norm(x, s, b, config=config))
  for _ in range(5):  # jk_stream x5, jk_rms_norm_fwd/bwd x5, jk_layer_norm_fwd x5
    jax.block_until_ready(stream([x, r]))
  for _ in range(5):
    jax.block_until_ready(rms(x, r, s, dy, dh))
  for _ in range(5):
    jax.block_until_ready(ln(x, s, b))


if __name__ == "__main__":
  main()
