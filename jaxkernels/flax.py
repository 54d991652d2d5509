"""Flax NNX drop-ins whose forward and backward are jaxkernels' ops, for people with their own
models: an ``attention_fn`` for ``nnx.MultiHeadAttention``, RMSNorm and LayerNorm (with the
pre-norm residual add fused in), the gated MLP, and the output head with the fused loss.

Parameters are float32 by default (``param_dtype``) and cast to ``dtype`` for the op, as Flax's
own layers do (the norms as Flax's: default, x and the parameters promoted together; the MLP
and the head: default, the input's). Every module takes
``implementation`` (None: the best kernel for the device; "xla": the references) and passes it
to its ops.

Fully sharded data parallelism: the layers with weight matrices take ``axes``, logical names
for their dimensions, which they record on each parameter (``nnx.get_partition_spec`` reads
them; the caller maps them onto mesh axes and places the parameters). A weight split over a
mesh is cast to ``dtype`` and gathered whole before its op (the gather moves ``dtype``'s
bytes); its gradient comes back split the same way (a reduce-scatter).

Example::

    from flax import nnx
    import jaxkernels.flax as jkf

    attention = nnx.MultiHeadAttention(num_heads=16, in_features=1024, decode=False,
                                       attention_fn=jkf.attention_fn, rngs=rngs)
    y = attention(x, is_causal=True)  # flash attention, causal without a (T, S) mask
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxkernels as jk
from jaxkernels import dispatch, interpret, partitioning, remat

Dtype = Any


def _promote_dtype(args, /, *, dtype=None, inexact=True):
  """Flax NNX's default ``promote_dtype`` (its rule, without importing a module Flax moves):
  the arrays of ``args`` (None kept) cast to ``dtype``, or where it is None to their promoted
  type (a floating one where ``inexact``)."""
  if dtype is None:
    dtype = jnp.result_type(*(a for a in args if a is not None))
    if inexact and not jnp.issubdtype(dtype, jnp.inexact):
      dtype = jnp.promote_types(jnp.float32, dtype)
  return tuple(None if a is None else jnp.asarray(a, dtype) for a in args)


def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                 dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                 precision=None, module=None, is_causal=False, *, implementation=None,
                 **unused):
  """``flax.nnx.dot_product_attention``'s signature on ``jaxkernels.flash_attention``.

  q (batch..., T, N, H), k and v (batch..., S, K, H) with N a multiple of K; the batch dims
  may be absent (q (T, N, H)), as Flax allows. ``is_causal``
  is the cheap mask (blocks above the diagonal skipped); a boolean ``mask`` (broadcastable
  to (batch..., N, T, S)) becomes an additive bias of the same shape (0, or a large finite
  negative as jax.nn's: jax.debug_infs stays quiet), with the
  memory of a (T, S) array and, on Hopper, the Triton backward: pass ``is_causal`` (or call
  ``flash_attention`` with segment ids and windows) where the mask is one of those. A query
  that sees no key gives 0 (Flax gives the mean of v). ``functools.partial`` picks
  ``implementation``.

  Raises:
    NotImplementedError: attention dropout (``dropout_rate`` > 0 and not deterministic), or
      asked for the attention weights (``module``: the module sows them), neither of which a
      flash kernel has.
  """
  del broadcast_dropout, dropout_rng, precision, unused
  if dropout_rate and not deterministic:
    raise NotImplementedError(
        f"jaxkernels.flax.attention_fn: attention dropout (dropout_rate={dropout_rate}) is not "
        "supported: flash attention never forms the weights it would drop; use dropout_rate=0 "
        "or deterministic=True")
  if module is not None:
    raise NotImplementedError(
        "jaxkernels.flax.attention_fn: the attention weights cannot be sown (flash attention "
        "never forms them); call the module with sow_weights=False")
  if dtype is not None:
    query, key, value = (x.astype(dtype) for x in (query, key, value))
  sees = None
  if mask is not None:
    mask = jnp.asarray(mask)
    mask = mask.reshape((1,) * (3 - mask.ndim) + mask.shape)  # (..., N, T, S)
    # jax.nn's finite stand-in for -inf: an -inf bias is flagged by jax.debug_infs op by op
    # (and made so here, it was, on every masked call). A row that sees no key then gets a
    # softmax of its own logits from the kernel; it is set to 0 after, as flash_attention
    # gives such a row, its gradient with it.
    masked = jnp.where(mask, 0.0, _HIDDEN).astype(jnp.float32)
    bias = masked if bias is None else bias + masked
    sees = jnp.swapaxes(jnp.any(mask, axis=-1), -1, -2)[..., None]  # (..., T, N, 1)
  # Flax allows inputs without batch dims, q (T, N, H) (MultiHeadAttention on a (T, features)
  # input); flash_attention takes (batch..., T, N, H): one batch of one, and the mask or bias,
  # broadcastable to (N, T, S), broadcasts to (1, N, T, S) as it is.
  unbatched = query.ndim == 3
  if unbatched:
    query, key, value = (x[None] for x in (query, key, value))
  out = jk.flash_attention(query, key, value, causal=is_causal, bias=bias,
                           implementation=implementation)
  if sees is not None:
    sees = sees.reshape((1,) * (out.ndim - sees.ndim) + sees.shape)
    out = jnp.where(sees, out, jnp.zeros((), out.dtype))
  return out[0] if unbatched else out


# A masked key's bias in attention_fn: a large finite negative, far below any logit and far
# enough from float32's edge that neither adding a logit nor the kernels' base-2 softmax
# (logits x log2 e = 1.44) overflows it to -inf: at -0.7 x max (jax.nn's) the Triton kernel's
# row maximum of a row that sees nothing became -inf, and jax.debug_infs stopped the call.
_HIDDEN = -0.5 * float(jnp.finfo(jnp.float32).max)


def _tag_norm(out, residual):
  """A norm's output tagged ``norm_out``, and with a residual the stream ``residual``."""
  if residual is None:
    return remat.tag(out, remat.NORM_OUT)
  y, h = out
  return remat.tag(y, remat.NORM_OUT), remat.tag(h, remat.RESIDUAL)


def _param(rngs: nnx.Rngs | None, init, shape, dtype, axes=None, metadata=None):
  """A parameter from ``init``; a norm's constant init needs no ``rngs`` (key 0 then).
  ``axes``: logical names of its dimensions, recorded for the caller to lay it out by (the
  parameter is created whole, wherever JAX puts it, never placed by Flax on creation).
  ``metadata``: more of nnx.Param's metadata (Flax's ``scale_metadata``, ``bias_metadata``)."""
  key = rngs.params() if rngs is not None else jax.random.key(0)
  if axes is None:
    return nnx.Param(init(key, shape, dtype), **dict(metadata or {}))
  if len(axes) != len(shape):
    raise ValueError(f"axes={axes!r} names {len(axes)} dimensions; the parameter has shape "
                     f"{shape}")
  return nnx.Param(init(key, shape, dtype), out_sharding=tuple(axes), eager_sharding=False)


def whole_weight(value, dtype, implementation: str | None = None):
  """A weight in ``dtype`` as an op called with ``implementation`` takes it, under fully
  sharded data parallelism (the weight split over data-like mesh axes, those of
  ``jaxkernels.partitioning.DATA_AXES``: "data", "fsdp", ...; on a mesh of Explicit axes).
  Cast first, so that a gather moves ``dtype``'s bytes. Our ops (any implementation but
  "xla") gather such a weight in their own map, where its gradient leaves as a
  reduce-scatter; XLA's ops take it gathered here (jnp's product refuses operands split over
  one axis along two dimensions), and under ``jax.grad`` the gather's transpose sums the
  gradient back onto the split. A split over another axis ("tensor", say) is model
  parallelism and stays: the op runs per shard (a column- or row-parallel matmul, the
  vocabulary-parallel loss)."""
  w = value.astype(dtype)
  if implementation != "xla":
    return w
  spec = tuple(jax.typeof(w).sharding.spec)
  kept = tuple(partitioning.entry(tuple(a for a in partitioning.axes(e)
                                        if a not in partitioning.DATA_AXES)) for e in spec)
  if kept != spec:
    w = jax.sharding.reshard(w, P(*kept))
  return w


def _last_axis(name, owner, value, ndim):
  """Whether ``value`` (Flax's reduction_axes or feature_axes) names only the last axis."""
  axes = (value,) if isinstance(value, int) else tuple(value)
  if len(axes) != 1 or axes[0] % ndim != ndim - 1:
    raise ValueError(f"jaxkernels.flax.{owner}: {name}={value!r}: the kernels normalize over "
                     f"the last axis alone (-1), for x of rank {ndim}; use flax.nnx.{owner} "
                     "for other axes")


class _Norm(nnx.Module):
  """What RMSNorm and LayerNorm share: Flax's constructor arguments, and its dtype rule
  (``promote_dtype`` over x and the parameters, ``dtype`` forcing one)."""

  def _setup(self, owner, num_features, epsilon, dtype, param_dtype, use_scale, scale_init,
             reduction_axes, feature_axes, axis_name, axis_index_groups, use_fast_variance,
             promote_dtype, implementation, rngs, scale_metadata):
    for name, value in (("axis_name", axis_name), ("axis_index_groups", axis_index_groups)):
      if value is not None:
        raise ValueError(f"jaxkernels.flax.{owner}: {name}={value!r}: statistics across "
                         "devices (a batch norm's) do not apply to a norm over each row's own "
                         "features; leave it None")
    self.owner, self.num_features = owner, num_features
    self.scale = (_param(rngs, scale_init, (num_features,), param_dtype,
                         metadata=scale_metadata) if use_scale else None)
    self.epsilon, self.dtype, self.param_dtype = epsilon, dtype, param_dtype
    self.use_scale, self.reduction_axes, self.feature_axes = use_scale, reduction_axes, feature_axes
    # The kernels' statistics are their own (float32, LayerNorm's variance around a pivot: as
    # exact as the two-pass form): Flax's fast-variance switch is taken and changes nothing.
    self.use_fast_variance = use_fast_variance
    self.promote_dtype, self.implementation = promote_dtype, implementation

  def _inputs(self, x, *params):
    for name in ("reduction_axes", "feature_axes"):
      _last_axis(name, self.owner, getattr(self, name), jnp.ndim(x))
    x, *params = self.promote_dtype((x, *params), dtype=self.dtype)
    return x, params

  def _scale(self, scale, x):
    """The scale, or ones where ``use_scale`` made none (the kernels take one)."""
    return jnp.ones((self.num_features,), x.dtype) if scale is None else scale

  def _apply(self, op, x, residual, mask, scale, bias=()):
    """``op`` (the public norm, its parameters bound) over x, Flax's output dtype and mask.

    Flax casts its output to ``dtype``, else to x's and the parameters' promoted type: ours
    too, whatever ``promote_dtype`` did to them (one that does not cast left x float32 and
    our output float32 where Flax's was ``dtype``'s). A ``mask`` (broadcastable to x) takes
    the statistics over the elements it keeps, as Flax's: where it is the same along the
    features (a token's padding mask, its last axis 1), the kernels' whole-row statistics
    are those, and a row it masks whole is NaN, Flax's mean over no element; a mask that
    varies within a row runs the statistics in XLA (:func:`_masked_norm`), with a one-time
    FallbackWarning."""
    params = (scale, *bias)
    dtype = self.dtype or jnp.result_type(*(a for a in (x, *params) if a is not None))
    if (wide := jnp.promote_types(x.dtype, dtype)) != x.dtype:  # rounded once, to dtype
      x = x.astype(wide)  # (bfloat16 x for a float16 output: through bfloat16 it was twice)
    if mask is not None:
      mask = jnp.asarray(mask, bool)
      try:
        jnp.broadcast_shapes(mask.shape, jnp.shape(x))
      except ValueError:
        raise ValueError(f"jaxkernels.flax.{self.owner}: mask of shape {mask.shape} does not "
                         f"broadcast to x's {jnp.shape(x)}") from None
    if mask is not None and mask.shape[-1:] != (1,) and mask.ndim:
      dispatch.warn_fallback(self.owner, f"jaxkernels.flax.{self.owner}: a mask that varies "
                             "within a row: its statistics run in XLA (the kernels normalize "
                             "whole rows); a token's mask, its last axis 1, runs the kernels")
      h = x if residual is None else x + residual
      y = _masked_norm(h, mask, scale, bias[0] if bias else None, self.epsilon,
                       centred=self.owner == "LayerNorm")
      out = y if residual is None else (y, h)
    else:
      out = op(x, self._scale(scale, x), *bias, eps=self.epsilon, residual=residual,
               implementation=self.implementation)
      if mask is not None:  # whole rows kept or masked: masked rows are Flax's NaN
        row = jnp.broadcast_to(mask, jnp.shape(x)[:-1] + (1,))
        y = out if residual is None else out[0]
        y = jnp.where(row, y, jnp.asarray(jnp.nan, y.dtype))
        out = y if residual is None else (y, out[1])
    if residual is None:
      out = out.astype(dtype)
    else:
      out = (out[0].astype(dtype), out[1])
    return _tag_norm(out, residual)


def _masked_norm(h, mask, scale, bias, eps: float, centred: bool):
  """Flax's masked statistics (float32, over the elements ``mask`` keeps), every element
  normalized by them."""
  h32 = h.astype(jnp.float32)
  mask = jnp.broadcast_to(mask, h.shape)
  mean = jnp.mean(h32, axis=-1, keepdims=True, where=mask) if centred else 0.0
  var = jnp.mean(jnp.square(h32 - mean), axis=-1, keepdims=True, where=mask)
  y = (h32 - mean) * jax.lax.rsqrt(var + eps)
  if scale is not None:
    y = y * scale.astype(jnp.float32)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(h.dtype)


class RMSNorm(_Norm):
  """RMSNorm over the last axis; ``norm(x, residual=r)`` returns ``(y, h)`` with h = x + r and
  y = rms_norm(h) from one pass over memory (the pre-norm block's residual add). Takes
  ``flax.nnx.RMSNorm``'s arguments, its dtype rule (x and the scale promoted together,
  ``dtype`` forcing one, the output cast to it) and its ``mask`` (statistics over the kept
  elements): what cannot apply to a row kernel (statistics across devices, axes other than
  the last) is refused by name."""

  def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Dtype | None = None,
               param_dtype: Dtype = jnp.float32, use_scale: bool = True,
               scale_init=nnx.initializers.ones, reduction_axes=-1, feature_axes=-1,
               axis_name: str | None = None, axis_index_groups: Any = None,
               use_fast_variance: bool = True, promote_dtype=_promote_dtype,
               implementation: str | None = None, rngs: nnx.Rngs | None = None,
               scale_metadata=None):
    self._setup("RMSNorm", num_features, epsilon, dtype, param_dtype, use_scale, scale_init,
                reduction_axes, feature_axes, axis_name, axis_index_groups, use_fast_variance,
                promote_dtype, implementation, rngs, scale_metadata)

  def __call__(self, x, residual=None, mask=None):
    x, (scale,) = self._inputs(x, None if self.scale is None else self.scale[...])
    return self._apply(jk.rms_norm, x, residual, mask, scale)


