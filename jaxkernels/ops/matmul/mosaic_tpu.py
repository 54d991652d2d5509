"""Pallas Mosaic TPU matmul: (block_m, block_n) output tiles, K last and "arbitrary".

Grid (M blocks, N blocks, K blocks): the two output axes are "parallel" (split
across the TensorCores of megacore chips, v4 and v5p), K is "arbitrary" and
innermost, so each output tile's float32 (int32 for int8) accumulator stays in
VMEM scratch while Pallas double-buffers the A and B blocks under the MXU work.
The epilogue runs on the last K step and writes C once.

Blocks are multiples of the MXU edge (128 on v4/v5e/v5p, 256 on v6e) and of the
dtype's sublane packing, or span a whole dimension. Edge blocks past M or N hold
whatever VMEM held; their rows and columns are never written back. A partial
last K block would add garbage into real outputs, so it is masked to zero.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxkernels import _mosaic_tpu, hardware
from jaxkernels._mosaic_tpu import sublanes
from jaxkernels._tiling import cdiv, check_fields
from jaxkernels.ops.matmul.common import INT8, Problem, epilogue, split_refs
from jaxkernels.ops.matmul.common import cost as common_cost
from jaxkernels.ops.matmul.reference import accumulator_dtype

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), INT8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  block_m: int
  block_n: int
  block_k: int
  vmem_limit_bytes: int = 64 * hardware.MiB

  def __post_init__(self):
    check_fields(self, ("block_m", "block_n", "block_k", "vmem_limit_bytes"), lambda v: v >= 1,
                 ">= 1")


def _block(size: int, target: int) -> int:
  """``target`` (a multiple of every MXU edge), or the whole dimension when that is smaller."""
  return size if size <= target else target


def heuristic(problem: Problem, chip: hardware.Chip) -> Config:
  """512 x 512 output tiles, 512-deep K steps (1024 for int8, 256 for float32): ~5 MiB of VMEM
  double-buffered, a multiple of every MXU edge, and ~170 MXU cycles per step per 128-edge MXU,
  well past the ~0.35 us step overhead."""
  item = jnp.dtype(problem.dtype).itemsize
  k_target = {1: 1024, 2: 512, 4: 256}[item]
  return Config(block_m=_block(problem.m, 512), block_n=_block(problem.n, 512),
                block_k=_block(problem.k, k_target),
                vmem_limit_bytes=min(64 * hardware.MiB, chip.onchip_bytes * 3 // 4))


def config_error(problem: Problem, config: Config, chip) -> str | None:
  del chip
  p, c = problem, config
  pack = sublanes(p.dtype, p.out_dtype)
  # (dimension, block, whether it is a lane (last) dimension of some block it appears in)
  checks = [("m", p.m, c.block_m, p.trans_a), ("n", p.n, c.block_n, True),
            ("k", p.k, c.block_k, not p.trans_a or p.trans_b)]
  for name, size, block, lane in checks:
    need = 128 if lane else pack
    if block != size and block % need:
      return (f"block_{name}={block} must be a multiple of {need} or the whole {name}={size}")
  return None


def unsupported(problem: Problem, chip: hardware.Chip) -> str | None:
  dtype = jnp.dtype(problem.dtype)
  if problem.glu:  # matmul(glu=True) runs the product, then glu
    return "the mosaic_tpu matmul does not fuse glu into its epilogue"
  if problem.block_k:
    return ("block scales along K are applied in the main loop of mosaic_gpu's kernel (Hopper); "
            "the mosaic_tpu matmul scales in its epilogue only")
  if dtype not in DTYPES:
    return f"mosaic_tpu takes bfloat16, float32 or int8 operands, got {dtype}"
  if jnp.dtype(problem.out_dtype) == jnp.float16:
    return "mosaic_tpu does not write float16 (TPUs have no float16 arithmetic)"
  return None


def _kernel(*refs, problem: Problem, config: Config, k_steps: int):
  p, c = problem, config
  *refs, acc_ref = refs  # the scratch comes after the outputs
  a_ref, b_ref, bias_ref, res_ref, as_ref, bs_ref, y_ref, z_ref = split_refs(p, refs)
  step = pl.program_id(2)

  @pl.when(step == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  a, b = a_ref[...], b_ref[...]
  if p.k % c.block_k:
    left = p.k - step * c.block_k  # >= block_k except on the last step
    a = jnp.where(lax.broadcasted_iota(jnp.int32, a.shape, 0 if p.trans_a else 1) < left, a, 0)
    b = jnp.where(lax.broadcasted_iota(jnp.int32, b.shape, 1 if p.trans_b else 0) < left, b, 0)
  dims = (((0 if p.trans_a else 1,), (1 if p.trans_b else 0,)), ((), ()))
  acc_ref[...] += lax.dot_general(a, b, dims, precision=p.precision,
                                  preferred_element_type=acc_ref.dtype)

  @pl.when(step == k_steps - 1)
  def _():
    f32 = lambda ref: ref[...].astype(jnp.float32)
    y, z = epilogue(acc_ref[...].astype(jnp.float32), problem=p,
                    bias=f32(bias_ref) if p.has_bias else None,
                    residual=f32(res_ref) if p.has_residual else None,
                    a_scale=f32(as_ref) if p.has_scales else None,
                    b_scale=f32(bs_ref) if p.has_scales else None)
    y_ref[...] = y.astype(y_ref.dtype)
    if z_ref is not None:
      z_ref[...] = z.astype(z_ref.dtype)


def matmul(a, b, *, bias=None, residual=None, a_scale=None, b_scale=None, problem: Problem,
           config: Config, interpret=False):
  p, c = problem, config
  grid = (cdiv(p.m, c.block_m), cdiv(p.n, c.block_n), cdiv(p.k, c.block_k))
  a_spec = (pl.BlockSpec((c.block_k, c.block_m), lambda i, j, k: (k, i)) if p.trans_a else
            pl.BlockSpec((c.block_m, c.block_k), lambda i, j, k: (i, k)))
  b_spec = (pl.BlockSpec((c.block_n, c.block_k), lambda i, j, k: (j, k)) if p.trans_b else
            pl.BlockSpec((c.block_k, c.block_n), lambda i, j, k: (k, j)))
  tile = pl.BlockSpec((c.block_m, c.block_n), lambda i, j, k: (i, j))
  row = pl.BlockSpec((1, c.block_n), lambda i, j, k: (0, j))
  column = pl.BlockSpec((c.block_m, 1), lambda i, j, k: (i, 0))
  operands, specs = [a, b], [a_spec, b_spec]
  if p.has_bias:
    operands.append(bias.reshape(1, p.n))
    specs.append(row)
  if p.has_residual:
    operands.append(residual)
    specs.append(tile)
  if p.has_scales:
    operands += [a_scale.reshape(p.m, 1), b_scale.reshape(1, p.n)]
    specs += [column, row]
  cost = common_cost(p, bias, residual, a_scale, b_scale)
  out = pl.pallas_call(
      functools.partial(_kernel, problem=p, config=c, k_steps=grid[2]),
      out_shape=[jax.ShapeDtypeStruct((p.m, p.n), p.out_dtype)] * p.outputs,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=0, grid=grid, in_specs=specs, out_specs=[tile] * p.outputs,
          scratch_shapes=[pltpu.VMEM((c.block_m, c.block_n), accumulator_dtype(p.dtype))]),
      compiler_params=_mosaic_tpu.params(("parallel", "parallel", "arbitrary"), c.vmem_limit_bytes,
                                 interpret),
      cost_estimate=cost.estimate(),
      interpret=interpret,
      name="jk_matmul",
  )(*operands)
  return tuple(out) if p.save_preactivation else out[0]
