"""Pallas Triton kernels for flash attention, forward and backward (CUDA GPUs, sm80+).

FlashAttention-2's schedule. Forward: a program takes ``block_q`` queries of one head and walks
the key blocks that its mask leaves visible, S = q k^T and then P V on the tensor cores, the
softmax's statistics kept by the online softmax (``_online_softmax.rows_update``, in base 2:
the scale carries log2 e, so an exponent is one ex2), and writes the output and the
log-sum-exp. Backward: P is recomputed from q, k and the saved log-sum-exp block by block;
one kernel takes a block of keys and walks the queries of every head of its group (dk and dv
summed over a GQA group in registers, no (B, S, N, H) copy), another a block of queries and
walks the keys (dq), and where there is a bias a third gives d(bias), summed over the batch
and heads that the bias broadcasts over. No kernel writes a (T, S) array except d(bias).

Blocks are walked in three runs (``common.key_blocks``): those the window hides whole are
never visited; those it shows whole are computed without a position mask; only the blocks on
the mask's edges pay for one. Segment ids mask every block; a block whose keys' segments cannot
meet the queries' (their id ranges are disjoint: packed sequences are sorted) is skipped.

Arrays are read through their (rows, heads x head dim) views: q as (B*T, N*H), k and v as
(B*S, K*H); a head dim that is not a power of two (96, 192) is masked to the next one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxkernels import _online_softmax, _triton, hardware
from jaxkernels._activations import LN2, LOG2E
from jaxkernels._online_softmax import Running, finite
from jaxkernels._tiling import cdiv, check_fields, is_pow2, next_pow2
from jaxkernels._triton import pltriton
from jaxkernels.ops.attention.common import (MAX_HEAD_DIM, Call, Window, dot, key_blocks,
                                             query_blocks, visible)



@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  block_q: int
  block_k: int
  num_warps: int
  num_stages: int
  bwd_block_q: int  # queries a step of the backward's walks (and a dq program's block)
  bwd_block_k: int  # keys a dk/dv program's block (and a dq walk's step)
  bwd_num_warps: int
  bwd_num_stages: int

  def __post_init__(self):
    check_fields(self, ("block_q", "block_k", "bwd_block_q", "bwd_block_k"),
                 lambda v: is_pow2(v) and v >= 16, "a power of two >= 16 (Triton's dot)")
    check_fields(self, ("num_warps", "bwd_num_warps"), is_pow2, "a power of two")
    check_fields(self, ("num_stages", "bwd_num_stages"), lambda v: v >= 1, ">= 1")


def _head_block(h: int) -> int:
  return max(16, next_pow2(h))


def heuristic(problem, chip: hardware.Chip) -> Config:
  """problem: the call's ``attention.api.Problem``. FlashAttention-2's Triton blocks on
  sm80/sm90: 128 queries against 64 keys forward (32 at head dims past 128, for registers),
  64 x 64 backward."""
  del chip
  hp = _head_block(problem.head_dim)
  small = problem.q_len <= 64 or problem.kv_len <= 64
  if hp > 128:  # H200 sweep at h256 (attention-1): forward 2.82 ms against 4.53 for 64 x 64
    return Config(block_q=128, block_k=64, num_warps=8, num_stages=1, bwd_block_q=64,
                  bwd_block_k=32, bwd_num_warps=4, bwd_num_stages=2)
  # H200, B=2 T=S=4096 N=16 H=128 bf16 (notes/attn.md, attention-1): forward 128 x 64 on 8
  # warps, 3 stages; backward 64 x 64 on 4 warps, 2 stages (2.50 ms fwd+bwd against 4.46 on
  # 8 warps, 3 stages).
  return Config(block_q=64 if small else 128, block_k=64, num_warps=8 if hp > 64 else 4,
                num_stages=3, bwd_block_q=64, bwd_block_k=64, bwd_num_warps=4, bwd_num_stages=2)


def unsupported(problem, chip) -> str | None:
  del chip
  if problem.head_dim > MAX_HEAD_DIM:
    return f"head dim {problem.head_dim} is over {MAX_HEAD_DIM}"
  return None


def config_error(problem, config: Config, chip) -> str | None:
  del problem, config, chip
  return None


# --------------------------------------------------------------------------- #
# Pieces every kernel shares
# --------------------------------------------------------------------------- #


def _both(a, b):
  return _triton.both(a, b)


def _load(ref, index, mask, other=0):
  if mask is None:
    return pltriton.load(ref.at[index])
  return pltriton.load(ref.at[index], mask=mask, other=other)


class _Rows:
  """One block of a (B*L, heads*H) view: rows ``pos`` (positions in the sequence, of batch
  ``b``) by the head dim of head ``head``; masks None where statically all-true."""

  def __init__(self, b, pos, length: int, head, call: Call, *, mask_rows: bool):
    hp = _head_block(call.head_dim)
    cols = jnp.arange(hp)
    self.pos = pos
    self.rows = b * length + pos
    self.row_mask = (pos < length) if mask_rows else None
    self.cols = head * call.head_dim + cols
    self.col_mask = (cols < call.head_dim) if hp != call.head_dim else None
    self.mask = _both(None if self.row_mask is None else self.row_mask[:, None],
                      None if self.col_mask is None else self.col_mask[None, :])
    self.index = (self.rows[:, None], self.cols[None, :])
    # The flat index of (row, head) in a (B*L, heads) statistics array.
    self.head = head

  def load(self, ref):
    return _load(ref, self.index, self.mask)

  def store(self, ref, value):
    pltriton.store(ref.at[self.index], value.astype(ref.dtype), mask=self.mask)

  def stat_index(self, heads: int):
    return self.rows * heads + self.head

  def load_stat(self, ref, heads: int, other):
    return _load(ref, self.stat_index(heads), self.row_mask, other).astype(jnp.float32)

  def store_stat(self, ref, heads: int, value):
    pltriton.store(ref.at[self.stat_index(heads)], value.astype(ref.dtype), mask=self.row_mask)


def _tanh(x, call: Call, math_):
  """tanh for the soft cap. libdevice's tanhf costs ~20 instructions: the soft-capped forward
  ran 64% over the plain one with it on an H200 (notes/attn.md, attention-1).

  bfloat16 and float16 inputs, compiled: tanh.approx.f32, one SFU op, relative error ~2**-11,
  under the 2**-8 that rounding the logits to the input dtype costs the naive baseline. Else
  1 - 2 / (1 + 2**(2 x log2 e)), one ex2 and one rcp (43% over the plain forward with them):
  absolute error ~1e-7, which the cap multiplies back to ~1e-7 of a logit; +-1 at the ends."""
  if call.dtype != jnp.float32 and math_ is _triton.MATH:
    return _triton.fast_tanh(x)
  return 1.0 - 2.0 * math_.reciprocal(1.0 + math_.exp2(x * (2.0 * LOG2E)))


def _scores(qk, bias, call: Call, math_):
  """The logits in base 2 (log2 e x the natural ones) from q k^T: scaled, soft-capped, the bias
  added; and tanh(scaled / cap) for the cap's derivative (None without a cap)."""
  if call.soft_cap is None and bias is None:
    return qk * (call.scale * LOG2E), None
  s = qk * call.scale
  th = None
  if call.soft_cap is not None:
    th = _tanh(s * (1.0 / call.soft_cap), call, math_)
    s = call.soft_cap * th
  if bias is not None:
    s = s + bias
  return s * LOG2E, th


