"""Work and traffic per op: the ``pl.CostEstimate`` each kernel passes, and rooflines.

Bytes are the fewest an op must move through device memory: each input read
once, each output written once. Benchmarks divide these by measured time, so a
kernel that moves more than it must shows up as lower bandwidth. FLOPs are the
arithmetic of the math as written (XLA uses them to schedule around the kernel;
for these memory-bound ops they never set the bound).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxkernels import hardware


def nbytes(*arrays: Any) -> int:
  """Total bytes of arrays or ShapeDtypeStructs; None entries count as nothing."""
  return sum(math.prod(a.shape) * a.dtype.itemsize for a in arrays if a is not None)


@dataclasses.dataclass(frozen=True)
class Cost:
  flops: float
  bytes: float
  transcendentals: float = 0.0

  def __add__(self, other: Cost) -> Cost:
    return Cost(
        self.flops + other.flops,
        self.bytes + other.bytes,
        self.transcendentals + other.transcendentals,
    )

  def estimate(self) -> pl.CostEstimate:
    return pl.CostEstimate(
        flops=int(self.flops),
        transcendentals=int(self.transcendentals),
        bytes_accessed=int(self.bytes),
    )

  def bound_seconds(self, chip: hardware.Chip, dtype: str = "bfloat16") -> float:
    """The roofline floor: the larger of compute time and memory time."""
    compute = self.flops / chip.flops(dtype) if dtype in chip.peak_flops else 0.0
    return max(compute, self.bytes / chip.copy_bandwidth)

  def percent_of_roofline(
      self, seconds: float, chip: hardware.Chip, dtype: str = "bfloat16"
  ) -> float:
    return 100.0 * self.bound_seconds(chip, dtype) / seconds


def _f32_vector(n: int) -> int:
  return 4 * n


# Per-element FLOPs of each activation and its derivative (polynomial erf: ~20).
ACTIVATION_FLOPS = {"gelu": 24, "gelu_tanh": 12, "silu": 5, "relu": 1}
ACTIVATION_TRANSCENDENTALS = {"gelu": 1, "gelu_tanh": 1, "silu": 1, "relu": 0}


def norm_fwd(x, scale, bias=None, residual=None, *, layer: bool, stats: int = 0) -> Cost:
  """rms_norm/layer_norm forward: reads x (+residual), writes y (+h), ``stats`` f32 per row."""
  rows = math.prod(x.shape[:-1])
  n = x.size
  flops = n * ((8 if layer else 5) + (1 if residual is not None else 0))
  written = nbytes(x) + (nbytes(residual) if residual is not None else 0) + stats * _f32_vector(rows)
  read = nbytes(x, residual, scale, bias)
  return Cost(flops, read + written, rows)


def norm_bwd(x, scale, bias=None, residual=None, *, layer: bool, stats: int = 0) -> Cost:
  """Backward: reads h, dy (+dh), scale, stats; writes dx (+dresidual if its dtype differs), dscale (+dbias)."""
  rows = math.prod(x.shape[:-1])
  n = x.size
  h = residual if residual is not None else x
  read = nbytes(h, x, scale) + (nbytes(residual) if residual is not None else 0)
  read += stats * _f32_vector(rows)
  written = nbytes(x, scale, bias)
  if residual is not None and residual.dtype != x.dtype:
    written += nbytes(residual)
  return Cost(n * (12 if layer else 9), read + written, 0)


def softmax_fwd(x) -> Cost:
  return Cost(4 * x.size, 2 * nbytes(x), x.size)


def softmax_bwd(x) -> Cost:
  return Cost(4 * x.size, 3 * nbytes(x), 0)


def cross_entropy_fwd(logits) -> Cost:
  """Softmax cross-entropy's loss and log-sum-exp: one read of the logits."""
  return Cost(5 * logits.size, nbytes(logits), logits.size)


def cross_entropy_bwd(logits, dlogits_dtype) -> Cost:
  """Its gradient: the logits read, the gradient written."""
  return Cost(6 * logits.size, nbytes(logits) + logits.size * jnp.dtype(dlogits_dtype).itemsize,
              logits.size)


def bias_activation_fwd(x, bias, activation: str) -> Cost:
  return Cost(
      x.size * (1 + ACTIVATION_FLOPS[activation]),
      2 * nbytes(x) + nbytes(bias),
      x.size * ACTIVATION_TRANSCENDENTALS[activation],
  )


