"""Pallas Mosaic TPU flash attention on (B, T, N, H) in place: every head of a block in one step.

On TPU the minor two dimensions of an array are tiled, (8, 128) of 32-bit words, bfloat16 packed
in pairs of rows, so (B, T, N, H) viewed as (B, T * N, H) is the same bytes wherever N fills
whole tiles, and XLA compiles the reshape to a bitcast. The kernels here read q, k, v and dout
and write out, dq, dk and dv through that view: no transpose around them, where the
heads-major kernels of ``mosaic_tpu.py`` transpose each array in HBM, (B, T, N, H) <-> (B, N,
T, H), about 500 MB at B2 T4096 N16 H128 (notes/attn.md tpu-splash-2).

A block is bq positions of every head, interleaved: position t of head n at row t * N + n. A
head's rows are one strided load. Mosaic loads strided rows of 32-bit words only, so a 16-bit
block is copied once a step into a uint32 scratch, where word row t * N / 2 + m holds heads
2m (low half) and 2m + 1 (high half), and a head is split out by a shift; outputs go back
the same way, two heads to a word. The grid is (batch, query block, key block) forward and for
dq, (batch, key block, query block) for dk and dv; a step loops over the heads, so a key block
is read once for every head of its GQA group, not once a head.

Head dims that divide 128 (64, 32) are read another way: (B, T, N, H) viewed as (B, T, N * H),
a block bq positions of every head side by side in lanes, 128 / H heads to a 128-lane group.
A head is a group's aligned 128-lane load and a static slice of it; outputs go back a group at
a time, its heads side by side. The rows view would pad each 64-lane head to 128 lanes in HBM
and VMEM, and XLA lays a (B, T, N, 64) array out with T minor, so either view costs a caller's
array one relayout; an array a product made (the model's q, k and v) is written in this view
directly (notes/report.md tpu-step-1).

The orientation is transposed: a block's scores are (keys, queries), so the softmax's
statistics are rows, (1, bq), 8 sublanes of VMEM a head where a column takes 128 lanes, and the
log-sum-exp is kept as (B, N, 1, T). The outputs accumulate transposed, (H, bq), and turn once,
at the last key block. Masks, windows, segments, the soft cap and skipped blocks are those of
the heads-major kernels; a bias takes those (its blocks are per head).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxkernels import _mosaic_tpu
from jaxkernels._online_softmax import finite
from jaxkernels._tiling import round_up
from jaxkernels.ops.attention import mosaic_tpu_blocks as blocks
from jaxkernels.ops.attention.common import Call, Window, dot, key_blocks, query_blocks

_HIGH = 0xFFFF0000  # the high half of a word: the odd head of a pair
LANES = 128  # Mosaic loads strided rows of a 128-lane memref: wider heads go in pieces


def reason(problem) -> str | None:
  """Why a problem cannot run in place (the heads-major kernels take it), or None."""
  if problem.bias is not None:
    return "a bias is read in (bq, bk) blocks per head"
  h, heads, kv_heads = problem.head_dim, problem.heads, problem.kv_heads
  if _lanes(h):
    per = LANES // h
    if heads % per or kv_heads % per:
      return (f"head dim {h} puts {per} heads in a 128-lane group, so the {heads} query and "
              f"{kv_heads} key heads must each be a multiple of {per}")
    return None
  if h % LANES:
    return f"head dim {h} is neither whole {LANES}-lane pieces nor a divisor of {LANES}"
  itemsize = jnp.dtype(problem.dtype).itemsize
  if itemsize == 2 and (heads % 2 or kv_heads % 2):
    return (f"{heads} query and {kv_heads} key heads: 16-bit heads go two to a 32-bit word, "
            "so both counts must be even")
  return None


def _lanes(h: int) -> bool:
  """Whether heads of dim ``h`` lie side by side in lanes, (B, T, N * H), rather than in
  interleaved rows, (B, T * N, H)."""
  return h < LANES and LANES % h == 0


def vmem_bytes(problem, bq: int, bk: int) -> dict[str, int]:
  """VMEM each kernel takes with (bq, bk) blocks: the pipeline's two buffers of every block,
  a 32-bit copy of each block that is 16-bit or wider than 128 lanes, the float32 scratch,
  and the float32 (bk, bq) temporaries of one head's step."""
  n, kv, h = problem.heads, problem.kv_heads, problem.head_dim
  item = jnp.dtype(problem.dtype).itemsize
  copies = 2 if _lanes(h) or (item == 4 and h == LANES) else 3
  q_block, kv_block = bq * n * h * item, bk * kv * h * item
  rows = 8 * bq * 4  # a (1, bq) float32 row takes 8 sublanes
  temps = 6 * bk * bq * 4 + 4 * (bk + bq) * h * 4
  return dict(
      fwd=copies * (2 * q_block + 2 * kv_block) + 2 * n * rows * 3 + n * h * bq * 4 + temps,
      dkdv=copies * (2 * q_block + 4 * kv_block) + 4 * n * rows + 2 * kv * bk * h * 4 + temps,
      dq=copies * (3 * q_block + 2 * kv_block) + 4 * n * rows + n * h * bq * 4 + temps)