class LayerNorm(_Norm):
  """LayerNorm over the last axis, with the same fused residual as :class:`RMSNorm`, taking
  ``flax.nnx.LayerNorm``'s arguments as RMSNorm takes RMSNorm's."""

  def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Dtype | None = None,
               param_dtype: Dtype = jnp.float32, use_bias: bool = True, use_scale: bool = True,
               bias_init=nnx.initializers.zeros, scale_init=nnx.initializers.ones,
               reduction_axes=-1, feature_axes=-1, axis_name: str | None = None,
               axis_index_groups: Any = None, use_fast_variance: bool = True,
               promote_dtype=_promote_dtype, implementation: str | None = None,
               rngs: nnx.Rngs | None = None, bias_metadata=None, scale_metadata=None):
    self._setup("LayerNorm", num_features, epsilon, dtype, param_dtype, use_scale, scale_init,
                reduction_axes, feature_axes, axis_name, axis_index_groups, use_fast_variance,
                promote_dtype, implementation, rngs, scale_metadata)
    self.use_bias = use_bias
    self.bias = (_param(rngs, bias_init, (num_features,), param_dtype, metadata=bias_metadata)
                 if use_bias else None)

  def __call__(self, x, residual=None, mask=None):
    x, (scale, bias) = self._inputs(x, None if self.scale is None else self.scale[...],
                                    None if self.bias is None else self.bias[...])
    return self._apply(jk.layer_norm, x, residual, mask, scale, (bias,))