def bias_activation_bwd(x, bias, activation: str) -> Cost:
  return Cost(
      x.size * (2 + 2 * ACTIVATION_FLOPS[activation]),
      3 * nbytes(x) + 2 * nbytes(bias),
      x.size * ACTIVATION_TRANSCENDENTALS[activation],
  )


def glu_fwd(gate, up, activation: str) -> Cost:
  return Cost(
      gate.size * (1 + ACTIVATION_FLOPS[activation]),
      nbytes(gate, up) + nbytes(gate),
      gate.size * ACTIVATION_TRANSCENDENTALS[activation],
  )


def glu_bwd(gate, up, activation: str) -> Cost:
  return Cost(
      gate.size * (3 + 2 * ACTIVATION_FLOPS[activation]),
      2 * nbytes(gate, up) + nbytes(gate),
      gate.size * ACTIVATION_TRANSCENDENTALS[activation],
  )


def matmul(m: int, n: int, k: int, *, in_itemsize: int, out_itemsize: int, epilogue_reads: int = 0,
           activation: str | None = None, extra_outputs: int = 0) -> Cost:
  """C (M, N) = A (M, K) @ B (K, N) with an epilogue reading ``epilogue_reads`` bytes.

  ``extra_outputs`` counts further (M, N) outputs of out_itemsize (the saved pre-activation).
  """
  flops = 2 * m * n * k + m * n * (2 + ACTIVATION_FLOPS.get(activation, 0))
  moved = (m * k + k * n) * in_itemsize + (1 + extra_outputs) * m * n * out_itemsize
  return Cost(flops, moved + epilogue_reads,
              m * n * ACTIVATION_TRANSCENDENTALS.get(activation, 0))


def attention_flops(batch: int, q_len: int, kv_len: int, heads: int, head_dim: int, *,
                    causal: bool = False, backward: bool = False) -> float:
  """The FLOPs of softmax attention's two products (q k^T and p v, 2 FLOPs a multiply-add):
  4 B N T S H forward; the backward's five products make fwd+bwd 3.5x that (the flash
  backward recomputes p: q k^T again, then dv, dp, dq, dk); a causal mask halves it (the
  blocks past the diagonal are skipped)."""
  flops = 4.0 * batch * heads * q_len * kv_len * head_dim
  flops *= 3.5 if backward else 1.0
  return flops / 2 if causal else flops


def attention_block_visits(q_len: int, kv_len: int, block_q: int, block_k: int, *,
                           causal: bool = False) -> int:
  """(query block, key block) pairs a flash kernel visits for one (batch, head): all of them,
  or under a causal mask (query i sees keys j <= i) those with a visible key."""
  visits = 0
  for i in range(-(-q_len // block_q)):
    last = min((i + 1) * block_q, q_len) - 1
    visits += -(-min(last + 1, kv_len) // block_k) if causal else -(-kv_len // block_k)
  return visits


def attention_traffic(batch: int, q_len: int, kv_len: int, heads: int, kv_heads: int,
                      head_dim: int, *, visits: int, block_q: int, block_k: int,
                      itemsize: int = 2, shared_kv: bool = False) -> dict[str, float]:
  """Bytes each flash-attention kernel moves with (block_q, block_k) blocks, ``visits`` the
  (query block, key block) pairs visited for one (batch, head): the forward reads q, writes o
  and the float32 log-sum-exp once, and reads a key block's k and v at every visit; dk/dv
  reads q, dout and the two float32 statistics at every visit, k and v in and dk, dv out
  once; dq reads k and v at every visit, q and dout in and dq out once. One model for every
  flash kernel: ours states it to Mosaic's compiler (pl.CostEstimate), and the bench predicts
  JAX's example's TPU time by it too, with the example's blocks. ``shared_kv``: a step takes
  every head, so a key block is read once for its GQA group, not once per query head (our
  in-place Mosaic TPU kernels)."""
  pairs = batch * heads * visits
  rows = batch * heads * q_len
  kv = batch * kv_heads * kv_len * head_dim * itemsize
  kv_pairs = batch * kv_heads * visits if shared_kv else pairs
  kv_block_reads = kv_pairs * block_k * head_dim * itemsize * 2
  q_block_reads = pairs * block_q * (2 * head_dim * itemsize + 8)
  return dict(fwd=2 * rows * head_dim * itemsize + kv_block_reads + 4 * rows,
              dkdv=q_block_reads + 2 * kv * 2,
              dq=kv_block_reads + 3 * rows * head_dim * itemsize)