# --------------------------------------------------------------------------- #
# One head out of an interleaved block
# --------------------------------------------------------------------------- #



def _packed(dtype) -> bool:
  return jnp.dtype(dtype).itemsize == 2


def _words(ref, scratch):
  """``ref``'s block as 128-lane pieces of 32-bit words, each a (rows / packing, 128) ref:
  ``scratch`` (pieces, rows / packing, 128) filled with them, or the block itself where it is
  one piece of 32-bit words already."""
  if scratch is None:
    return [ref]
  for c in range(scratch.shape[0]):
    piece = ref[:, c * LANES:(c + 1) * LANES]
    scratch[c] = pltpu.bitcast(piece, jnp.uint32) if _packed(ref.dtype) else piece
  return [scratch.at[c] for c in range(scratch.shape[0])]


def _words_once(ref, scratch, first):
  """``ref``'s block as words, the scratch filled at the step ``first`` only (the block stays
  the same over the steps after it)."""
  if scratch is None:
    return [ref]

  @pl.when(first)
  def _():
    _words(ref, scratch)
  return [scratch.at[c] for c in range(scratch.shape[0])]


def _first_key_block(i, bq: int, bk: int, call: Call):
  """The first key block that query block i visits."""
  return key_blocks(i * bq, jnp.minimum(bq, call.q_len - i * bq), bk, call.kv_len,
                    call.window)[0]


def _first_query_block(j, bq: int, bk: int, call: Call):
  return query_blocks(j * bk, jnp.minimum(bk, call.kv_len - j * bk), bq, call.q_len,
                      call.window)[0]


