"""bias_activation and glu, forward and forward+backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxkernels as jk
from bench import harness, shapes
from jaxkernels import _activations, roofline
from jaxkernels.ops.elementwise import reference, triton
from jaxkernels.ops.elementwise.api import Problem


def _sweep(rows, cols, op, activation):
  x = jax.ShapeDtypeStruct((rows, cols), jnp.bfloat16)
  base = triton.heuristic(Problem.of(op, activation, x=x), harness.hardware.chip("H200"))
  fields = dict(base.__dict__)
  return {
      "fwd": [triton.Config(**{**fields, "block_rows": r, "block_cols": c, "num_warps": w})
              for r, c, w in ((1, 4096, 4), (2, 4096, 8), (8, 1024, 8), (4, 1024, 4),
                              (16, 1024, 8), (4, 2048, 8))],
      "fwd+bwd": [triton.Config(**{**fields, "bwd_block_rows": r, "bwd_num_warps": w,
                                   "bwd_programs": p})
                  for r, w, p in ((2, 8, 264), (2, 16, 264), (4, 16, 264), (4, 8, 264))],
  }


def _bias_case(rows, cols, activation, name, sweep=True):
  dtype = jnp.bfloat16

  def draw(seed):
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (rows, cols), dtype)
    b = 0.1 * jax.random.normal(k[1], (cols,), jnp.float32)
    return (x, b), jax.random.normal(k[2], (rows, cols), dtype)

  (x, b), _ = draw(0)
  return harness.Case(
      suite="elementwise", name=name, inputs=draw,
      op=lambda impl, config, a=activation: (
          lambda x, b: jk.bias_activation(x, b, activation=a, implementation=impl,
                                          config=config)),
      reference=lambda cd, a=activation: (
          lambda x, b: reference.bias_activation(x, b, activation=a, compute_dtype=cd)),
      fwd_cost=roofline.bias_activation_fwd(x, b, activation),
      bwd_cost=roofline.bias_activation_bwd(x, b, activation),
      grads=(0, 1), dtype=dtype, reduction=rows, pointwise_rtol=_activations.RTOL,
      sweep=_sweep(rows, cols, "bias_activation", activation) if sweep else {},
      registered="bias_activation")


def _glu_case(rows, cols, activation, name, sweep=True):
  dtype = jnp.bfloat16

  def draw(seed):
    k = jax.random.split(jax.random.key(seed), 3)
    g, u, dy = (jax.random.normal(key, (rows, cols), dtype) for key in k)
    return (g, u), dy

  (g, u), _ = draw(0)
  return harness.Case(
      suite="elementwise", name=name, inputs=draw,
      op=lambda impl, config, a=activation: (
          lambda g, u: jk.glu(g, u, activation=a, implementation=impl, config=config)),
      reference=lambda cd, a=activation: (
          lambda g, u: reference.glu(g, u, activation=a, compute_dtype=cd)),
      fwd_cost=roofline.glu_fwd(g, u, activation), bwd_cost=roofline.glu_bwd(g, u, activation),
      grads=(0, 1), dtype=dtype, reduction=rows, pointwise_rtol=_activations.RTOL,
      sweep=_sweep(rows, cols, "glu", activation) if sweep else {}, registered="glu")


def cases(session):
  rows, cols = shapes.SMOKE_ROWS if session.smoke else shapes.HEADLINE_ROWS
  out = [_bias_case(rows, cols, activation, f"bias+{activation}")
         for activation in ("gelu", "gelu_tanh", "silu")]
  out += [_glu_case(rows, cols, activation, f"glu {activation}", sweep=activation == "silu")
          for activation in ("silu", "gelu")]
  if not session.smoke:  # an MLP's width whose rows Mosaic GPU walks in narrow chunks
    rows, cols = shapes.MLP_ROWS
    out += [_bias_case(rows, cols, "silu", f"bias+silu {cols}", sweep=False),
            _glu_case(rows, cols, "silu", f"glu silu {cols}", sweep=False)]
  return out


def run(session: harness.Session, sweep: bool = False) -> None:
  for case in cases(session):
    harness.run_case(session, case, sweep=sweep)
