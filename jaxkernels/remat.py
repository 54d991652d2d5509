"""Recomputation by name: the checkpoint names that the ops and the model tag, and remat
policies that keep or drop them.

A policy decides, under ``jax.checkpoint`` (``nnx.remat``), which of a function's
intermediates its backward pass reads from memory and which it recomputes. The ops tag what
is worth keeping (flash attention's output and log-sum-exp, whose recomputation is a whole
forward kernel); the model tags its projections, norms and residual stream. Policies:

- ``none``: keep everything (no recomputation; the most memory).
- ``full``: keep nothing but the function's inputs (recompute the whole forward).
- ``dots``: keep every matmul's output (JAX's ``dots_saveable``).
- ``dots_no_batch``: keep the matmuls without batch dimensions (the projections, not
  attention's batched products).
- ``attention``: keep attention's output and log-sum-exp only.
- ``minimal``: keep the residual stream and attention's output and log-sum-exp: a layer's
  backward recomputes its norms, projections and MLP, never its attention forward.
- ``offload``: keep every named tensor in host memory instead of the device's (saved on the
  device, moved to pinned host memory, brought back for the backward).

flash_attention names its output and log-sum-exp where a kernel computes it; on the XLA path
(``implementation="xla"``) the reference's own autodiff runs and names nothing.

Example::

    block = jax.checkpoint(block, policy=jaxkernels.remat.policy("minimal"))
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.ad_checkpoint import checkpoint_name

ATTENTION_OUT = "attention_out"  # flash_attention's output, (B, T, N, H)
ATTENTION_LSE = "attention_lse"  # its log-sum-exp, (B, T, N) float32
QUERY = "q_proj"  # the attention projections' outputs
KEY = "k_proj"
VALUE = "v_proj"
MLP_HIDDEN = "mlp_hidden"  # the gated MLP's hidden activations
NORM_OUT = "norm_out"  # a normalization's output
RESIDUAL = "residual"  # the residual stream between blocks

NAMES = (ATTENTION_OUT, ATTENTION_LSE, QUERY, KEY, VALUE, MLP_HIDDEN, NORM_OUT, RESIDUAL)

POLICIES = ("none", "full", "dots", "dots_no_batch", "attention", "minimal", "offload")


def tag(x, name: str):
  """``x`` under checkpoint name ``name`` (one of :data:`NAMES`), for the policies to find."""
  if name not in NAMES:
    raise ValueError(f"tag: name={name!r} is not a checkpoint name; accepted: {', '.join(NAMES)}")
  return checkpoint_name(x, name)


def policy(name: str) -> Callable[..., Any]:
  """The ``jax.checkpoint`` policy called ``name`` (one of :data:`POLICIES`)."""
  cp = jax.checkpoint_policies
  if name == "none":
    return cp.everything_saveable
  if name == "full":
    return cp.nothing_saveable
  if name == "dots":
    return cp.dots_saveable
  if name == "dots_no_batch":
    return cp.dots_with_no_batch_dims_saveable
  if name == "attention":
    return cp.save_only_these_names(ATTENTION_OUT, ATTENTION_LSE)
  if name == "minimal":
    return cp.save_only_these_names(RESIDUAL, ATTENTION_OUT, ATTENTION_LSE)
  if name == "offload":
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(NAMES),
        offload_src="device", offload_dst="pinned_host")
  raise ValueError(f"policy: name={name!r} is not a remat policy; accepted: "
                   f"{', '.join(POLICIES)}")
