"""Pallas Mosaic TPU kernels for flash attention, forward and backward.

The TPU's shape of FlashAttention-2: a grid over (batch, head, query block, key block) with the
key blocks innermost ("arbitrary", the running maximum, sum and output accumulated in VMEM
scratch across them) and batch, heads and query blocks "parallel", so that megacore chips (v4,
v5p) split them between their two TensorCores. q k^T and p v run on the MXU in the input dtype
with float32 accumulation; the softmax's statistics are float32.

Blocks that the mask hides whole (``common.key_blocks``) are not computed, and their index
maps repeat the last visible block, so Pallas' pipeline fetches nothing for them. The
backward recomputes p from the saved log-sum-exp: one kernel accumulates dk and dv over the
query blocks of every head of a GQA group (k and v stay in VMEM across them), one dq over the
key blocks, and with a bias one d(bias), summed over the batch and heads the bias broadcasts
over.

These kernels read (B, N, T, H) arrays, T and S padded to whole blocks: the wrapper transposes
and pads (XLA copies; the padded keys are masked, the padded queries' rows dropped). They serve
the calls the in-place kernels (``mosaic_tpu_in_place.py``, which read (B, T, N, H) with no
transpose, every head in a step) cannot take: a bias, head counts the in-place packing does
not divide, head dims neither whole 128 lanes nor a divisor of 128, or blocks too large for
VMEM at every head; ``Config.in_place`` picks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxkernels import _mosaic_tpu, hardware
from jaxkernels._tiling import check_fields, round_up
from jaxkernels.ops.attention import mosaic_tpu_blocks as blocks
from jaxkernels.ops.attention import mosaic_tpu_in_place as in_place
from jaxkernels.ops.attention.common import MAX_HEAD_DIM, Call, Window, dot



@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  block_q: int
  block_k: int
  bwd_block_q: int
  bwd_block_k: int
  vmem_limit_bytes: int
  # (B, T, N, H) read in place, every head in a step (mosaic_tpu_in_place.py), where the call
  # allows it; else the heads-major kernels here, with the transposes around them.
  in_place: bool = False

  def __post_init__(self):
    check_fields(self, ("block_q", "bwd_block_q"), lambda v: v >= 16 and v % 16 == 0,
                 "a multiple of 16 (sublanes of packed bfloat16)")
    check_fields(self, ("block_k", "bwd_block_k"), lambda v: v >= 128 and v % 128 == 0,
                 "a multiple of 128 (lanes)")
    check_fields(self, ("vmem_limit_bytes",), lambda v: v >= 1, ">= 1")


# Query rows a forward block (and both backward blocks) takes, as splash attention's
# production blocks do (MaxText's 512): k and v are re-read once per query block, so the
# forward's traffic at T=4096 falls from ~2.2 GB (128 rows) to ~0.6 GB, under the MXU's time
# on every chip (notes/attn.md tpu-splash-1), at every head dim (tpu-splash-2).
BLOCK = 512


def heuristic(problem, chip: hardware.Chip) -> Config:
  """In place (``mosaic_tpu_in_place``) where the call allows it: the largest query blocks up
  to BLOCK rows (and key blocks up to BLOCK backward) whose every-head blocks fit the chip's
  VMEM. Else heads-major: query blocks of BLOCK rows, key blocks of the MXU's edge (128 on
  v5e, 256 on v6e) forward; backward, BLOCK x BLOCK (the dq kernel re-reads k and v per query
  block, dk/dv q and dout per key block), at every head dim up to 256, as splash attention's
  production blocks: at 256, 128-row blocks re-read k and v four times as often and left the
  kernel memory-bound (0.27-0.82x splash predicted, notes/attn.md tpu-splash-2), and 512 x
  512 fits VMEM on v5e, v5p and v6e (forward and backward compiled at T=4096)."""
  edge = chip.mxu or 128
  limit = _mosaic_tpu.vmem_limit(chip)
  cap = lambda length, block: min(block, round_up(length, 16))
  block_k = min(edge, round_up(problem.kv_len, 128))
  if in_place.reason(problem) is None:
    fits = lambda kernels, bq, bk: all(
        in_place.vmem_bytes(problem, bq, bk)[name] <= limit for name in kernels)
    fwd = next((cap(problem.q_len, bq) for bq in (BLOCK, 256, 128)
                if fits(("fwd",), cap(problem.q_len, bq), block_k)), None)
    bwd = next(((cap(problem.q_len, bq), min(bk, round_up(problem.kv_len, 128)))
                for bq, bk in ((BLOCK, BLOCK), (BLOCK, 256), (256, 256), (256, 128), (128, 128))
                if fits(("dkdv", "dq"), cap(problem.q_len, bq),
                        min(bk, round_up(problem.kv_len, 128)))), None)
    if fwd is not None and bwd is not None:
      return Config(block_q=fwd, block_k=block_k, bwd_block_q=bwd[0], bwd_block_k=bwd[1],
                    vmem_limit_bytes=limit, in_place=True)
  block_q = cap(problem.q_len, BLOCK)
  return Config(block_q=block_q, block_k=block_k, bwd_block_q=block_q,
                bwd_block_k=min(BLOCK, round_up(problem.kv_len, 128)), vmem_limit_bytes=limit)


def config_error(problem, config: Config, chip) -> str | None:
  del chip
  if not config.in_place:
    return None
  if (why := in_place.reason(problem)) is not None:
    return f"in_place=True, but {why} (in_place=False runs it)"
  for name in ("block_q", "bwd_block_q"):
    block = getattr(config, name)
    if block % 128 and block < problem.q_len:
      return (f"in_place=True takes {name} as whole 128 lanes (the statistics are rows) or "
              f"covering all {problem.q_len} queries; got {block}")
  return None


def unsupported(problem, chip) -> str | None:
  del chip
  if problem.dtype == jnp.float16:
    return "float16 is not a TPU dtype (use bfloat16 or float32)"
  if problem.head_dim > MAX_HEAD_DIM:
    return f"head dim {problem.head_dim} is over {MAX_HEAD_DIM}"
  return None



# --------------------------------------------------------------------------- #
# Layout: (B, T, N, H) <-> the kernels' padded (B, N, T, H)
# --------------------------------------------------------------------------- #


def _heads_major(a, length: int):
  a = jnp.swapaxes(a, 1, 2)
  pad = length - a.shape[2]
  return jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) if pad else a


def _bias(bias, t_pad: int, s_pad: int):
  pads = ((0, 0), (0, 0), (0, t_pad - bias.shape[2]), (0, s_pad - bias.shape[3]))
  return jnp.pad(bias, pads) if any(p for _, p in pads) else bias


# --------------------------------------------------------------------------- #
# Forward
# --------------------------------------------------------------------------- #


def _forward_kernel(*refs, call: Call, bq: int, bk: int):
  refs = list(refs)
  q_ref, k_ref, v_ref = refs[:3]
  rest = refs[3:]
  bias_ref = rest.pop(0) if call.bias_shape is not None else None
  qs_ref, ks_ref = (rest.pop(0), rest.pop(0)) if call.segments else (None, None)
  o_ref, lse_ref, m_sc, l_sc, acc_sc = rest
  i, j = pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  run, _ = blocks.visit(i, j, bq, bk, call)

  @pl.when(run)
  def _():
    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    s, _ = blocks.scores(dot(q, k, call, tb=True), _read(bias_ref), call)
    mask = blocks.mask(i, j, bq, bk, call, _read(qs_ref), _read(ks_ref))
    if mask is not None:
      s = jnp.where(mask, s, -jnp.inf)
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m_prev - safe)
    p = jnp.exp(s - safe)
    l_sc[...] = l_sc[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
    acc_sc[...] = acc_sc[...] * alpha + dot(p.astype(v.dtype), v, call)
    m_sc[...] = m_new

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    total = l_sc[...]
    seen = total > 0
    o_ref[...] = (acc_sc[...] / jnp.where(seen, total, 1.0)).astype(o_ref.dtype)
    peak = m_sc[...]
    lse_ref[...] = jnp.where(seen, jnp.where(peak == -jnp.inf, 0.0, peak) +
                             jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)


def _kv_map(call: Call, bq: int, bk: int):
  """(b, n, i, j) -> k's block: head n's kv head, the key block clamped to the visible ones."""
  def index(b, n, i, j):
    _, jj = blocks.visit(i, j, bq, bk, call)
    return b, n // call.group, jj, 0
  return index


def _bias_map(call: Call, bq: int, bk: int):
  bb, nb = call.bias_shape[:2]

  def index(b, n, i, j):
    _, jj = blocks.visit(i, j, bq, bk, call)
    return (b if bb > 1 else 0), (n if nb > 1 else 0), i, jj
  return index


def forward(q, k, v, bias, q_seg, kv_seg, *, window: Window, scale: float,
            soft_cap: float | None, config: Config, interpret=False):
  if config.in_place:
    return in_place.forward(q, k, v, q_seg, kv_seg, window=window, scale=scale,
                            soft_cap=soft_cap, config=config, interpret=interpret)
  call = Call.of(q, k, bias, q_seg, window=window, scale=scale, soft_cap=soft_cap)
  b, t, n, h = q.shape
  bq, bk = config.block_q, config.block_k
  t_pad, s_pad = round_up(t, bq), round_up(call.kv_len, bk)
  inputs = [_heads_major(q, t_pad), _heads_major(k, s_pad), _heads_major(v, s_pad)]
  kv_map = _kv_map(call, bq, bk)
  specs = [pl.BlockSpec((None, None, bq, h), lambda b, n, i, j: (b, n, i, 0)),
           pl.BlockSpec((None, None, bk, h), kv_map), pl.BlockSpec((None, None, bk, h), kv_map)]
  if bias is not None:
    inputs.append(_bias(bias, t_pad, s_pad))
    specs.append(pl.BlockSpec((None, None, bq, bk), _bias_map(call, bq, bk)))
  if q_seg is not None:
    inputs += [blocks.segments(q_seg, t_pad, -1)[:, :, None],
               blocks.segments(kv_seg, s_pad, -2)[:, None, :]]
    specs += [pl.BlockSpec((None, bq, 1), lambda b, n, i, j: (b, i, 0)),
              pl.BlockSpec((None, 1, bk), lambda b, n, i, j: (b, 0, kv_map(b, n, i, j)[2]))]
  out, lse = pl.pallas_call(
      functools.partial(_forward_kernel, call=call, bq=bq, bk=bk),
      grid=(b, n, t_pad // bq, s_pad // bk),
      in_specs=specs,
      out_specs=[pl.BlockSpec((None, None, bq, h), lambda b, n, i, j: (b, n, i, 0)),
                 pl.BlockSpec((None, None, bq, 1), lambda b, n, i, j: (b, n, i, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, n, t_pad, h), q.dtype),
                 jax.ShapeDtypeStruct((b, n, t_pad, 1), jnp.float32)],
      scratch_shapes=[_vmem((bq, 1)), _vmem((bq, 1)), _vmem((bq, h))],
      compiler_params=_mosaic_tpu.params(("parallel", "parallel", "parallel", "arbitrary"),
                                         config.vmem_limit_bytes, interpret),
      cost_estimate=blocks.costs(call, bq, bk)["fwd"],
      interpret=interpret,
      name="jk_attention_fwd",
  )(*inputs)
  return jnp.swapaxes(out[:, :, :t], 1, 2), jnp.swapaxes(lse[:, :, :t, 0], 1, 2)


def _vmem(shape):
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.VMEM(shape, jnp.float32)


# --------------------------------------------------------------------------- #
# Backward
# --------------------------------------------------------------------------- #


def _grad_block(q, k, v, do, lse, delta, bias, mask, call: Call, *, wrt_bias=False):
  """(p, ds) of one block from the saved log-sum-exp (as attention.triton._grad_scores)."""
  s, th = blocks.scores(dot(q, k, call, tb=True), bias, call)
  if mask is not None:
    s = jnp.where(mask, s, -jnp.inf)
  lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # a query that sees nothing: p = 0
  p = jnp.exp(s - lse)
  dp = dot(do, v, call, tb=True)
  ds = p * (dp - delta)
  if th is not None and not wrt_bias:
    ds = ds * (1.0 - th * th)
  return p, ds


def _unpack(refs, call: Call, n_out: int, n_scratch: int):
  refs = list(refs)
  named = dict(zip(("q", "k", "v"), refs[:3]))
  rest = refs[3:]
  named["bias"] = rest.pop(0) if call.bias_shape is not None else None
  named["qs"], named["ks"] = (rest.pop(0), rest.pop(0)) if call.segments else (None, None)
  named["do"], named["lse"], named["delta"] = rest[:3]
  rest = rest[3:]
  return named, rest[:n_out], rest[n_out:n_out + n_scratch]


def _read(ref):
  return None if ref is None else ref[...]


def _block_grads(r, i, j, bq: int, bk: int, call: Call, *, wrt_bias: bool = False):
  """(p, ds) of query block i against key block j, from the refs every backward kernel reads."""
  mask = blocks.mask(i, j, bq, bk, call, _read(r["qs"]), _read(r["ks"]))
  return _grad_block(r["q"][...], r["k"][...], r["v"][...], r["do"][...], r["lse"][...],
                     r["delta"][...], _read(r["bias"]), mask, call, wrt_bias=wrt_bias)


def _dkdv_kernel(*refs, call: Call, bq: int, bk: int, n_q: int):
  r, (dk_ref, dv_ref), (dk_sc, dv_sc) = _unpack(refs, call, 2, 2)
  j, step = pl.program_id(2), pl.program_id(3)
  i = step % n_q

  @pl.when(step == 0)
  def _():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  @pl.when(blocks.visit_queries(j, i, bq, bk, call)[0])
  def _():
    p, ds = _block_grads(r, i, j, bq, bk, call)
    q, do = r["q"][...], r["do"][...]
    dv_sc[...] += dot(p.astype(do.dtype), do, call, ta=True)
    dk_sc[...] += dot(ds.astype(q.dtype), q, call, ta=True)

  @pl.when(step == pl.num_programs(3) - 1)
  def _():
    dk_ref[...] = (dk_sc[...] * call.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _dq_kernel(*refs, call: Call, bq: int, bk: int):
  r, (dq_ref,), (dq_sc,) = _unpack(refs, call, 1, 1)
  i, j = pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  @pl.when(blocks.visit(i, j, bq, bk, call)[0])
  def _():
    _, ds = _block_grads(r, i, j, bq, bk, call)
    k = r["k"][...]
    dq_sc[...] += dot(ds.astype(k.dtype), k, call)

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    dq_ref[...] = (dq_sc[...] * call.scale).astype(dq_ref.dtype)


def _dbias_kernel(*refs, call: Call, bq: int, bk: int):
  r, (db_ref,), (db_sc,) = _unpack(refs, call, 1, 1)
  i, j, rep = pl.program_id(2), pl.program_id(3), pl.program_id(4)

  @pl.when(rep == 0)
  def _():
    db_sc[...] = jnp.zeros(db_sc.shape, jnp.float32)

  @pl.when(blocks.visit(i, j, bq, bk, call)[0])
  def _():
    db_sc[...] += _block_grads(r, i, j, bq, bk, call, wrt_bias=True)[1]

  @pl.when(rep == pl.num_programs(4) - 1)
  def _():
    db_ref[...] = db_sc[...].astype(db_ref.dtype)


def backward(q, k, v, bias, q_seg, kv_seg, out, lse, dout, dlse, *, window: Window,
             scale: float, soft_cap: float | None, config: Config, interpret=False):
  if config.in_place:
    return in_place.backward(q, k, v, q_seg, kv_seg, out, lse, dout, dlse, window=window,
                             scale=scale, soft_cap=soft_cap, config=config,
                             interpret=interpret)
  call = Call.of(q, k, bias, q_seg, window=window, scale=scale, soft_cap=soft_cap)
  b, t, n, h = q.shape
  s, kv_heads, g = call.kv_len, call.kv_heads, call.group
  bq, bk = config.bwd_block_q, config.bwd_block_k
  t_pad, s_pad = round_up(t, bq), round_up(s, bk)
  n_q, n_k = t_pad // bq, s_pad // bk
  delta = jnp.einsum("btnh,btnh->btn", dout.astype(jnp.float32), out.astype(jnp.float32))
  if dlse is not None:
    delta = delta - dlse.astype(jnp.float32)
  stats = lambda a: _heads_major(a[..., None], t_pad)  # (B, N, Tp, 1)
  arrays = dict(q=_heads_major(q, t_pad), k=_heads_major(k, s_pad), v=_heads_major(v, s_pad),
                do=_heads_major(dout, t_pad), lse=stats(lse), delta=stats(delta))
  if bias is not None:
    arrays["bias"] = _bias(bias, t_pad, s_pad)
  if q_seg is not None:
    arrays["qs"] = blocks.segments(q_seg, t_pad, -1)[:, :, None]
    arrays["ks"] = blocks.segments(kv_seg, s_pad, -2)[:, None, :]
  order = ["q", "k", "v"] + (["bias"] if bias is not None else []) + (
      ["qs", "ks"] if q_seg is not None else []) + ["do", "lse", "delta"]

  def specs(where):
    """BlockSpecs of the inputs for a grid whose index maps give (b, n, i, j) by ``where``."""
    at = lambda f: (lambda *ids: f(*where(*ids)))
    out = dict(
        q=pl.BlockSpec((None, None, bq, h), at(lambda b_, n_, i, j: (b_, n_, i, 0))),
        do=pl.BlockSpec((None, None, bq, h), at(lambda b_, n_, i, j: (b_, n_, i, 0))),
        lse=pl.BlockSpec((None, None, bq, 1), at(lambda b_, n_, i, j: (b_, n_, i, 0))),
        delta=pl.BlockSpec((None, None, bq, 1), at(lambda b_, n_, i, j: (b_, n_, i, 0))),
        k=pl.BlockSpec((None, None, bk, h), at(lambda b_, n_, i, j: (b_, n_ // g, j, 0))),
        v=pl.BlockSpec((None, None, bk, h), at(lambda b_, n_, i, j: (b_, n_ // g, j, 0))),
        qs=pl.BlockSpec((None, bq, 1), at(lambda b_, n_, i, j: (b_, i, 0))),
        ks=pl.BlockSpec((None, 1, bk), at(lambda b_, n_, i, j: (b_, 0, j))))
    if bias is not None:
      bb, nb = bias.shape[:2]
      out["bias"] = pl.BlockSpec((None, None, bq, bk), at(
          lambda b_, n_, i, j: (b_ if bb > 1 else 0, n_ if nb > 1 else 0, i, j)))
    return [out[name] for name in order]

  inputs = [arrays[name] for name in order]
  params = lambda sem: _mosaic_tpu.params(sem, config.vmem_limit_bytes, interpret)
  backward_cost = blocks.costs(call, bq, bk)

  # dk, dv: grid (B, K, key block, (head of the group, query block)); a skipped step repeats
  # the last visible query block's index, so nothing is fetched for it.
  def dkdv_where(b_, kh, j, step):
    _, i = blocks.visit_queries(j, step % n_q, bq, bk, call)
    return b_, kh * g + step // n_q, i, j

  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, call=call, bq=bq, bk=bk, n_q=n_q),
      grid=(b, kv_heads, n_k, g * n_q),
      in_specs=specs(dkdv_where),
      out_specs=[pl.BlockSpec((None, None, bk, h), lambda b_, kh, j, st: (b_, kh, j, 0))] * 2,
      out_shape=[jax.ShapeDtypeStruct((b, kv_heads, s_pad, h), k.dtype)] * 2,
      scratch_shapes=[_vmem((bk, h)), _vmem((bk, h))],
      compiler_params=params(("parallel", "parallel", "parallel", "arbitrary")),
      cost_estimate=backward_cost["dkdv"],
      interpret=interpret, name="jk_attention_dkdv",
  )(*inputs)

  def dq_where(b_, n_, i, j):
    _, jj = blocks.visit(i, j, bq, bk, call)
    return b_, n_, i, jj

  dq = pl.pallas_call(
      functools.partial(_dq_kernel, call=call, bq=bq, bk=bk),
      grid=(b, n, n_q, n_k),
      in_specs=specs(dq_where),
      out_specs=pl.BlockSpec((None, None, bq, h), lambda b_, n_, i, j: (b_, n_, i, 0)),
      out_shape=jax.ShapeDtypeStruct((b, n, t_pad, h), q.dtype),
      scratch_shapes=[_vmem((bq, h))],
      compiler_params=params(("parallel", "parallel", "parallel", "arbitrary")),
      cost_estimate=backward_cost["dq"],
      interpret=interpret, name="jk_attention_dq",
  )(*inputs)

  dbias = None
  if bias is not None:
    bb, nb = bias.shape[:2]
    reps_n = n // nb

    def db_where(ob, on, i, j, rep):
      b_ = ob if bb > 1 else rep // reps_n
      n_ = on if nb > 1 else rep % reps_n
      return b_, n_, i, j

    dbias = pl.pallas_call(
        functools.partial(_dbias_kernel, call=call, bq=bq, bk=bk),
        grid=(bb, nb, n_q, n_k, (b // bb) * reps_n),
        in_specs=specs(db_where),
        out_specs=pl.BlockSpec((None, None, bq, bk), lambda ob, on, i, j, rep: (ob, on, i, j)),
        out_shape=jax.ShapeDtypeStruct((bb, nb, t_pad, s_pad), bias.dtype),
        scratch_shapes=[_vmem((bq, bk))],
        compiler_params=params(("parallel", "parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret, name="jk_attention_dbias",
    )(*inputs)[:, :, :t, :s]

  back = lambda a, length: jnp.swapaxes(a[:, :, :length], 1, 2)
  return back(dq, t), back(dk, s), back(dv, s), dbias
