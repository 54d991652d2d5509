"""What every attention backend shares: the mask, as a function of query and key positions.

Semantics are those of ``jax.nn.dot_product_attention``: query i sits at position i and key j
at position j (top-left aligned where T != S); ``causal`` lets i see j <= i; a window (left,
right) lets i see i - left <= j <= i + right; segment ids let i see j only where they are
equal. The reference applies it to the whole (T, S) matrix; a kernel to one block, from the
block's row and column positions, and skips blocks that it hides whole (:func:`key_blocks`,
:func:`query_blocks`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from jaxkernels import _checks
from jaxkernels._tiling import bucket

# The widest head every attention kernel takes (and the reference: one limit, said once).
MAX_HEAD_DIM = 256

# A bound that no position reaches: a side of the window that is open. Positions are int32 in
# the kernels, and T + S + UNBOUNDED must not overflow.
UNBOUNDED = 1 << 30


class Window(NamedTuple):
  """How far a query sees behind (left) and ahead (right) of its own position; None: no
  limit on that side. ``causal`` is right = 0."""

  left: int | None
  right: int | None

  @classmethod
  def of(cls, causal: bool, local_window_size) -> Window:
    left = right = None
    if isinstance(local_window_size, int):
      local_window_size = (local_window_size, local_window_size)
    if local_window_size is not None:
      left, right = local_window_size
    if causal:
      right = 0 if right is None else min(right, 0)
    return cls(left, right)

  @property
  def plain_causal(self) -> bool:
    """Causal and nothing else: every key up to the query's own position."""
    return self == (None, 0)

  @property
  def bounded(self) -> bool:
    return self.left is not None or self.right is not None

  @property
  def span(self) -> tuple[int, int]:
    """(left, right) as ints, UNBOUNDED where open."""
    return (UNBOUNDED if self.left is None else self.left,
            UNBOUNDED if self.right is None else self.right)


def dtype_reason(dtype) -> str | None:
  if dtype not in _checks.KERNEL_DTYPES:
    return f"q has dtype {dtype}; kernels take bfloat16, float16, float32"
  return None


@dataclasses.dataclass(frozen=True)
class Problem:
  """One attention call as its kernels see it: q (B, T, N, H), k and v (B, S, K, H), the mask's
  kind and the logits' extras."""

  batch: int
  q_len: int
  kv_len: int
  heads: int
  kv_heads: int
  head_dim: int
  dtype: jnp.dtype
  window: Window
  soft_cap: bool
  bias: tuple[int, int] | None  # (Bb, Nb): the bias's batch and heads (1: broadcast)
  segments: bool

  def key(self) -> str:
    mask = ("causal" if self.window.plain_causal else
            "window" if self.window.bounded else "full")
    extras = "".join(f"|{name}" for name, on in (("cap", self.soft_cap),
                                                  ("bias", self.bias is not None),
                                                  ("segments", self.segments)) if on)
    return (f"{self.dtype}|h{self.head_dim}|g{self.heads // self.kv_heads}|{mask}{extras}|"
            f"{bucket(self.q_len)}x{bucket(self.kv_len)}")

  def reason(self) -> str | None:
    return dtype_reason(self.dtype)

  def __str__(self) -> str:
    return (f"attention of q ({self.batch}, {self.q_len}, {self.heads}, {self.head_dim}) against "
            f"k/v ({self.batch}, {self.kv_len}, {self.kv_heads}, {self.head_dim}) {self.dtype}")


def visible(rows, cols, window: Window, q_segments=None, kv_segments=None):
  """Whether query position ``rows`` sees key position ``cols`` (broadcast together: a
  (bq, 1) column of rows against a (1, bk) row of columns gives the (bq, bk) block), or None
  where every pair is visible."""
  out = None

  def both(a, b):
    return b if a is None else a & b

  if window.left is not None:
    out = both(out, cols >= rows - window.left)
  if window.right is not None:
    out = both(out, cols <= rows + window.right)
  if q_segments is not None:
    out = both(out, q_segments == kv_segments)
  return out


