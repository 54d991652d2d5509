"""Recomputation by name: the checkpoint names that the ops and the model tag, and remat
policies that keep or drop them.

A policy decides, under ``jax.checkpoint`` (``nnx.remat``), which of a function's
intermediates its backward pass reads from memory and which it recomputes. The ops tag what
is worth keeping (flash attention's output and log-sum-exp, whose recomputation is a whole
forward kernel); the model tags its projections, norms and residual stream. Policies:

- ``none``: keep everything (no recomputation; the most memory).
- ``full``: keep nothing but the function's inputs (recompute the whole forward).
- ``dots``: keep every matmul's output (JAX's ``dots_saveable``, and ``jaxkernels.matmul``'s
  output, named ``matmul_out``; ``glu=True`` on its fused kernel: its y and the [gate | up]
  product its backward reads, so that neither reruns the product).
- ``dots_no_batch``: keep the matmuls without batch dimensions (the projections, not
  attention's batched products; ``jaxkernels.matmul`` has none).
- ``attention``: keep attention's output and log-sum-exp only.
- ``minimal``: keep the residual stream and attention's output and log-sum-exp: a layer's
  backward recomputes its norms, projections and MLP, never its attention forward.
- ``offload``: ``minimal``'s tensors (the residual stream, attention's output and
  log-sum-exp) kept in host memory instead of the device's: moved to pinned host memory as the
  forward makes them, brought back for the backward; the rest recomputed. Its transfers cross
  the host link (PCIe on a GPU), so it offloads the fewest bytes that spare the attention
  forward; offloading every named tensor moved ~9 GiB each way a step at 1b and ran 4x slower
  than ``none`` on an H100 (notes/model.md model-3).

And ``auto`` (:func:`auto`): per layer, the policy of :data:`LADDER` that recomputes least while
the compiled program's peak memory fits a budget (bytes, or :func:`device_budget`).

flash_attention names its output and log-sum-exp where a kernel computes it; on the XLA path
(``implementation="xla"``) the reference's own autodiff runs and names nothing.

Example::

    block = jax.checkpoint(block, policy=jaxkernels.remat.policy("minimal"))
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
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
MATMUL_OUT = "matmul_out"  # jaxkernels.matmul's output (a kernel's, where XLA sees no dot)

NAMES = (ATTENTION_OUT, ATTENTION_LSE, QUERY, KEY, VALUE, MLP_HIDDEN, NORM_OUT, RESIDUAL,
         MATMUL_OUT)

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
    return cp.save_from_both_policies(cp.dots_saveable, cp.save_only_these_names(MATMUL_OUT))
  if name == "dots_no_batch":
    return cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable,
                                      cp.save_only_these_names(MATMUL_OUT))
  if name == "attention":
    return cp.save_only_these_names(ATTENTION_OUT, ATTENTION_LSE)
  if name == "minimal":
    return cp.save_only_these_names(RESIDUAL, ATTENTION_OUT, ATTENTION_LSE)
  if name == "offload":
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[RESIDUAL, ATTENTION_OUT, ATTENTION_LSE],
        offload_src="device", offload_dst="pinned_host")
  raise ValueError(f"policy: name={name!r} is not a remat policy; accepted: "
                   f"{', '.join(POLICIES)}")


# --------------------------------------------------------------------------- #
# policy="auto": per layer, the least recomputation that fits a memory budget
# --------------------------------------------------------------------------- #

# From the most saved (the least recomputed) to the least saved. ``attention`` rather than
# ``minimal`` on the third rung: both recompute the same matmuls and keep attention, minimal
# also keeps the stream that one add recomputes, so it held more and ran no faster (1b on an
# H100: 17.3 GiB against 15.8, 119.8 ms against 117.0; compiled for TPUs 11.3-11.6 GiB against
# 10.0-10.5; notes/model.md model-3).
LADDER = ("none", "dots", "attention", "full")


@dataclasses.dataclass(frozen=True)
class AutoChoice:
  """What :func:`auto` chose: one policy per layer, the compiled program's peak bytes under
  it, the budget, and every plan it compiled on the way, as (policies, bytes)."""

  policies: tuple[str, ...]
  peak_bytes: int
  budget: int
  tried: tuple[tuple[tuple[str, ...], int], ...]

  def __str__(self) -> str:
    counts = {name: self.policies.count(name) for name in dict.fromkeys(self.policies)}
    layers = ", ".join(f"{n} x {name}" for name, n in counts.items())
    return (f"remat auto: {layers}; {self.peak_bytes / 2**30:.2f} GiB compiled against a "
            f"budget of {self.budget / 2**30:.2f} GiB ({len(self.tried)} programs compiled)")


def auto(peak_bytes: Callable[[tuple[str, ...]], int], layers: int, budget: int, *,
         ladder: Sequence[str] = LADDER, uniform: bool = False) -> AutoChoice:
  """Per layer, the policy that recomputes least while the whole program fits ``budget``.

  ``peak_bytes(policies)`` compiles the program with ``policies[i]`` on layer ``i`` and returns
  its memory analysis's peak (:func:`compiled_peak_bytes`). Every layer starts on the
  ladder's top rung; while the program does not fit, layers step down one rung, as many at a
  time as the bytes one layer frees (from the two uniform programs' difference) say are
  needed, and the program is compiled again. ``uniform``: every layer the same policy (a
  scanned stack of layers has one body).

  Raises:
    ValueError: not even every layer on the ladder's last rung fits ``budget``.
  """
  for name in ladder:
    if name not in POLICIES:
      raise ValueError(f"auto: ladder has {name!r}, not a remat policy; accepted: "
                       f"{', '.join(POLICIES)}")
  tried: dict[tuple[str, ...], int] = {}

  def peak(level):
    plan = tuple(ladder[rung] for rung in level)
    if plan not in tried:
      tried[plan] = int(peak_bytes(plan))
    return tried[plan]

  level = [0] * layers
  here, rung = peak(level), 0
  while here > budget:
    if rung == len(ladder) - 1:
      raise ValueError(
          f"remat auto: even with every layer on {ladder[-1]!r} the program needs "
          f"{here / 2**30:.2f} GiB, over the budget of {budget / 2**30:.2f} GiB: a smaller "
          "batch, or more devices")
    on_rung = [i for i, r in enumerate(level) if r == rung]
    if not on_rung:
      rung += 1
      continue
    moving = len(on_rung)
    if not uniform:
      freed = (peak([rung] * layers) - peak([rung + 1] * layers)) / layers
      if freed > 0:
        moving = min(moving, max(1, math.ceil((here - budget) / freed)))
    for i in on_rung[:moving]:
      level[i] = rung + 1
    here = peak(level)
  return AutoChoice(tuple(ladder[r] for r in level), here, budget, tuple(tried.items()))


def compiled_peak_bytes(compiled) -> int:
  """The peak bytes a compiled program needs (``jax.stages.Compiled.memory_analysis``): its
  arguments, outputs and temporaries, less the outputs that reuse donated arguments."""
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)


def device_budget(device=None, fraction: float = 0.95) -> int:
  """``fraction`` of what the device's allocator may hold ("fit this batch on this device");
  for a host CPU device, which reports no limit, of the machine's physical memory."""
  device = device or jax.devices()[0]
  stats = device.memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"] * fraction)
  if device.platform == "cpu" and hasattr(os, "sysconf"):
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * fraction)
  raise ValueError(f"remat auto: {device.device_kind} reports no memory limit; give the "
                   "budget in bytes")
