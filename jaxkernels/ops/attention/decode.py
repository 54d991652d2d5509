"""decode_attention: validation, dispatch and the custom_vjp boundary. A few new queries
against a KV cache, the cache split over the SMs (flash-decoding); its checks and split rule
are flash_attention's (``api``), its kernels its own."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jaxkernels import _checks, backend, dispatch
from jaxkernels._tiling import bucket
from jaxkernels.ops.attention import api, mosaic_tpu_decode, reference
from jaxkernels.ops.attention.mosaic_gpu import decode as mosaic_gpu_decode
from jaxkernels.ops.attention.common import dtype_reason

DECODE_OP = "decode_attention"


@dataclasses.dataclass(frozen=True)
class DecodeProblem:
  """One decode call: q (B, Tq, N, H) new queries against caches (B, S, K, H)."""

  batch: int
  q_len: int
  kv_len: int
  heads: int
  kv_heads: int
  head_dim: int
  dtype: jnp.dtype
  soft_cap: bool
  window: bool

  def key(self) -> str:
    extras = "".join(f"|{name}" for name, on in (("cap", self.soft_cap), ("window", self.window))
                     if on)
    return (f"{self.dtype}|h{self.head_dim}|g{self.heads // self.kv_heads}|q{self.q_len}{extras}|"
            f"b{bucket(self.batch * self.kv_heads)}|{bucket(self.kv_len)}")

  def reason(self) -> str | None:
    return dtype_reason(self.dtype)

  def __str__(self) -> str:
    return (f"decode of q ({self.batch}, {self.q_len}, {self.heads}, {self.head_dim}) against a "
            f"cache ({self.batch}, {self.kv_len}, {self.kv_heads}, {self.head_dim}) {self.dtype}")


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class DecodeArgs(backend.Args):
  """A decode_attention call's validated arguments: q (..., Tq, N, H), the caches as k and v
  (..., S, K, H), lengths (...); the scale a float, the soft cap None or a float, the window
  the keys behind each query (None: all)."""

  q: jax.Array
  k: jax.Array
  v: jax.Array
  lengths: jax.Array
  scale: float
  soft_cap: float | None
  window_left: int | None


def _validate_decode(q, k_cache, v_cache, *, lengths, scale, logits_soft_cap,
                     local_window_size) -> DecodeArgs:
  args = api.validate(q, k_cache, v_cache, op=DECODE_OP, names=("q", "k_cache", "v_cache"),
                   causal=False, scale=scale, bias=None, segment_ids=None,
                   kv_segment_ids=None, local_window_size=None, logits_soft_cap=logits_soft_cap)
  batch = args.q.shape[:-3]
  if lengths is None:
    raise ValueError(f"{DECODE_OP}: lengths is required: the number of valid cache entries of "
                     "each sequence, the new queries' own included")
  if not (hasattr(lengths, "shape") and hasattr(lengths, "dtype")):
    lengths = jnp.asarray(lengths)
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(f"{DECODE_OP}: lengths must have an integer dtype, got "
                    f"{jnp.dtype(lengths.dtype)}")
  if api.shape_of(lengths) != batch:
    raise ValueError(f"{DECODE_OP}: lengths must have shape {batch} (q's batch), got "
                     f"{api.shape_of(lengths)}")
  cache = args.k.shape[-3]
  said = f"{DECODE_OP}: lengths must be in [0, {cache}] (the caches' length S), got "
  if not isinstance(lengths, jax.core.Tracer):  # known now (not under jit): checked
    known = np.asarray(lengths)
    if known.size and (known.max() > cache or known.min() < 0):
      bad = known.max() if known.max() > cache else known.min()
      raise ValueError(said + f"{int(bad)}")
  else:  # known when it runs: checked under checkify, else clipped into [0, S]
    outside = (lengths < 0) | (lengths > cache)
    _checks.traced_check(~outside.any(), said + "{value} at lengths[{where}]", at=outside,
                         value=lengths, debug=True)
    lengths = jnp.clip(lengths, 0, cache)
  window_left = None
  if local_window_size is not None:
    if isinstance(local_window_size, bool) or not isinstance(local_window_size, numbers.Integral):
      raise TypeError(f"{DECODE_OP}: local_window_size must be an int (keys behind each query), "
                      f"got {local_window_size!r}")
    if local_window_size < 0:
      raise ValueError(f"{DECODE_OP}: local_window_size must be >= 0, got {local_window_size}")
    window_left = int(local_window_size)
  return DecodeArgs(q=args.q, k=args.k, v=args.v, lengths=lengths, scale=args.scale,
                    soft_cap=args.soft_cap, window_left=window_left)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5))
def _decode(plan, q, k, v, lengths, window_left):
  return plan.run(plan.kernels.forward, q, k, v, lengths, window_left=window_left)


def _decode_reference(plan, window_left):
  options = dict(plan.options)
  return lambda q, k, v, lengths: reference.decode(
      q, k, v, lengths, scale=options["scale"], soft_cap=options["soft_cap"],
      window_left=window_left)


def _decode_fwd(plan, q, k, v, lengths, window_left):
  return _decode(plan, q, k, v, lengths, window_left), (q, k, v, lengths)


def _decode_bwd(plan, window_left, saved, dout):
  # Decode is inference's op; its gradient, where asked for, is the reference's: with few
  # queries its (B, N, Tq, S) logits are small.
  q, k, v, lengths = saved
  _, vjp = jax.vjp(lambda q, k, v: _decode_reference(plan, window_left)(q, k, v, lengths),
                   q, k, v)
  return (*vjp(dout), None)


_decode.defvjp(_decode_fwd, _decode_bwd)


def decode_attention(q, k_cache, v_cache, *, lengths, scale: float | None = None,
                     logits_soft_cap: float | None = None, local_window_size: int | None = None,
                     implementation=None, config=None):
  """Attention of a few new queries (decoding) against a KV cache, split along the cache over
  the GPU's SMs (or a TPU's TensorCores) and combined by log-sum-exp (flash-decoding).

  Args:
    q: (..., Tq, N, H) new queries, Tq small (1-16; the kernel takes up to 64 rows a group);
      any leading batch dims, or none (then ``lengths`` is a scalar).
    k_cache, v_cache: (..., S, K, H), N a multiple of K; entries past a sequence's length are
      never read.
    lengths: (...) integers in [0, S]: the valid entries of each sequence's cache, the new
      queries' own keys and values included: query t sits at position lengths - Tq + t and
      sees the keys at positions up to its own. A length outside [0, S] raises a ValueError
      at once where ``lengths`` is concrete; traced (under jit, where decode loops run) it is
      clipped into [0, S], as JAX clips an out-of-range index, unless the function runs under
      ``jax.experimental.checkify.checkify``: then ``err.throw()`` raises a ValueError
      naming the length and where it is.
    scale, logits_soft_cap: as for flash_attention.
    local_window_size: int: each query also sees no key more than this far behind it.
    implementation: None (best available), "xla", "mosaic_gpu" (Hopper), "triton",
      "mosaic_tpu".

  Returns (..., Tq, N, H) in q's dtype; 0 for a query that sees no key. Differentiable (the
  reference's gradient).
  """
  unbatched = api.is_unbatched(q)  # (Tq, N, H) against (S, K, H) caches, lengths a scalar
  if unbatched:  # a batch of one
    q, k_cache, v_cache, lengths = api.batch_of_one(q, k_cache, v_cache, lengths)
  out = backend.call(_DECODE_OP, implementation, config, q=q, k_cache=k_cache, v_cache=v_cache,
                     lengths=lengths, scale=scale, logits_soft_cap=logits_soft_cap,
                     local_window_size=local_window_size)
  return out[0] if unbatched else out


def _decode_problem(args: DecodeArgs) -> DecodeProblem:
  q, k = args.q, args.k
  t, n, h = q.shape[-3:]
  return DecodeProblem(math.prod(q.shape[:-3]), t, k.shape[-3], n, k.shape[-2], h,
                       jnp.dtype(q.dtype), args.soft_cap is not None,
                       args.window_left is not None)


def _decode_kernel(plan: dispatch.Plan, args: DecodeArgs):
  q = args.q
  out = _decode(plan, api.flat(q, 3), api.flat(args.k, 3), api.flat(args.v, 3),
                args.lengths.reshape(-1), args.window_left)
  return out.reshape(q.shape)


def _decode_reference_call(args: DecodeArgs):
  q = args.q
  if args.k.shape[-3] == 0 or q.size == 0:
    return jnp.zeros(q.shape, q.dtype)
  out = reference.decode(api.flat(q, 3), api.flat(args.k, 3), api.flat(args.v, 3),
                         args.lengths.reshape(-1), scale=args.scale, soft_cap=args.soft_cap,
                         window_left=args.window_left)
  return out.reshape(q.shape)


_DECODE_OP = backend.register(backend.Op(
    name=DECODE_OP,
    kernels={
        "mosaic_gpu": dispatch.Kernels.of(DECODE_OP, "mosaic_gpu", mosaic_gpu_decode,
                                         forward=mosaic_gpu_decode.forward),
        **dispatch.triton_kernels(DECODE_OP, "jaxkernels.ops.attention.triton_decode",
                                  forward="forward"),
        "mosaic_tpu": dispatch.Kernels.of(DECODE_OP, "mosaic_tpu", mosaic_tpu_decode,
                                         forward=mosaic_tpu_decode.forward),
    },
    validate=_validate_decode, problem=_decode_problem, reference=_decode_reference_call,
    kernel=_decode_kernel,
    options=lambda args: dict(scale=args.scale, soft_cap=args.soft_cap),
    rule=functools.partial(api.split_rule, ring=False),
    out=lambda rule, args: api.out_dims(rule)[0],
), decode_attention)