def _head(pieces, n, heads: int, rows: int, dtype, h: int):
  """Head n's (rows, H) block, in ``dtype``, from an interleaved block's pieces of words, or
  from a block of heads side by side in lanes where H divides 128 (its group's aligned load,
  then the head's static slice of it)."""
  if _lanes(h):
    per = LANES // h
    group = pieces[0][:, pl.ds(pl.multiple_of(n // per * LANES, LANES), LANES)]
    head = group[:, :h]
    for slot in range(1, per):
      head = jnp.where(n % per == slot, group[:, slot * h:(slot + 1) * h], head)
    return head.astype(dtype)
  parts = []
  for words in pieces:
    if not _packed(dtype):
      parts.append(words[pl.ds(n, rows, stride=heads), :])
      continue
    w = words[pl.ds(n // 2, rows, stride=heads // 2), :]
    up = (16 * (1 - n % 2)).astype(jnp.uint32)  # the even head's low half up, the odd's stays
    bits = lax.shift_left(w, jnp.broadcast_to(up, w.shape)) & jnp.uint32(_HIGH)
    parts.append(pltpu.bitcast(bits, jnp.float32).astype(dtype))
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _store_heads(out_ref, words, heads: int, rows: int, value, h: int):
  """Writes every head's (rows, H) float32 block, ``value(n)``, into an interleaved output
  block: through ``words``, a (pieces, rows / packing, 128) scratch, where the output is
  16-bit or wider than one piece; or, where H divides 128, into a block of heads side by
  side in lanes, a 128-lane group of them at a time."""
  if _lanes(h):
    per = LANES // h

    def group(m, carry):
      side_by_side = jnp.concatenate([value(m * per + slot) for slot in range(per)], axis=1)
      out_ref[:, pl.ds(pl.multiple_of(m * LANES, LANES), LANES)] = (
          side_by_side.astype(out_ref.dtype))
      return carry
    lax.fori_loop(0, heads // per, group, 0)
    return
  if words is None:
    def one(n, carry):
      out_ref[pl.ds(n, rows, stride=heads), :] = value(n).astype(out_ref.dtype)
      return carry
    lax.fori_loop(0, heads, one, 0)
    return
  pieces = range(words.shape[0])
  cut = lambda x, c: x[:, c * LANES:(c + 1) * LANES]

  def bits(x):
    return pltpu.bitcast(x.astype(out_ref.dtype).astype(jnp.float32), jnp.uint32)

  def pair(m, carry):
    low, high = bits(value(2 * m)), bits(value(2 * m + 1))
    for c in pieces:
      words.at[c][pl.ds(m, rows, stride=heads // 2), :] = (
          lax.shift_right_logical(cut(low, c), jnp.uint32(16)) | (cut(high, c) &
                                                                  jnp.uint32(_HIGH)))
    return carry

  def one(n, carry):
    x = value(n)
    for c in pieces:
      words.at[c][pl.ds(n, rows, stride=heads), :] = cut(x, c)
    return carry

  if _packed(out_ref.dtype):
    lax.fori_loop(0, heads // 2, pair, 0)
  else:
    lax.fori_loop(0, heads, one, 0)
  for c in pieces:
    piece = words[c]
    out_ref[:, c * LANES:(c + 1) * LANES] = (
        pltpu.bitcast(piece, out_ref.dtype) if _packed(out_ref.dtype) else piece)


def _each_head(call: Call, key_head, body):
  """``body(n, k, v)`` for every query head n, with ``(k, v) = key_head(c)`` of its key head
  c, split out once for the c's GQA group, not once per query head."""
  def group(c, carry):
    k, v = key_head(c)

    def head(r, carry):
      body(c * call.group + r, k, v)
      return carry
    return lax.fori_loop(0, call.group, head, carry)
  lax.fori_loop(0, call.kv_heads, group, 0)



def _scores_t(k, q, call: Call, mask):
  """(bk, bq) logits k q^T, scaled, capped, masked; and tanh for the cap's slope."""
  s, th = blocks.scores(dot(k, q, call, tb=True), None, call)
  if mask is not None:
    s = jnp.where(mask, s, -jnp.inf)
  return s, th


def _read(ref):
  return None if ref is None else ref[...]


# --------------------------------------------------------------------------- #
# Forward
# --------------------------------------------------------------------------- #


def _forward_kernel(*refs, call: Call, bq: int, bk: int):
  refs = list(refs)
  q_ref, k_ref, v_ref = refs[:3]
  rest = refs[3:]
  qs_ref, ks_ref = (rest.pop(0), rest.pop(0)) if call.segments else (None, None)
  o_ref, lse_ref, m_sc, l_sc, acc_sc, *words = rest
  q_w, k_w, v_w, o_w = words if words else (None,) * 4
  i, j = pl.program_id(1), pl.program_id(2)
  heads, kv_heads, dtype, h = call.heads, call.kv_heads, call.dtype, call.head_dim

  @pl.when(j == 0)
  def _():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  run, _ = blocks.visit(i, j, bq, bk, call)
  qs = _words_once(q_ref, q_w, j == _first_key_block(i, bq, bk, call))

  @pl.when(run)
  def _():
    ks, vs = _words(k_ref, k_w), _words(v_ref, v_w)
    mask = blocks.mask(i, j, bq, bk, call, _read(qs_ref), _read(ks_ref), keys_down=True)

    def head(n, k, v):
      q = _head(qs, n, heads, bq, dtype, h)
      s, _ = _scores_t(k, q, call, mask)
      m_prev = m_sc[n]
      m_new = jnp.maximum(m_prev, jnp.max(s, axis=0, keepdims=True))
      safe = finite(m_new)
      alpha = jnp.exp(m_prev - safe)
      p = jnp.exp(s - safe)
      l_sc[n] = l_sc[n] * alpha + jnp.sum(p, axis=0, keepdims=True)
      acc_sc[n] = acc_sc[n] * alpha + dot(v, p.astype(dtype), call, ta=True)
      m_sc[n] = m_new

    _each_head(call, lambda c: (_head(ks, c, kv_heads, bk, dtype, h),
                                _head(vs, c, kv_heads, bk, dtype, h)), head)

  @pl.when(j == pl.num_programs(2) - 1)
  def _():
    def out(n):
      total = l_sc[n]
      seen = total > 0
      lse_ref[n] = jnp.where(seen, finite(m_sc[n]) + jnp.log(jnp.where(seen, total, 1.0)),
                             -jnp.inf)
      return (acc_sc[n] / jnp.where(seen, total, 1.0)).T

    _store_heads(o_ref, o_w, heads, bq, out, h)


def _interleaved(a, length: int):
  """(B, L, N, H) as the kernels' view: padded to ``length`` positions (a copy, only where L
  is not whole blocks), then (B, length * N, H), merged with the heads (a bitcast on TPU), or
  where H divides 128 (B, length, N * H), the heads side by side."""
  b, l, n, h = a.shape
  if length != l:
    a = jnp.pad(a, ((0, 0), (0, length - l), (0, 0), (0, 0)))
  return a.reshape(_viewed(b, length, n, h))


def _viewed(b: int, length: int, n: int, h: int) -> tuple[int, int, int]:
  """The kernels' view of a (b, length, n, h) array (:func:`_interleaved`)."""
  return (b, length, n * h) if _lanes(h) else (b, length * n, h)


def _block(rows: int, n: int, h: int, index_map) -> pl.BlockSpec:
  """``rows`` positions of every one of ``n`` heads, in the kernels' view."""
  return pl.BlockSpec((None, *_viewed(1, rows, n, h)[1:]), index_map)


def _positions(a, b: int, length: int, n: int, h: int, keep: int):
  """The kernels' (B, length * N, H) output as (B, keep, N, H)."""
  a = a.reshape(b, length, n, h)
  return a[:, :keep] if keep != length else a


def _rows(stat, length: int):
  """A (B, T, N) statistic as the kernels' (B, N, 1, length) rows (a small transpose)."""
  stat = jnp.swapaxes(stat.astype(jnp.float32), 1, 2)[:, :, None, :]
  pad = length - stat.shape[-1]
  return jnp.pad(stat, ((0, 0), (0, 0), (0, 0), (0, pad))) if pad else stat


def _scratch(shape, dtype=jnp.float32):
  return pltpu.VMEM(shape, dtype)


def _word_scratch(dtype, *rows_of: int, h: int):
  """The 32-bit copies (pieces, rows / packing, 128) of blocks of ``rows_of`` rows each: none
  where a block is one piece of 32-bit words already."""
  if _lanes(h) or (not _packed(dtype) and h == LANES):
    return []
  packing = 2 if _packed(dtype) else 1
  words = jnp.uint32 if _packed(dtype) else dtype
  return [_scratch((h // LANES, rows // packing, LANES), words) for rows in rows_of]


def forward(q, k, v, q_seg, kv_seg, *, window: Window, scale: float, soft_cap: float | None,
            config, interpret=False):
  call = Call.of(q, k, None, q_seg, window=window, scale=scale, soft_cap=soft_cap)
  b, t, n, h = q.shape
  kv_heads = call.kv_heads
  bq, bk = config.block_q, config.block_k
  t_pad, s_pad = round_up(t, bq), round_up(call.kv_len, bk)
  n_q, n_k = t_pad // bq, s_pad // bk

  def kv_map(b_, i, j):
    return b_, blocks.visit(i, j, bq, bk, call)[1], 0

  inputs = [_interleaved(q, t_pad), _interleaved(k, s_pad), _interleaved(v, s_pad)]
  specs = [_block(bq, n, h, lambda b_, i, j: (b_, i, 0)), _block(bk, kv_heads, h, kv_map),
           _block(bk, kv_heads, h, kv_map)]
  if q_seg is not None:  # a (1, bq) row of query ids, a (bk, 1) column of key ids
    inputs += [blocks.segments(q_seg, t_pad, -1)[:, None, :],
               blocks.segments(kv_seg, s_pad, -2)[:, :, None]]
    specs += [pl.BlockSpec((None, 1, bq), lambda b_, i, j: (b_, 0, i)),
              pl.BlockSpec((None, bk, 1), lambda b_, i, j: (b_, kv_map(b_, i, j)[1], 0))]
  out, lse = pl.pallas_call(
      functools.partial(_forward_kernel, call=call, bq=bq, bk=bk),
      grid=(b, n_q, n_k),
      in_specs=specs,
      out_specs=[_block(bq, n, h, lambda b_, i, j: (b_, i, 0)),
                 pl.BlockSpec((None, n, 1, bq), lambda b_, i, j: (b_, 0, 0, i))],
      out_shape=[jax.ShapeDtypeStruct(_viewed(b, t_pad, n, h), q.dtype),
                 jax.ShapeDtypeStruct((b, n, 1, t_pad), jnp.float32)],
      scratch_shapes=[_scratch((n, 1, bq)), _scratch((n, 1, bq)), _scratch((n, h, bq)),
                      *_word_scratch(q.dtype, bq * n, bk * kv_heads, bk * kv_heads, bq * n,
                                     h=h)],
      compiler_params=_mosaic_tpu.params(("parallel", "parallel", "arbitrary"),
                                         config.vmem_limit_bytes, interpret),
      cost_estimate=blocks.costs(call, bq, bk, shared_kv=True)["fwd"],
      interpret=interpret,
      name="jk_attention_fwd_in_place",
  )(*inputs)
  return (_positions(out, b, t_pad, n, h, t),
          jnp.swapaxes(lse[:, :, 0, :t], 1, 2))


# --------------------------------------------------------------------------- #
# Backward
# --------------------------------------------------------------------------- #


def _grads_t(q, k, v, do, lse, delta, mask, call: Call):
  """(p^T, ds^T), (bk, bq), of one head's block from the saved log-sum-exp and delta rows."""
  s, th = _scores_t(k, q, call, mask)
  lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # a query that sees nothing: p = 0
  p = jnp.exp(s - lse)
  ds = p * (dot(v, do, call, tb=True) - delta)
  if th is not None:
    ds = ds * (1.0 - th * th)
  return p, ds


def _delta_kernel(o_ref, do_ref, delta_ref, *words, call: Call, bq: int):
  """Each head's delta = rowsum(dout * out) over H, as (1, bq) rows: summed on the MXU
  (ones (8, H) against the product, transposed), so no (bq, 1) column is turned into a row."""
  o_w, do_w = words if words else (None, None)
  outs, douts = _words(o_ref, o_w), _words(do_ref, do_w)
  h = call.head_dim
  ones = jnp.ones((8, h), jnp.float32)

  def head(n, carry):
    f32 = lambda pieces: _head(pieces, n, call.heads, bq, call.dtype, h).astype(jnp.float32)
    rows = lax.dot_general(ones, f32(outs) * f32(douts), (((1,), (1,)), ((), ())),
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    delta_ref[n] = rows[:1]
    return carry
  lax.fori_loop(0, call.heads, head, 0)


def _delta(out, dout, call: Call, length: int, bq: int, vmem_limit_bytes: int, interpret):
  """delta (B, N, 1, length) rows from the kernels' views of out and dout (``length``
  positions each): one read of each. XLA's einsum over a (B, T, N, 64) pair turned a float32
  copy of it to lay H out for the reduction (notes/report.md tpu-step-1)."""
  b, n, h = call.batch, call.heads, call.head_dim
  item = call.dtype.itemsize
  return pl.pallas_call(
      functools.partial(_delta_kernel, call=call, bq=bq),
      grid=(b, length // bq),
      in_specs=[_block(bq, n, h, lambda b_, i: (b_, i, 0))] * 2,
      out_specs=pl.BlockSpec((None, n, 1, bq), lambda b_, i: (b_, 0, 0, i)),
      out_shape=jax.ShapeDtypeStruct((b, n, 1, length), jnp.float32),
      scratch_shapes=_word_scratch(call.dtype, bq * n, bq * n, h=h),
      compiler_params=_mosaic_tpu.params(("parallel", "parallel"), vmem_limit_bytes, interpret),
      cost_estimate=pl.CostEstimate(flops=2 * b * length * n * h, transcendentals=0,
                                    bytes_accessed=b * length * n * (2 * h * item + 4)),
      interpret=interpret, name="jk_attention_delta_in_place",
  )(out, dout)


def _unpack(refs, call: Call, n_out: int):
  refs = list(refs)
  named = dict(zip(("q", "k", "v"), refs[:3]))
  rest = refs[3:]
  named["qs"], named["ks"] = (rest.pop(0), rest.pop(0)) if call.segments else (None, None)
  named["do"], named["lse"], named["delta"] = rest[:3]
  return named, rest[3:3 + n_out], rest[3 + n_out:]


def _loop_heads(r, words, i, j, bq: int, bk: int, call: Call, step):
  """Calls ``step(n, c, q, k, do, p^T, ds^T)`` for every query head n (c its key head), the
  blocks read from ``words`` (q, k, v, dout: their 32-bit views)."""
  qs, ks, vs, dos = words
  mask = blocks.mask(i, j, bq, bk, call, _read(r["qs"]), _read(r["ks"]), keys_down=True)
  dtype, h = call.dtype, call.head_dim

  def head(n, c, k, v):
    q, do = _head(qs, n, call.heads, bq, dtype, h), _head(dos, n, call.heads, bq, dtype, h)
    p, ds = _grads_t(q, k, v, do, r["lse"][n], r["delta"][n], mask, call)
    step(n, c, q, k, do, p, ds)

  _each_head(call, lambda c: (_head(ks, c, call.kv_heads, bk, dtype, h),
                              _head(vs, c, call.kv_heads, bk, dtype, h)),
             lambda n, k, v: head(n, n // call.group, k, v))


def _dkdv_kernel(*refs, call: Call, bq: int, bk: int):
  r, (dk_ref, dv_ref), scratch = _unpack(refs, call, 2)
  dk_sc, dv_sc, *words = scratch
  words = words or [None] * 6
  j, i = pl.program_id(1), pl.program_id(2)

  @pl.when(i == 0)
  def _():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  first = i == _first_query_block(j, bq, bk, call)
  ks, vs = _words_once(r["k"], words[1], first), _words_once(r["v"], words[2], first)

  @pl.when(blocks.visit_queries(j, i, bq, bk, call)[0])
  def _():
    qs, dos = _words(r["q"], words[0]), _words(r["do"], words[3])

    def step(n, c, q, k, do, p, ds):
      del n, k
      dv_sc[c] += dot(p.astype(do.dtype), do, call)
      dk_sc[c] += dot(ds.astype(q.dtype), q, call)
    _loop_heads(r, (qs, ks, vs, dos), i, j, bq, bk, call, step)

  @pl.when(i == pl.num_programs(2) - 1)
  def _():
    h = call.head_dim
    _store_heads(dk_ref, words[4], call.kv_heads, bk, lambda c: dk_sc[c] * call.scale, h)
    _store_heads(dv_ref, words[5], call.kv_heads, bk, lambda c: dv_sc[c], h)


def _dq_kernel(*refs, call: Call, bq: int, bk: int):
  r, (dq_ref,), scratch = _unpack(refs, call, 1)
  dq_sc, *words = scratch
  words = words or [None] * 5
  i, j = pl.program_id(1), pl.program_id(2)

  @pl.when(j == 0)
  def _():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  first = j == _first_key_block(i, bq, bk, call)
  qs, dos = _words_once(r["q"], words[0], first), _words_once(r["do"], words[3], first)

  @pl.when(blocks.visit(i, j, bq, bk, call)[0])
  def _():
    ks, vs = _words(r["k"], words[1]), _words(r["v"], words[2])

    def step(n, c, q, k, do, p, ds):
      del c, q, do, p
      dq_sc[n] += dot(k, ds.astype(k.dtype), call, ta=True)
    _loop_heads(r, (qs, ks, vs, dos), i, j, bq, bk, call, step)

  @pl.when(j == pl.num_programs(2) - 1)
  def _():
    _store_heads(dq_ref, words[4], call.heads, bq, lambda n: (dq_sc[n] * call.scale).T,
                 call.head_dim)


def backward(q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, window: Window, scale: float,
             soft_cap: float | None, config, interpret=False):
  call = Call.of(q, k, None, q_seg, window=window, scale=scale, soft_cap=soft_cap)
  b, t, n, h = q.shape
  s, kv_heads = call.kv_len, call.kv_heads
  bq, bk = config.bwd_block_q, config.bwd_block_k
  t_pad, s_pad = round_up(t, bq), round_up(s, bk)
  n_q, n_k = t_pad // bq, s_pad // bk
  dout_viewed = _interleaved(dout, t_pad)
  delta = _delta(_interleaved(out, t_pad), dout_viewed, call, t_pad, bq,
                 config.vmem_limit_bytes, interpret)
  if dlse is not None:
    delta = delta - _rows(dlse, t_pad)
  inputs = [_interleaved(q, t_pad), _interleaved(k, s_pad), _interleaved(v, s_pad)]
  seg_arrays = []
  if q_seg is not None:
    seg_arrays = [blocks.segments(q_seg, t_pad, -1)[:, None, :],
                  blocks.segments(kv_seg, s_pad, -2)[:, :, None]]
  inputs += seg_arrays + [dout_viewed, _rows(lse, t_pad), delta]

  def specs(where):
    """BlockSpecs of the inputs for a grid whose index maps give (b, i, j) by ``where``."""
    at = lambda f: (lambda *ids: f(*where(*ids)))
    queries = _block(bq, n, h, at(lambda b_, i, j: (b_, i, 0)))
    keys = _block(bk, kv_heads, h, at(lambda b_, i, j: (b_, j, 0)))
    rows = pl.BlockSpec((None, n, 1, bq), at(lambda b_, i, j: (b_, 0, 0, i)))
    segs = [pl.BlockSpec((None, 1, bq), at(lambda b_, i, j: (b_, 0, i))),
            pl.BlockSpec((None, bk, 1), at(lambda b_, i, j: (b_, j, 0)))] if seg_arrays else []
    return [queries, keys, keys, *segs, queries, rows, rows]

  params = _mosaic_tpu.params(("parallel", "parallel", "arbitrary"), config.vmem_limit_bytes,
                              interpret)
  costs = blocks.costs(call, bq, bk, shared_kv=True)

  def dkdv_where(b_, j, i):
    return b_, blocks.visit_queries(j, i, bq, bk, call)[1], j

  kv_out = _block(bk, kv_heads, h, lambda b_, j, i: (b_, j, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, call=call, bq=bq, bk=bk),
      grid=(b, n_k, n_q),
      in_specs=specs(dkdv_where),
      out_specs=[kv_out, kv_out],
      out_shape=[jax.ShapeDtypeStruct(_viewed(b, s_pad, kv_heads, h), k.dtype)] * 2,
      scratch_shapes=[_scratch((kv_heads, bk, h)), _scratch((kv_heads, bk, h)),
                      *_word_scratch(q.dtype, bq * n, bk * kv_heads, bk * kv_heads, bq * n,
                                     bk * kv_heads, bk * kv_heads, h=h)],
      compiler_params=params, cost_estimate=costs["dkdv"],
      interpret=interpret, name="jk_attention_dkdv_in_place",
  )(*inputs)

  def dq_where(b_, i, j):
    return b_, i, blocks.visit(i, j, bq, bk, call)[1]

  dq = pl.pallas_call(
      functools.partial(_dq_kernel, call=call, bq=bq, bk=bk),
      grid=(b, n_q, n_k),
      in_specs=specs(dq_where),
      out_specs=_block(bq, n, h, lambda b_, i, j: (b_, i, 0)),
      out_shape=jax.ShapeDtypeStruct(_viewed(b, t_pad, n, h), q.dtype),
      scratch_shapes=[_scratch((n, h, bq)),
                      *_word_scratch(q.dtype, bq * n, bk * kv_heads, bk * kv_heads, bq * n,
                                     bq * n, h=h)],
      compiler_params=params, cost_estimate=costs["dq"],
      interpret=interpret, name="jk_attention_dq_in_place",
  )(*inputs)
  return (_positions(dq, b, t_pad, n, h, t), _positions(dk, b, s_pad, kv_heads, h, s),
          _positions(dv, b, s_pad, kv_heads, h, s), None)