def key_blocks(row0, rows: int, block: int, n_keys: int, window: Window):
  """For queries [row0, row0 + rows), the key blocks of width ``block`` to visit, as
  (first, full_first, full_end, end): blocks [first, end) hold a visible key; those in
  [full_first, full_end) are visible to every one of the queries (no position mask needed,
  nor a mask for the keys' end). Every other block is hidden whole and skipped. Works on
  Python ints and on traced int32 scalars alike."""
  left, right = window.span
  last = row0 + rows - 1
  lo = jnp.maximum(row0 - left, 0)
  hi = jnp.minimum(last + right + 1, n_keys)  # one past the last visible key
  first = lo // block
  end = jnp.where(hi > lo, (hi + block - 1) // block, first)  # nothing visible: no block
  full_lo = jnp.maximum(last - left, 0)
  full_hi = jnp.minimum(row0 + right + 1, n_keys)  # one past
  full_first = jnp.clip((full_lo + block - 1) // block, first, end)
  full_end = jnp.clip(full_hi // block, full_first, end)
  return first, full_first, full_end, end


def query_blocks(col0, cols: int, block: int, n_queries: int, window: Window):
  """For keys [col0, col0 + cols), the query blocks of height ``block`` to visit, as
  :func:`key_blocks` gives key blocks for queries: the window seen from the keys' side
  (query i sees key j iff j - right <= i <= j + left)."""
  return key_blocks(col0, cols, block, n_queries, Window(window.right, window.left))


@dataclasses.dataclass(frozen=True)
class Call:
  """One call as every kernel of it reads it: shapes (q (B, T, N, H), k and v (B, S, K, H)),
  the mask and the logits' extras, all static."""

  batch: int
  q_len: int
  kv_len: int
  heads: int
  kv_heads: int
  head_dim: int
  window: Window
  scale: float
  soft_cap: float | None
  bias_shape: tuple[int, ...] | None  # (Bb, Nb, T, S), Bb in {1, B}, Nb in {1, N}
  segments: bool
  dtype: jnp.dtype

  @classmethod
  def of(cls, q, k, bias, q_seg, *, window: Window, scale: float,
         soft_cap: float | None) -> Call:
    b, t, n, h = q.shape
    return cls(b, t, k.shape[1], n, k.shape[2], h, window, float(scale), soft_cap,
               None if bias is None else tuple(bias.shape), q_seg is not None,
               jnp.dtype(q.dtype))

  @property
  def group(self) -> int:
    return self.heads // self.kv_heads

  @property
  def precision(self):
    """float32 inputs keep float32 products (IEEE); the default would round them (tf32)."""
    return lax.Precision.HIGHEST if self.dtype == jnp.float32 else None


def dot(a, b, call: Call, *, ta=False, tb=False):
  """a @ b (a^T with ``ta``, b^T with ``tb``) accumulated in float32, at the call's
  precision."""
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=call.precision,
                         preferred_element_type=jnp.float32)


def below_every_float(x):
  """Where ``x`` is -inf: ``jnp.isneginf`` without its -inf constant, which
  ``jax.debug_infs`` flags op by op (x < the dtype's least finite value is -inf alone)."""
  return x < jnp.finfo(x.dtype).min


def combine(o_part, lse_part, dtype):
  """Decode's chunks (flash-decoding): (splits, ...) partial outputs as one, weighted by
  exp(lse - max lse); 0 where no chunk saw a key."""
  peak = jnp.max(lse_part, axis=0, keepdims=True)  # keepdims: no implicit rank promotion
  safe = jnp.where(below_every_float(peak), 0.0, peak)
  w = jnp.exp(lse_part - safe)  # 0 for chunks that saw nothing
  total = jnp.sum(w, axis=0)
  out = jnp.sum(w[..., None] * o_part, axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
  return out.astype(dtype)