def _bias_tile(bias_ref, b, n, q_pos, k_pos, call: Call, q_mask, k_mask):
  if bias_ref is None:
    return None
  bb, nb = call.bias_shape[:2]
  index = (b if bb > 1 else 0, n if nb > 1 else 0, q_pos[:, None], k_pos[None, :])
  mask = _both(None if q_mask is None else q_mask[:, None],
               None if k_mask is None else k_mask[None, :])
  return _load(bias_ref, index, mask).astype(jnp.float32)


def _divmod(x, d: int):
  """(x // d, x % d) of a non-negative traced int32 by lax.div and lax.rem: jnp's ``%`` guards
  against a zero divisor with a select that Pallas Triton's lowering (jax 0.10-0.11) types i1
  inside a loop under a cond (the dbias kernel's, with a bias broadcast over the heads)."""
  d = jnp.int32(d)
  return lax.div(x, d), lax.rem(x, d)


def _visible(q_pos, k_pos, call: Call, q_seg, kv_seg, *, positions: bool, k_edge: bool):
  """The block's mask (None: all visible): the window where ``positions``, the keys' end where
  ``k_edge``, segments where the call has them."""
  window = call.window if positions else Window(None, None)
  mask = visible(q_pos[:, None], k_pos[None, :], window,
                 None if q_seg is None else q_seg[:, None],
                 None if kv_seg is None else kv_seg[None, :])
  if k_edge:
    mask = _both(mask, (k_pos < call.kv_len)[None, :])
  return mask


