"""softmax over the last axis, forward and forward+backward, at a model width and a vocabulary."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxkernels as jk
from bench import harness, shapes
from jaxkernels import roofline
from jaxkernels.ops.softmax import reference, triton
from jaxkernels.ops.softmax.api import Problem


def _jax_pallas_example():
  try:
    from jax.experimental.pallas.ops.gpu import softmax as example
  except ImportError:
    return {}
  return {"jax_pallas_triton": lambda x: example.softmax(x, axis=-1)}


def cases(session):
  cols = (shapes.SMOKE_ROWS if session.smoke else shapes.HEADLINE_ROWS)[1]
  out = []
  for r, c in shapes.softmax_rows(session.smoke):
    def draw(seed, r=r, c=c):
      k = jax.random.split(jax.random.key(seed), 2)
      return (3 * jax.random.normal(k[0], (r, c), jnp.bfloat16),), \
          jax.random.normal(k[1], (r, c), jnp.bfloat16)

    (x,), _ = draw(0)
    config = triton.heuristic(Problem.of(x, -1), None)
    out.append(harness.Case(
        suite="softmax", name="softmax " + ("one-pass" if config.block_cols >= c else
                                            "online" if c % 8 == 0 else "online, odd width"),
        inputs=draw,
        op=lambda impl, cfg: (lambda x: jk.softmax(x, implementation=impl, config=cfg)),
        reference=lambda cd: (lambda x: reference.softmax(x, compute_dtype=cd)),
        fwd_cost=roofline.softmax_fwd(x), bwd_cost=roofline.softmax_bwd(x), grads=(0,),
        dtype=jnp.bfloat16, reduction=c,
        sweep={"fwd": [triton.Config(**{**config.__dict__, "block_rows": rr, "num_warps": w})
                       for rr, w in ((1, 4), (4, 8))]} if config.block_cols >= c else {},
        anchors=_jax_pallas_example() if c == cols else {},
        # Both GPU kernels side by side where both take the rows (Mosaic GPU's hold whole rows
        # in shared memory: not a vocabulary's).
        registered="softmax" if config.block_cols >= c else None))
  return out


def run(session: harness.Session, sweep: bool = False) -> None:
  for case in cases(session):
    harness.run_case(session, case, sweep=sweep)