class GLUMLP(nnx.Module):
  """The gated MLP: ``down(act(x @ gate) * (x @ up))`` (SwiGLU with "silu", GeGLU with
  "gelu"): the gate and up projections one matmul of x against their weights stacked,
  ``gate_up`` (in, 2, hidden) (x read once), with the gate's activation and product in its
  epilogue (``matmul(glu=True)``: one kernel on mosaic_gpu, else the product and one fused
  ``glu`` pass reading both halves in place), the hidden activations tagged ``mlp_hidden``
  for the remat policies. Split over its hidden width (tensor parallelism) each shard's
  slice of ``gate_up`` holds its own gate and up columns: the first product column-parallel,
  ``down`` row-parallel, one sum across the shards."""

  def __init__(self, in_features: int, hidden_features: int, *, activation: str = "silu",
               dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
               kernel_init=nnx.initializers.lecun_normal(), implementation: str | None = None,
               axes: tuple[str | None, str | None] | None = None, fp8: bool = False,
               rngs: nnx.Rngs):
    """``axes``: (the features' name, the hidden dimension's name) for the parameters' layout:
    gate_up is (in, 2, hidden), down (hidden, in). ``fp8``: both products in fp8, forward and
    backward (``jk.fp8_matmul``; sizes multiples of 128, weights not split over a mesh): the
    first against gate_up side by side, (in, 2 hidden), then ``glu`` on its halves."""
    # Initialized as the (in, 2 hidden) side-by-side matrix (its fan-in, its values) and
    # stacked: [:, 0] the gate's columns, [:, 1] up's.
    stacked = lambda key, shape, dtype: kernel_init(key, (shape[0], 2 * shape[2]),
                                                    dtype).reshape(shape)
    self.gate_up = _param(rngs, stacked, (in_features, 2, hidden_features), param_dtype,
                          None if axes is None else (axes[0], None, axes[1]))
    self.down = _param(rngs, kernel_init, (hidden_features, in_features), param_dtype,
                       None if axes is None else axes[::-1])
    self.hidden, self.activation = hidden_features, activation
    self.dtype, self.implementation, self.fp8 = dtype, implementation, fp8

  def __call__(self, x):
    dtype = self.dtype or x.dtype
    matmul = functools.partial(jk.fp8_matmul if self.fp8 else jk.matmul,
                               implementation=self.implementation)
    weight = lambda w: whole_weight(w, dtype, self.implementation)
    if self.fp8:
      gate_up = weight(self.gate_up[...])
      hidden = jk.glu(matmul(x.astype(dtype), gate_up.reshape(gate_up.shape[0], -1)),
                      activation=self.activation, implementation=self.implementation)
    else:
      hidden = matmul(x.astype(dtype), weight(self.gate_up[...]), activation=self.activation,
                      glu=True)
    hidden = remat.tag(hidden, remat.MLP_HIDDEN)
    return matmul(hidden, weight(self.down[...]))