def _may_meet(q_seg, kv_seg):
  """Whether any query of the block can share a segment with any key of the block (their id
  ranges overlap); conservative for unsorted ids."""
  return (jnp.min(q_seg) <= jnp.max(kv_seg)) & (jnp.min(kv_seg) <= jnp.max(q_seg))


def _query_block(call: Call, block_q: int):
  """(b, n, kv head, first query, query positions, their _Rows) of a program of a grid
  (query blocks, B*N)."""
  bn = pl.program_id(1)
  b, n = _divmod(bn, call.heads)
  t0 = pl.program_id(0) * block_q
  q_pos = t0 + jnp.arange(block_q)
  qt = _Rows(b, q_pos, call.q_len, n, call, mask_rows=call.q_len % block_q != 0)
  return b, n, _divmod(n, call.group)[0], t0, q_pos, qt


def _keys_meet(kv_seg_ref, b, q_seg, s_len: int, block_k: int):
  """block -> whether key block ``block``'s segments can meet the queries' ``q_seg``."""
  def meet(j):
    k_pos = j * block_k + jnp.arange(block_k)
    return _may_meet(q_seg, _kv_segments(kv_seg_ref, b, k_pos, s_len, k_pos < s_len))
  return meet


def _walk(bounds, body, carry, *, segments_meet=None):
  """carry after body(block, carry, masked) over the runs of ``bounds`` (first, full_first,
  full_end, end): the edges masked, the middle not. With ``segments_meet(block)``, a block
  whose segments cannot meet is skipped."""
  first, full_first, full_end, end = bounds

  def step(masked):
    def run(j, c):
      if segments_meet is None:
        return body(j, c, masked)
      return lax.cond(segments_meet(j), lambda c: body(j, c, masked), lambda c: c, c)
    return run

  carry = lax.fori_loop(first, full_first, step(True), carry)
  carry = lax.fori_loop(full_first, full_end, step(False), carry)
  return lax.fori_loop(full_end, end, step(True), carry)


def _segments(ref, b, pos, length: int, mask):
  if ref is None:
    return None
  # Rows past the end read a segment that no key has, so they see nothing.
  return _load(ref, b * length + pos, mask, other=-1)


def _kv_segments(ref, b, pos, length: int, mask):
  if ref is None:
    return None
  return _load(ref, b * length + pos, mask, other=-2)


def _split(refs, call: Call, n_out: int):
  refs = list(refs)
  outs = refs[len(refs) - n_out:]
  refs = refs[:len(refs) - n_out]
  named = {}
  for name in ("q", "k", "v"):
    named[name] = refs.pop(0)
  named["bias"] = refs.pop(0) if call.bias_shape is not None else None
  if call.segments:
    named["q_seg"], named["kv_seg"] = refs.pop(0), refs.pop(0)
  else:
    named["q_seg"] = named["kv_seg"] = None
  return named, refs, outs


