"""rms_norm / layer_norm, with and without the fused residual, forward and forward+backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxkernels as jk
from bench import harness, shapes
from jaxkernels import roofline
from jaxkernels.ops.norms import reference, triton
from jaxkernels.ops.norms.api import Problem

VARIANTS = (  # (name, layer norm?, fused residual?)
    ("rms_norm+residual", False, True),
    ("rms_norm", False, False),
    ("layer_norm+residual", True, True),
    ("layer_norm", True, False),
)


def _inputs(rows, cols, dtype, layer, residual):
  def draw(seed):
    k = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(k[0], (rows, cols), dtype)
    r = jax.random.normal(k[1], (rows, cols), dtype) if residual else None
    s = 1 + 0.1 * jax.random.normal(k[2], (cols,), jnp.float32)
    b = 0.1 * jax.random.normal(k[3], (cols,), jnp.float32) if layer else None
    dy = jax.random.normal(k[4], (rows, cols), dtype)
    dh = jax.random.normal(k[5], (rows, cols), dtype)
    return (x, r, s, b), ((dy, dh) if residual else dy)
  return draw


def _sweep(rows, cols):
  problem = Problem(x=jax.ShapeDtypeStruct((rows, cols), jnp.bfloat16),
                    scale=jax.ShapeDtypeStruct((cols,), jnp.float32), bias=None, residual=None,
                    layer=False)
  base = triton.heuristic(problem, harness.hardware.chip("H200"))
  fields = dict(base.__dict__)
  return {
      "fwd": [triton.Config(**{**fields, "block_rows": r, "num_warps": w})
              for r, w in ((1, 4), (2, 4), (4, 8))],
      "fwd+bwd": [triton.Config(**{**fields, "bwd_block_rows": r, "bwd_num_warps": w,
                                   "bwd_programs": p})
                  for r, w, p in ((1, 4, 264), (1, 8, 528), (2, 8, 264))],
  }


def _jax_pallas_example(layer):
  """JAX's own Pallas Triton norm (jax.experimental.pallas.ops.gpu), forward, if importable."""
  try:
    if layer:
      from jax.experimental.pallas.ops.gpu import layer_norm as example
      fn = example.layer_norm
    else:
      from jax.experimental.pallas.ops.gpu import rms_norm as example
      fn = example.rms_norm
  except ImportError:
    return {}
  return {"jax_pallas_triton": lambda x, r, s, b: fn(x[None], s, jnp.zeros_like(s) if b is None
                                                      else b)[0]}


def cases(session):
  rows, cols = shapes.SMOKE_ROWS if session.smoke else shapes.HEADLINE_ROWS
  dtype = jnp.bfloat16
  out = []
  for name, layer, residual in VARIANTS:
    def op(impl, config, layer=layer):
      def f(x, r, s, b):
        if layer:
          return jk.layer_norm(x, s, b, residual=r, implementation=impl, config=config)
        return jk.rms_norm(x, s, residual=r, implementation=impl, config=config)
      return f

    def ref(compute_dtype, layer=layer):
      def f(x, r, s, b):
        if layer:
          return reference.layer_norm(x, s, b, eps=1e-6, residual=r, compute_dtype=compute_dtype)
        return reference.rms_norm(x, s, eps=1e-6, residual=r, compute_dtype=compute_dtype)
      return f

    (x, r, s, b), _ = _inputs(rows, cols, dtype, layer, residual)(0)
    out.append(harness.Case(
        suite="norms", name=name, inputs=_inputs(rows, cols, dtype, layer, residual), op=op,
        reference=ref, fwd_cost=roofline.norm_fwd(x, s, b, r, layer=layer),
        bwd_cost=roofline.norm_bwd(x, s, b, r, layer=layer),
        grads=(0, 2) + ((3,) if layer else ()), dtype=dtype, reduction=max(rows, cols),
        sweep=_sweep(rows, cols) if residual else {},
        registered="layer_norm" if layer else "rms_norm",
        anchors={} if residual else _jax_pallas_example(layer)))
  return out


def run(session: harness.Session, sweep: bool = False) -> None:
  for case in cases(session):
    harness.run_case(session, case, sweep=sweep)
