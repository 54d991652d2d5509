"""Pallas Triton matmul (CUDA GPUs, sm80+; fp8 on sm89+).

One program computes a ``block_m x block_n`` tile of C: it walks K in
``block_k`` steps, loading an A and a B block per step (Triton pipelines the
loads ``num_stages`` deep and issues wgmma on Hopper, mma on Ampere) into a
float32 accumulator, then applies the epilogue in registers and writes C once.

Programs run in grouped order: ``group_m`` row blocks share each column block,
so the B blocks a group reads stay in L2 while the group's A blocks are reused
across its columns. Rows and columns past the array's edge wrap around
(index mod m) so that every load is in bounds and unmasked; their results are
dropped at the masked store. Only the K tail needs a masked (zero-filled) step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkernels import _triton, hardware
from jaxkernels._triton import pltriton
from jaxkernels._tiling import cdiv, check_fields, is_pow2, next_pow2, pad_to, round_up
from jaxkernels.ops.matmul.common import FLOAT8, FLOATS, Problem, epilogue, split_refs
from jaxkernels.ops.matmul.common import cost as common_cost


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  block_m: int
  block_n: int
  block_k: int
  group_m: int = 8
  num_warps: int = 8
  num_stages: int = 3

  def __post_init__(self):
    check_fields(self, ("block_m", "block_n", "block_k", "num_warps"), is_pow2,
                 "a power of two (Triton tiles are)")
    check_fields(self, ("block_m", "block_n", "block_k"), lambda v: v >= 16,
                 ">= 16 (the tensor cores' smallest tile)")
    check_fields(self, ("group_m", "num_stages"), lambda v: v >= 1, ">= 1")


def heuristic(problem: Problem, chip: hardware.Chip) -> Config:
  """A config by rule; ``jaxkernels.tuning`` times candidates and may pick better.

  Hopper, bf16, large shapes: 128 x 256 x 64 on 8 warps, 3 stages (~160 KiB of
  shared memory), the shape CUTLASS favours. Blocks shrink to the problem.
  """
  itemsize = jnp.dtype(problem.dtype).itemsize
  block_k = {1: 128, 2: 64, 4: 32}[itemsize]
  block_m = max(16, min(128, next_pow2(problem.m)))
  block_n = max(16, min(256 if itemsize <= 2 else 128, next_pow2(problem.n)))
  block_k = max(16, min(block_k, next_pow2(problem.k)))
  big = block_m * block_n >= 128 * 128
  return Config(block_m=block_m, block_n=block_n, block_k=block_k, group_m=8,
                num_warps=8 if big else 4, num_stages=3 if chip.onchip_bytes >= 200 * 1024 else 2)


def unsupported(problem: Problem, chip: hardware.Chip) -> str | None:
  dtype = jnp.dtype(problem.dtype)
  if problem.glu:  # matmul(glu=True) runs the product, then glu
    return "the triton matmul does not fuse glu into its epilogue"
  if problem.block_k:
    return ("block scales along K are applied in the main loop of mosaic_gpu's kernel (Hopper); "
            "the triton matmul scales in its epilogue only")
  if dtype in FLOAT8:
    if chip.compute_capability is not None and chip.compute_capability < (8, 9):
      return f"fp8 tensor cores need sm89+; the device is {chip.name}"
    return None
  if dtype not in FLOATS:
    return f"triton takes bfloat16, float16, float32 or fp8 operands, got {dtype}"
  return None


def _kernel(*refs, problem: Problem, config: Config, math):
  p, c = problem, config
  a_ref, b_ref, bias_ref, res_ref, as_ref, bs_ref, y_ref, z_ref = split_refs(p, refs)

  # Grouped program order: group_m row blocks sweep each column block together.
  grid_m, grid_n = cdiv(p.m, c.block_m), cdiv(p.n, c.block_n)
  pid = pl.program_id(0)
  width = c.group_m * grid_n
  first_m = (pid // width) * c.group_m
  size_m = jnp.minimum(grid_m - first_m, c.group_m)
  pid_m = first_m + (pid % width) % size_m
  pid_n = (pid % width) // size_m

  rows = pid_m * c.block_m + jnp.arange(c.block_m)
  cols = pid_n * c.block_n + jnp.arange(c.block_n)
  wrapped_rows = rows % p.m if p.m % c.block_m else rows
  wrapped_cols = cols % p.n if p.n % c.block_n else cols
  precision = (p.precision or lax.Precision.DEFAULT,) * 2
  dims = (((0 if p.trans_a else 1,), (1 if p.trans_b else 0,)), ((), ()))

  def step(k0, acc, masked):
    ks = k0 + jnp.arange(c.block_k)
    k_ok = ks < p.k if masked else None
    if p.trans_a:
      a = _load(a_ref, ks[:, None], wrapped_rows[None, :], None if k_ok is None else k_ok[:, None])
    else:
      a = _load(a_ref, wrapped_rows[:, None], ks[None, :], None if k_ok is None else k_ok[None, :])
    if p.trans_b:
      b = _load(b_ref, wrapped_cols[:, None], ks[None, :], None if k_ok is None else k_ok[None, :])
    else:
      b = _load(b_ref, ks[:, None], wrapped_cols[None, :], None if k_ok is None else k_ok[:, None])
    return acc + lax.dot_general(a, b, dims, precision=precision,
                                 preferred_element_type=jnp.float32)

  acc = jnp.zeros((c.block_m, c.block_n), jnp.float32)
  full_steps = p.k // c.block_k
  acc = lax.fori_loop(0, full_steps, lambda i, acc: step(i * c.block_k, acc, False), acc)
  if p.k % c.block_k:
    acc = step(full_steps * c.block_k, acc, True)

  f32 = lambda ref, idx: pltriton.load(ref.at[idx]).astype(jnp.float32)
  y, z = epilogue(
      acc, problem=p, math=math,
      bias=f32(bias_ref, wrapped_cols)[None, :] if p.has_bias else None,
      residual=(f32(res_ref, (wrapped_rows[:, None], wrapped_cols[None, :]))
                if p.has_residual else None),
      a_scale=f32(as_ref, wrapped_rows)[:, None] if p.has_scales else None,
      b_scale=f32(bs_ref, wrapped_cols)[None, :] if p.has_scales else None)

  mask = None
  if p.m % c.block_m:
    mask = (rows < p.m)[:, None]
  if p.n % c.block_n:
    col_ok = (cols < p.n)[None, :]
    mask = col_ok if mask is None else mask & col_ok
  index = (rows[:, None], cols[None, :])
  pltriton.store(y_ref.at[index], y.astype(y_ref.dtype), mask=mask)
  if z_ref is not None:
    pltriton.store(z_ref.at[index], z.astype(z_ref.dtype), mask=mask)


def _load(ref, i, j, mask):
  if mask is None:
    return pltriton.load(ref.at[i, j])
  return pltriton.load(ref.at[i, j], mask=mask, other=0)


def matmul(a, b, *, bias=None, residual=None, a_scale=None, b_scale=None, problem: Problem,
           config: Config, interpret=False):
  """y (and z if problem.save_preactivation) for 2-D a, b stored as problem says."""
  p = problem
  if jnp.dtype(p.dtype) in FLOAT8:
    # fp8 tensor cores read both operands K-major, so B goes in as (N, K); and Triton cannot
    # fill a masked fp8 load with zeros, so K is zero-padded to whole blocks instead.
    if not p.trans_b:
      b, p = b.T, dataclasses.replace(p, trans_b=True)
    k_pad = round_up(p.k, config.block_k)
    if k_pad != p.k:
      a = pad_to(a, (k_pad, a.shape[1]) if p.trans_a else (a.shape[0], k_pad))
      b = pad_to(b, (b.shape[0], k_pad))
      p = dataclasses.replace(p, k=k_pad)
  # Rows padded to 16 bytes give 16-byte aligned strides: vector loads instead of scalar ones
  # (8193^3 bf16 ran at 46 TFLOP/s unpadded, notes/matmul.md). The kernel still reads only the
  # logical [0, m) x [0, k) and [0, k) x [0, n).
  a, b = _aligned_rows(a), _aligned_rows(b)
  residual = None if residual is None else _aligned_rows(residual)
  n_out = round_up(p.n, 16 // jnp.dtype(p.out_dtype).itemsize)
  operands = [a, b] + [x for x in (bias, residual) if x is not None]
  if p.has_scales:
    operands += [a_scale, b_scale]
  out = jax.ShapeDtypeStruct((p.m, n_out), p.out_dtype)
  cost = common_cost(p, bias, residual, a_scale, b_scale)
  result = pl.pallas_call(
      functools.partial(_kernel, problem=p, config=config,
                        math=_triton.math(interpret)),
      out_shape=[out] * p.outputs,
      grid=(cdiv(p.m, config.block_m) * cdiv(p.n, config.block_n),),
      compiler_params=_triton.params(config.num_warps, config.num_stages),
      cost_estimate=cost.estimate(),
      interpret=interpret,
      name=f"jk_matmul_{config.block_m}x{config.block_n}x{config.block_k}",
  )(*operands)
  result = [r[:, :p.n] if n_out != p.n else r for r in result]
  return tuple(result) if p.save_preactivation else result[0]


def _aligned_rows(x):
  return pad_to(x, (x.shape[0], round_up(x.shape[1], 16 // jnp.dtype(x.dtype).itemsize)))


def config_error(problem: Problem, config: Config, chip: hardware.Chip) -> str | None:
  """Why ``config`` cannot run ``problem`` on ``chip`` (shared memory), or None."""
  item = jnp.dtype(problem.dtype).itemsize
  ring = config.num_stages * (config.block_m + config.block_n) * config.block_k * item
  if ring > chip.onchip_bytes:
    return (f"{config.num_stages} stages of {config.block_m}x{config.block_k} and "
            f"{config.block_k}x{config.block_n} blocks need {ring} bytes of shared memory; "
            f"{chip.name} has {chip.onchip_bytes}")
  return None