class LMHead(nnx.Module):
  """The output projection and its loss: ``head(x)`` gives the logits; ``head(x, labels)``
  the fused cross-entropy (``linear_softmax_cross_entropy``: the (tokens, V) logits never
  held). ``tied``: an ``nnx.Embed`` whose table (V, D) is the projection, transposed."""

  def __init__(self, in_features: int, vocab: int, *, tied: nnx.Embed | None = None,
               dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
               kernel_init=nnx.initializers.lecun_normal(), implementation: str | None = None,
               axes: tuple[str | None, str | None] | None = None,
               rngs: nnx.Rngs | None = None):
    """``axes``: (the features' name, the vocabulary's name) for an untied kernel's layout."""
    if tied is None and rngs is None:
      raise ValueError("LMHead: an untied projection needs rngs for its initializer")
    self.tied = tied
    self.kernel = None if tied is not None else _param(rngs, kernel_init, (in_features, vocab),
                                                       param_dtype, axes)
    self.dtype, self.implementation = dtype, implementation

  def weight(self, dtype):
    w = self.tied.embedding[...].T if self.tied is not None else self.kernel[...]
    return whole_weight(w, dtype, self.implementation)

  def __call__(self, x, labels=None, **loss_options):
    """Logits (x's dtype), or with ``labels`` the loss (float32; ``loss_options``: those of
    ``linear_softmax_cross_entropy``, reduction "mean" by default)."""
    dtype = self.dtype or x.dtype
    x = x.astype(dtype)
    if labels is None:
      return jk.matmul(x, self.weight(dtype), implementation=self.implementation)
    return jk.linear_softmax_cross_entropy(x, self.weight(dtype), labels,
                                           implementation=self.implementation, **loss_options)


def checkpointed(apply, policy: str):
  """``nnx.remat(apply)`` under the remat policy named ``policy`` (``jaxkernels.remat``'s
  names: "none", "dots", "full", ...). The Mosaic TPU and GPU interpreters run a kernel
  through host callbacks, whose effects jax.checkpoint refuses: interpreted, "none" (which
  recomputes nothing) returns ``apply`` itself, and another policy is refused here rather than
  deep in JAX's partial evaluation."""
  if interpret.interpreter_has_effects():
    if policy == "none":
      return apply
    raise ValueError(
        f"remat={policy!r} cannot run with the Mosaic interpreters (their host callbacks have "
        "effects, which jax.checkpoint refuses): use remat='none', or "
        "JAXKERNELS_INTERPRET=triton (Pallas' generic interpreter, no callbacks)")
  return nnx.remat(apply, policy=remat.policy(policy))