def _inputs(call: Call, q, k, v, bias, q_seg, kv_seg):
  """The kernels' views: q (B*T, N*H), k and v (B*S, K*H), segments flat."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  out = [q.reshape(b * t, n * h), k.reshape(b * s, kh * h), v.reshape(b * s, kh * h)]
  if call.bias_shape is not None:
    out.append(bias)
  if call.segments:
    out += [q_seg.reshape(-1).astype(jnp.int32), kv_seg.reshape(-1).astype(jnp.int32)]
  return out


# --------------------------------------------------------------------------- #
# Forward
# --------------------------------------------------------------------------- #


def _forward_kernel(*refs, call: Call, block_q: int, block_k: int, math_):
  r, _, (o_ref, lse_ref) = _split(refs, call, 2)
  t_len, s_len = call.q_len, call.kv_len
  b, n, kh, t0, q_pos, qt = _query_block(call, block_q)
  q = qt.load(r["q"])
  q_seg = _segments(r["q_seg"], b, q_pos, t_len, qt.row_mask)

  def body(j, carry, masked):
    acc, state = carry
    k_pos = j * block_k + jnp.arange(block_k)
    edge = masked and s_len % block_k != 0
    kt = _Rows(b, k_pos, s_len, kh, call, mask_rows=edge)
    k, v = kt.load(r["k"]), kt.load(r["v"])
    bias = _bias_tile(r["bias"], b, n, q_pos, k_pos, call, qt.row_mask, kt.row_mask)
    s, _ = _scores(dot(q, k, call, tb=True), bias, call, math_)
    kv_seg = _kv_segments(r["kv_seg"], b, k_pos, s_len, kt.row_mask)
    mask = _visible(q_pos, k_pos, call, q_seg, kv_seg, positions=masked, k_edge=edge)
    if mask is not None:
      s = jnp.where(mask, s, -jnp.inf)
    state, rescale, p = _online_softmax.rows_update(state, s, exp=math_.exp2)
    acc = acc * rescale[:, None] + dot(p.astype(v.dtype), v, call)
    return acc, state

  meet = _keys_meet(r["kv_seg"], b, q_seg, s_len, block_k) if call.segments else None
  bounds = key_blocks(t0, jnp.minimum(block_q, t_len - t0), block_k, s_len, call.window)
  acc = jnp.zeros((block_q, _head_block(call.head_dim)), jnp.float32)
  acc, (peak, total) = _walk(bounds, body, (acc, Running.start((block_q,))),
                             segments_meet=meet)
  seen = total > 0
  inv = 1.0 / jnp.where(seen, total, 1.0)
  qt.store(o_ref, acc * inv[:, None])
  lse = jnp.where(seen, (finite(peak) + jnp.log2(jnp.where(seen, total, 1.0))) * LN2, -jnp.inf)
  qt.store_stat(lse_ref, call.heads, lse)


def forward(q, k, v, bias, q_seg, kv_seg, *, window: Window, scale: float,
            soft_cap: float | None, config: Config, interpret=False):
  """(out (B, T, N, H) in q's dtype, lse (B, T, N) float32, natural log; -inf for a query
  that sees no key)."""
  call = Call.of(q, k, bias, q_seg, window=window, scale=scale, soft_cap=soft_cap)
  b, t, n, h = q.shape
  kernel = functools.partial(_forward_kernel, call=call, block_q=config.block_q,
                             block_k=config.block_k, math_=_triton.math(interpret))
  out, lse = pl.pallas_call(
      kernel,
      grid=(cdiv(t, config.block_q), b * n),
      out_shape=[jax.ShapeDtypeStruct((b * t, n * h), q.dtype),
                 jax.ShapeDtypeStruct((b * t * n,), jnp.float32)],
      compiler_params=_triton.params(config.num_warps, config.num_stages),
      interpret=interpret,
      name="jk_attention_fwd",
  )(*_inputs(call, q, k, v, bias, q_seg, kv_seg))
  return out.reshape(q.shape), lse.reshape(b, t, n)


# --------------------------------------------------------------------------- #
# Backward
# --------------------------------------------------------------------------- #


def _grad_scores(q, k, v, do, lse2, delta, bias, mask, call: Call, math_, *,
                 wrt_bias: bool = False):
  """(p, ds) of one block: p recomputed from the saved log-sum-exp (base 2), ds the gradient
  of the logits before the scale (the cap's derivative applied), or with ``wrt_bias`` of the
  logits as the bias meets them (after the cap)."""
  s, th = _scores(dot(q, k, call, tb=True), bias, call, math_)
  if mask is not None:
    s = jnp.where(mask, s, -jnp.inf)
  p = math_.exp2(s - lse2[:, None])
  dp = dot(do, v, call, tb=True)
  ds = p * (dp - delta[:, None])
  if th is not None and not wrt_bias:
    ds = ds * (1.0 - th * th)
  return p, ds


def _query_stats(r_lse, r_delta, qt: _Rows, call: Call):
  """The saved log-sum-exp in base 2 (+inf where a query sees nothing, so its p is 0) and
  delta = rowsum(dO * O) - d(lse) of a block of queries."""
  lse = qt.load_stat(r_lse, call.heads, jnp.inf)
  lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)
  return lse2, qt.load_stat(r_delta, call.heads, 0.0)


def _dkdv_kernel(*refs, call: Call, block_q: int, block_k: int, math_):
  r, (lse_ref, delta_ref, do_ref), (dk_ref, dv_ref) = _split(refs, call, 2)
  t_len, s_len = call.q_len, call.kv_len
  bk_ = pl.program_id(1)
  b, kh = _divmod(bk_, call.kv_heads)
  s0 = pl.program_id(0) * block_k
  k_pos = s0 + jnp.arange(block_k)
  kt = _Rows(b, k_pos, s_len, kh, call, mask_rows=s_len % block_k != 0)
  k, v = kt.load(r["k"]), kt.load(r["v"])
  kv_seg = _kv_segments(r["kv_seg"], b, k_pos, s_len, kt.row_mask)
  bounds = query_blocks(s0, jnp.minimum(block_k, s_len - s0), block_q, t_len, call.window)

  def head(g, carry):
    n = kh * call.group + g

    def body(i, carry, masked):
      dk, dv = carry
      q_pos = i * block_q + jnp.arange(block_q)
      qt = _Rows(b, q_pos, t_len, n, call, mask_rows=masked and t_len % block_q != 0)
      q, do = qt.load(r["q"]), qt.load(do_ref)
      lse2, delta = _query_stats(lse_ref, delta_ref, qt, call)
      q_seg = _segments(r["q_seg"], b, q_pos, t_len, qt.row_mask)
      bias = _bias_tile(r["bias"], b, n, q_pos, k_pos, call, qt.row_mask, kt.row_mask)
      mask = _visible(q_pos, k_pos, call, q_seg, kv_seg, positions=masked,
                      k_edge=s_len % block_k != 0)
      p, ds = _grad_scores(q, k, v, do, lse2, delta, bias, mask, call, math_)
      dv = dv + dot(p.astype(do.dtype), do, call, ta=True)
      dk = dk + dot(ds.astype(q.dtype), q, call, ta=True)
      return dk, dv

    meet = None
    if call.segments:
      meet = lambda i: _may_meet(_segments(r["q_seg"], b, i * block_q + jnp.arange(block_q),
                                           t_len, i * block_q + jnp.arange(block_q) < t_len),
                                 kv_seg)
    return _walk(bounds, body, carry, segments_meet=meet)

  zeros = jnp.zeros((block_k, _head_block(call.head_dim)), jnp.float32)
  dk, dv = lax.fori_loop(0, call.group, head, (zeros, zeros))
  kt.store(dk_ref, dk * call.scale)
  kt.store(dv_ref, dv)


def _dq_kernel(*refs, call: Call, block_q: int, block_k: int, math_):
  r, (lse_ref, delta_ref, do_ref), (dq_ref,) = _split(refs, call, 1)
  t_len, s_len = call.q_len, call.kv_len
  b, n, kh, t0, q_pos, qt = _query_block(call, block_q)
  q, do = qt.load(r["q"]), qt.load(do_ref)
  lse2, delta = _query_stats(lse_ref, delta_ref, qt, call)
  q_seg = _segments(r["q_seg"], b, q_pos, t_len, qt.row_mask)

  def body(j, dq, masked):
    k_pos = j * block_k + jnp.arange(block_k)
    edge = masked and s_len % block_k != 0
    kt = _Rows(b, k_pos, s_len, kh, call, mask_rows=edge)
    k, v = kt.load(r["k"]), kt.load(r["v"])
    bias = _bias_tile(r["bias"], b, n, q_pos, k_pos, call, qt.row_mask, kt.row_mask)
    kv_seg = _kv_segments(r["kv_seg"], b, k_pos, s_len, kt.row_mask)
    mask = _visible(q_pos, k_pos, call, q_seg, kv_seg, positions=masked, k_edge=edge)
    _, ds = _grad_scores(q, k, v, do, lse2, delta, bias, mask, call, math_)
    return dq + dot(ds.astype(k.dtype), k, call)

  meet = _keys_meet(r["kv_seg"], b, q_seg, s_len, block_k) if call.segments else None
  bounds = key_blocks(t0, jnp.minimum(block_q, t_len - t0), block_k, s_len, call.window)
  dq = _walk(bounds, body, jnp.zeros((block_q, _head_block(call.head_dim)), jnp.float32),
             segments_meet=meet)
  qt.store(dq_ref, dq * call.scale)


def _dbias_kernel(*refs, call: Call, block_q: int, block_k: int, math_):
  """d(bias) of one (block_q, block_k) tile, summed over the batch and heads that the bias
  broadcasts over; zeros for a tile that the window hides whole."""
  r, (lse_ref, delta_ref, do_ref), (db_ref,) = _split(refs, call, 1)
  t_len, s_len = call.q_len, call.kv_len
  bb, nb = call.bias_shape[:2]
  t0, s0 = pl.program_id(0) * block_q, pl.program_id(1) * block_k
  owner = pl.program_id(2)
  b_own, n_own = _divmod(owner, nb)
  q_pos = t0 + jnp.arange(block_q)
  k_pos = s0 + jnp.arange(block_k)
  q_edge, k_edge = t_len % block_q != 0, s_len % block_k != 0
  first, _, _, end = key_blocks(t0, jnp.minimum(block_q, t_len - t0), block_k, s_len,
                                call.window)
  j = pl.program_id(1)
  reps_b = call.batch // bb
  reps_n = call.heads // nb

  def one(idx, acc):
    b = b_own if bb > 1 else _divmod(idx, reps_n)[0]
    n = n_own if nb > 1 else _divmod(idx, reps_n)[1]
    kh = _divmod(n, call.group)[0]
    qt = _Rows(b, q_pos, t_len, n, call, mask_rows=q_edge)
    kt = _Rows(b, k_pos, s_len, kh, call, mask_rows=k_edge)
    q, do = qt.load(r["q"]), qt.load(do_ref)
    k, v = kt.load(r["k"]), kt.load(r["v"])
    lse2, delta = _query_stats(lse_ref, delta_ref, qt, call)
    q_seg = _segments(r["q_seg"], b, q_pos, t_len, qt.row_mask)
    kv_seg = _kv_segments(r["kv_seg"], b, k_pos, s_len, kt.row_mask)
    bias = _bias_tile(r["bias"], b, n, q_pos, k_pos, call, qt.row_mask, kt.row_mask)
    mask = _visible(q_pos, k_pos, call, q_seg, kv_seg, positions=True, k_edge=k_edge)
    _, ds = _grad_scores(q, k, v, do, lse2, delta, bias, mask, call, math_, wrt_bias=True)
    return acc + ds

  def tile(acc):
    return lax.fori_loop(0, reps_b * reps_n, one, acc)

  acc = jnp.zeros((block_q, block_k), jnp.float32)
  acc = lax.cond((j >= first) & (j < end), tile, lambda a: a, acc)
  index = (*_divmod(owner, nb), q_pos[:, None], k_pos[None, :])
  mask = _both(None if not q_edge else (q_pos < t_len)[:, None],
               None if not k_edge else (k_pos < s_len)[None, :])
  pltriton.store(db_ref.at[index], acc.astype(db_ref.dtype), mask=mask)


def backward(q, k, v, bias, q_seg, kv_seg, out, lse, dout, dlse, *, window: Window,
             scale: float, soft_cap: float | None, config: Config, interpret=False):
  """(dq, dk, dv, dbias or None) from the saved output and log-sum-exp."""
  call = Call.of(q, k, bias, q_seg, window=window, scale=scale, soft_cap=soft_cap)
  b, t, n, h = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  delta = jnp.einsum("btnh,btnh->btn", dout.astype(jnp.float32), out.astype(jnp.float32))
  if dlse is not None:
    delta = delta - dlse.astype(jnp.float32)
  stats = [lse.reshape(-1), delta.reshape(-1), dout.reshape(b * t, n * h)]
  inputs = _inputs(call, q, k, v, bias, q_seg, kv_seg) + stats
  math_ = _triton.math(interpret)
  params = _triton.params(config.bwd_num_warps, config.bwd_num_stages)
  kw = dict(call=call, block_q=config.bwd_block_q, block_k=config.bwd_block_k, math_=math_)
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, **kw),
      grid=(cdiv(s, config.bwd_block_k), b * kv_heads),
      out_shape=[jax.ShapeDtypeStruct((b * s, kv_heads * h), k.dtype)] * 2,
      compiler_params=params, interpret=interpret, name="jk_attention_dkdv",
  )(*inputs)
  # dq walks keys as the forward does: its queries are the block, its keys the steps.
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, **kw),
      grid=(cdiv(t, config.bwd_block_q), b * n),
      out_shape=[jax.ShapeDtypeStruct((b * t, n * h), q.dtype)],
      compiler_params=params, interpret=interpret, name="jk_attention_dq",
  )(*inputs)[0]
  dbias = None
  if bias is not None:
    bb, nb = bias.shape[:2]
    dbias = pl.pallas_call(
        functools.partial(_dbias_kernel, **kw),
        grid=(cdiv(t, config.bwd_block_q), cdiv(s, config.bwd_block_k), bb * nb),
        out_shape=[jax.ShapeDtypeStruct(bias.shape, bias.dtype)],
        compiler_params=params, interpret=interpret, name="jk_attention_dbias",
    )(*inputs)[0]
  return (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dbias)
