"""jaxkernels.flax: each NNX drop-in against Flax's own layer (or plain jnp) with the same
parameters, forward and gradients, on the kernels (interpreted Triton) and on XLA."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxkernels.flax as jkf
from tests import numerics

IMPLS = ["xla", "triton"]
TOL = dict(atol=2e-5, rtol=2e-5)  # float32 throughout: the kernels' and Flax's sums differ


def _x(*shape, tag="x"):
  return numerics.normal(numerics.rng("flax", shape, tag), shape, jnp.float32)


def _grads(module, fn, *args):
  """(output, the gradient of sum(output * ct) by the module's parameters), each one program
  (as a train step runs them; op by op, each of the module's primitives compiled on its own,
  took twice the time). In float32 products ("highest"): the GPU's default, tf32, rounds
  each side's operands apart where they differ in their last bits (a gradient's glu pass
  against XLA's), 1e-3 apart after the next product (H200, jax 0.12, seed 895108070)."""
  with jax.default_matmul_precision("highest"):
    out = nnx.jit(fn)(module, *args)
    ct = numerics.normal(numerics.rng("flax ct", out.shape), out.shape, jnp.float32)
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(fn(m, *args) * ct)))(module)
  return out, grads


@pytest.mark.parametrize("impl", IMPLS)
def test_rms_norm_matches_flax(impl):
  x, r = _x(4, 7, 96), _x(4, 7, 96, tag="r")
  ours = jkf.RMSNorm(96, implementation=impl, rngs=nnx.Rngs(0))
  theirs = nnx.RMSNorm(96, epsilon=1e-6, rngs=nnx.Rngs(0))
  ours.scale[...] = theirs.scale[...] = _x(96, tag="scale")
  with numerics.kernel_mode():
    y, g = _grads(ours, lambda m, x: m(x), x)
    y2, h = ours(x, residual=r)
  want, want_g = _grads(theirs, lambda m, x: m(x), x)
  chex.assert_trees_all_close(y, want, **TOL)
  chex.assert_trees_all_close(jax.tree.leaves(g), jax.tree.leaves(want_g), **TOL)
  chex.assert_trees_all_close(h, x + r, **TOL)
  chex.assert_trees_all_close(y2, theirs(x + r), **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_layer_norm_matches_flax(impl):
  x = _x(5, 64)
  ours = jkf.LayerNorm(64, implementation=impl, rngs=nnx.Rngs(0))
  theirs = nnx.LayerNorm(64, epsilon=1e-6, rngs=nnx.Rngs(0))
  ours.scale[...] = theirs.scale[...] = _x(64, tag="scale")
  ours.bias[...] = theirs.bias[...] = _x(64, tag="bias")
  with numerics.kernel_mode():
    y, g = _grads(ours, lambda m, x: m(x), x)
  want, want_g = _grads(theirs, lambda m, x: m(x), x)
  chex.assert_trees_all_close(y, want, **TOL)
  chex.assert_trees_all_close(jax.tree.leaves(g), jax.tree.leaves(want_g), **TOL)


def _all_float32(args, /, *, dtype=None, inexact=True):
  """A promote_dtype of the user's own (Flax's calling convention): everything float32."""
  del dtype, inexact
  return tuple(None if a is None else jnp.asarray(a, jnp.float32) for a in args)


def _as_they_are(args, /, *, dtype=None, inexact=True):
  """A promote_dtype that casts nothing: Flax still casts its output to ``dtype``."""
  del dtype, inexact
  return args


FLAX_NORM_ARGS = [  # Flax's constructor arguments, as Flax documents them
    dict(),
    dict(promote_dtype=_all_float32),
    dict(promote_dtype=_as_they_are, dtype=jnp.float16),
    dict(dtype=jnp.float32, param_dtype=jnp.float32, use_fast_variance=False),
    dict(use_scale=False, reduction_axes=-1, feature_axes=(-1,)),
    dict(epsilon=1e-3, scale_init=nnx.initializers.constant(0.5),
         scale_metadata={"tag": "norm scale"}),
    dict(reduction_axes=2, feature_axes=-1, use_fast_variance=True),
]


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("args", FLAX_NORM_ARGS, ids=range(len(FLAX_NORM_ARGS)))
def test_norms_take_flaxs_arguments(kind, args):
  """Constructed with flax.nnx's arguments, called as Flax calls them: the same parameters
  (and their metadata), the same output, dtype included (x promoted with the parameters:
  bfloat16 x and float32 scale give float32, as Flax's), the same gradients."""
  args = dict(args)
  if kind == "LayerNorm" and "use_scale" in args:
    args.update(use_bias=False, bias_metadata={"tag": "norm bias"})
  ours = getattr(jkf, kind)(32, rngs=nnx.Rngs(0), **args)
  theirs = getattr(nnx, kind)(32, rngs=nnx.Rngs(0), **args)
  assert jax.tree.map(jnp.shape, nnx.state(ours, nnx.Param)) == jax.tree.map(
      jnp.shape, nnx.state(theirs, nnx.Param))
  if "scale_metadata" in args:
    assert ours.scale.get_metadata()["tag"] == "norm scale"
  for x in (_x(3, 5, 32), _x(3, 5, 32).astype(jnp.bfloat16)):
    with numerics.kernel_mode():
      y, g = _grads(ours, lambda m, x: m(x), x)
    want, want_g = _grads(theirs, lambda m, x: m(x), x)
    assert y.dtype == want.dtype, (y.dtype, want.dtype)
    # Each output in its own dtype (cast inside the program, XLA may skip a bfloat16 rounding
    # under its excess precision: on the GPU Flax's bfloat16 output came back float32-exact).
    # A 16-bit output (x bfloat16 with no float32 parameter to promote it, or dtype float16)
    # may round to either neighbour of the exact value: one ulp of its dtype, relative.
    tol = TOL if y.dtype == jnp.float32 else dict(rtol=float(jnp.finfo(y.dtype).eps), atol=0)
    chex.assert_trees_all_close(y, want, **tol)
    chex.assert_trees_all_close(jax.tree.leaves(g), jax.tree.leaves(want_g), **TOL)


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_norms_refuse_what_a_row_kernel_cannot_do(kind):
  with pytest.raises(ValueError, match=f"jaxkernels.flax.{kind}: axis_name='batch': "
                     "statistics across devices"):
    getattr(jkf, kind)(8, axis_name="batch", rngs=nnx.Rngs(0))
  norm = getattr(jkf, kind)(8, reduction_axes=(-2, -1), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"reduction_axes=\(-2, -1\): the kernels normalize "
                     r"over the last axis alone"):
    norm(jnp.ones((2, 3, 8)))
  with pytest.raises(ValueError, match=r"mask of shape \(3, 8\) does not broadcast to x's "
                     r"\(2, 8\)"):
    getattr(jkf, kind)(8, rngs=nnx.Rngs(0))(jnp.ones((2, 8)), mask=jnp.ones((3, 8), bool))


def _pair(kind, n):
  ours = getattr(jkf, kind)(n, rngs=nnx.Rngs(0))
  theirs = getattr(nnx, kind)(n, epsilon=1e-6, rngs=nnx.Rngs(0))
  ours.scale[...] = theirs.scale[...] = _x(n, tag="scale")
  if kind == "LayerNorm":
    ours.bias[...] = theirs.bias[...] = _x(n, tag="bias")
  return ours, theirs


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_a_tokens_mask_runs_the_kernels_as_flax_computes_it(kind):
  """A padding mask, one flag a token (its last axis 1): the kept rows' statistics are their
  whole rows', on the kernels; a masked row is NaN, as Flax's mean over no element is."""
  ours, theirs = _pair(kind, 32)
  x = _x(3, 5, 32)
  keep = jnp.asarray(numerics.rng("flax mask", kind).random((3, 5, 1)) < 0.6).at[0, 0].set(True)
  with numerics.kernel_mode(), numerics.served_by(None, [kind.lower().replace("rmsn", "rms_n")
                                                          .replace("layern", "layer_n")]):
    y = nnx.jit(lambda m, x: m(x, mask=keep))(ours, x)
  want = theirs(x, mask=keep)
  assert np.array_equal(np.isnan(y), np.isnan(want)) and np.isnan(want).any()
  chex.assert_trees_all_close(jnp.nan_to_num(y), jnp.nan_to_num(want), **TOL)


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_a_mask_within_rows_takes_flaxs_statistics(kind):
  """A mask that varies along the features: the statistics over the elements it keeps (every
  element normalized by them), forward and gradients as Flax's, from XLA's ops, said once."""
  ours, theirs = _pair(kind, 24)
  x = _x(4, 24)
  keep = jnp.asarray(numerics.rng("flax mask", kind, "within").random((4, 24)) < 0.7)
  keep = keep.at[:, 0].set(True)  # no row empty: Flax's gradient there is NaN
  with pytest.warns(jkf.jk.FallbackWarning, match=f"jaxkernels.flax.{kind}: a mask that "
                    "varies within a row"):
    y, g = _grads(ours, lambda m, x: m(x, mask=keep), x)
  want, want_g = _grads(theirs, lambda m, x: m(x, mask=keep), x)
  chex.assert_trees_all_close(y, want, **TOL)
  chex.assert_trees_all_close(jax.tree.leaves(g), jax.tree.leaves(want_g), **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_glu_mlp_matches_jnp(impl):
  x = _x(2, 5, 32)
  mlp = jkf.GLUMLP(32, 48, implementation=impl, rngs=nnx.Rngs(1))

  def plain(m, x):
    w = m.gate_up[...]  # (in, 2, hidden): the gate's and up's weights stacked
    return (jax.nn.silu(x @ w[:, 0]) * (x @ w[:, 1])) @ m.down[...]

  with numerics.kernel_mode():
    y, g = _grads(mlp, lambda m, x: m(x), x)
  want, want_g = _grads(mlp, plain, x)
  chex.assert_trees_all_close(y, want, **TOL)
  chex.assert_trees_all_close(jax.tree.leaves(g), jax.tree.leaves(want_g), atol=1e-4,
                              rtol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_fn_in_multi_head_attention(impl):
  """nnx.MultiHeadAttention with our attention_fn against its own, causal by is_causal and by
  a boolean mask (turned into a bias)."""
  x = _x(2, 9, 32)
  make = lambda fn: nnx.MultiHeadAttention(num_heads=2, in_features=32, qkv_features=32,
                                           decode=False, attention_fn=fn, rngs=nnx.Rngs(2))
  ours = make(functools.partial(jkf.attention_fn, implementation=impl))
  theirs = make(nnx.dot_product_attention)
  mask = nnx.make_causal_mask(jnp.ones((2, 9)))
  for kwargs in (dict(is_causal=True), dict(mask=mask)):
    # Full float32 products on both sides: on a GPU the projections and flax's own attention
    # would round to tf32 (7.6e-4 apart from the exact sums at these sizes).
    with numerics.kernel_mode(), jax.default_matmul_precision("highest"):
      y, g = _grads(ours, lambda m, x: m(x, **kwargs), x)
    with jax.default_matmul_precision("highest"):
      want, want_g = _grads(theirs, lambda m, x: m(x, **kwargs), x)
    chex.assert_trees_all_close(y, want, atol=1e-4, rtol=1e-4)
    chex.assert_trees_all_close(jax.tree.leaves(g), jax.tree.leaves(want_g), atol=1e-4,
                                rtol=1e-4)


# (use_bias, normalize_qk, dtype) of the module
MHA_VARIANTS = {"bias float32": (True, False, jnp.float32),
                "normalized-qk float16": (False, True, jnp.float16)}


@pytest.mark.parametrize("decode,batched,variant", numerics.grid(
    [False, True], [False, True], sorted(MHA_VARIANTS)))
def test_attention_fn_serves_multi_head_attention_as_flax_calls_it(decode, batched, variant):
  """Our attention_fn in the configurations Flax's own MultiHeadAttention is used and tested
  in: inputs with and without batch dims ((T, features) gives q (T, N, H), which once raised
  "q must have rank >= 4"), one token at a time against a decode cache (its mask a bias), the
  projections' biases, normalized q and k, float16. The same outputs as Flax's own
  dot_product_attention, step by step."""
  use_bias, normalize_qk, dtype = MHA_VARIANTS[variant]
  features, length = 6, 4
  x = numerics.normal(numerics.rng("mha", decode, batched), (2, length, features) if batched
                      else (length, features), jnp.float32)

  def make(fn):
    return nnx.MultiHeadAttention(num_heads=2, in_features=features, qkv_features=features,
                                  out_features=features, use_bias=use_bias, dtype=dtype,
                                  normalize_qk=normalize_qk, decode=decode, attention_fn=fn,
                                  rngs=nnx.Rngs(5))

  def outputs(module):
    if not decode:
      return [module(x)]
    module.init_cache(x.shape, dtype=dtype)
    return [module(x[..., t:t + 1, :]) for t in range(length)]

  with numerics.kernel_mode(), jax.default_matmul_precision("highest"):
    got = outputs(make(jkf.attention_fn))
  with jax.default_matmul_precision("highest"):
    want = outputs(make(nnx.dot_product_attention))
  # float16 activations: both sides round each product's operands to float16 (eps 9.8e-4) and
  # sum 4 or fewer terms; float32: the sums' order alone.
  tol = 4e-3 if dtype == jnp.float16 else 1e-5
  for g, w in zip(got, want):
    chex.assert_equal_shape([g, w])
    chex.assert_trees_all_close(g.astype(jnp.float32), w.astype(jnp.float32), atol=tol,
                                rtol=tol)


def test_attention_fn_says_what_it_cannot_do():
  q = jnp.ones((1, 4, 2, 16))
  with pytest.raises(NotImplementedError, match="attention dropout"):
    jkf.attention_fn(q, q, q, dropout_rate=0.1, deterministic=False)
  jkf.attention_fn(q, q, q, dropout_rate=0.1, deterministic=True)  # no dropout to apply
  with pytest.raises(NotImplementedError, match="cannot be sown"):
    jkf.attention_fn(q, q, q, module=object())


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head(tied):
  """Logits, and the fused loss against optax's on those logits; tied to an embedding."""
  x, labels = _x(3, 6, 16), jnp.asarray(np.arange(18).reshape(3, 6) % 40, jnp.int32)
  embed = nnx.Embed(40, 16, rngs=nnx.Rngs(3)) if tied else None
  head = jkf.LMHead(16, 40, tied=embed, implementation="triton", rngs=nnx.Rngs(4))
  with numerics.kernel_mode():
    logits = head(x)
    loss, g = nnx.value_and_grad(lambda m: m(x, labels, z_loss=1e-4))(head)
  w = head.weight(jnp.float32)
  chex.assert_trees_all_close(logits, x @ w, **TOL)

  def optax_loss(m):
    z = x @ m.weight(jnp.float32)
    return (optax.softmax_cross_entropy_with_integer_labels(z, labels).mean()
            + 1e-4 * jnp.mean(jax.nn.logsumexp(z, axis=-1) ** 2))

  want, want_g = nnx.value_and_grad(optax_loss)(head)
  chex.assert_trees_all_close(loss, want, **TOL)
  chex.assert_trees_all_close(jax.tree.leaves(g), jax.tree.leaves(want_g), **TOL)
