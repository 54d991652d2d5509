"""The anchor for the model's train step: a Llama written as a user of plain JAX writes it.

No jaxkernels or models code: parameters in a dict of float32 arrays (the layers stacked),
bfloat16 activations, RMSNorm and RoPE in jnp, attention through
``jax.nn.dot_product_attention`` (cuDNN on a GPU; on a TPU JAX's splash attention, as MaxText
calls it), the SwiGLU MLP, the loss by optax on the
whole logits, AdamW with clipping by optax, ``jax.checkpoint`` with JAX's own policies, the
layers unrolled or under ``jax.lax.scan``. It takes the tricks a performance-minded JAX user
takes (MaxText's fused q/k/v and gate/up projections, donated state) and none of ours.

Same architecture, shapes and optimizer as models/llama.py with models/hparams.py's AdamW (the
bench passes the preset's numbers in), so the two steps do the same work and their ratio is
what a user gains. ``stream``: the residual stream's dtype, float32 as ours keeps it or
bfloat16 as most JAX Llamas do (less memory traffic, coarser adds): the bench times both and
takes the faster as the anchor.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

POLICIES = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
  vocab: int
  width: int
  depth: int
  heads: int
  kv_heads: int
  mlp_width: int
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5

  @property
  def head_dim(self) -> int:
    return self.width // self.heads


def init(shape: Shape, key, stacked: bool = True) -> dict:
  """float32 parameters: the embedding, the layers', the head. The layers' stacked along a
  leading axis (for ``jax.lax.scan``), or a list of one dict a layer (unrolled: slicing a
  stacked array per layer makes XLA assemble the stacked gradient from the layers', copies
  that a list does not need)."""
  s, depth = shape, shape.depth
  qkv_width = (s.heads + 2 * s.kv_heads) * s.head_dim
  keys = jax.random.split(key, 6)
  normal = lambda key, shape_, std: std * jax.random.normal(key, shape_, jnp.float32)
  layers = {
      "attn_norm": jnp.ones((depth, s.width), jnp.float32),
      "wqkv": normal(keys[1], (depth, s.width, qkv_width), 0.02),
      "wo": normal(keys[2], (depth, s.heads * s.head_dim, s.width), 0.02 / (2 * depth) ** 0.5),
      "mlp_norm": jnp.ones((depth, s.width), jnp.float32),
      "w_gate_up": normal(keys[3], (depth, s.width, 2 * s.mlp_width), 0.02),
      "w_down": normal(keys[4], (depth, s.mlp_width, s.width), 0.02),
  }
  return {
      "embed": normal(keys[0], (s.vocab, s.width), 0.02),
      "layers": layers if stacked else unstack(layers),
      "final_norm": jnp.ones((s.width,), jnp.float32),
      "head": normal(keys[5], (s.width, s.vocab), 0.02),
  }


def unstack(layers: dict) -> list[dict]:
  """Stacked layer parameters as a list of one dict a layer."""
  depth = len(next(iter(layers.values())))
  return [jax.tree.map(lambda w: w[i], layers) for i in range(depth)]


def rms_norm(x, scale, eps, dtype):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale).astype(dtype)


def rope(x, cos, sin):
  """x (B, T, N, H), its two halves of H rotated pairwise (Llama's layout)."""
  first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  cos, sin = cos[:, None, :], sin[:, None, :]
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin],
                         axis=-1).astype(x.dtype)


def block(shape: Shape, attention: str | None, dtype, x, p, cos, sin):
  s = shape
  b, t, _ = x.shape
  cast = lambda w: w.astype(dtype)
  h = rms_norm(x, p["attn_norm"], s.norm_eps, dtype)
  qkv = h @ cast(p["wqkv"])
  q, k, v = jnp.split(qkv, [s.heads * s.head_dim, (s.heads + s.kv_heads) * s.head_dim], -1)
  q = rope(q.reshape(b, t, s.heads, s.head_dim), cos, sin)
  k = rope(k.reshape(b, t, s.kv_heads, s.head_dim), cos, sin)
  v = v.reshape(b, t, s.kv_heads, s.head_dim)
  if attention == "splash":
    a = splash_attention(q, k, v)
  else:
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention)
  x = x + (a.reshape(b, t, -1) @ cast(p["wo"])).astype(x.dtype)
  h = rms_norm(x, p["mlp_norm"], s.norm_eps, dtype)
  gate, up = jnp.split(h @ cast(p["w_gate_up"]), 2, axis=-1)
  return x + ((jax.nn.silu(gate) * up) @ cast(p["w_down"])).astype(x.dtype)


SPLASH_BLOCK = 512  # MaxText's base.yml: sa_block_q, sa_block_kv and their companions


def splash_attention(q, k, v):
  """Causal attention of (B, T, N, H) q and (B, T, K, H) k, v by JAX's splash attention, as
  MaxText calls it on a TPU (its attention_op's tpu_flash_attention): q, k and v transposed to
  (B, N, T, H), q scaled, the causal mask block-sparse (the blocks above the diagonal never
  visited), MaxText's 512 blocks, the batch vmapped, the output transposed back."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as splash, splash_attention_mask as masks)
  _, t, n, h = q.shape
  block = min(SPLASH_BLOCK, t)
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                            block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                            block_q_dq=block, block_kv_dq=block)
  mask = masks.MultiHeadMask([masks.CausalMask((t, t))] * n)
  kernel = splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes)
  heads = lambda a: jnp.swapaxes(a, 1, 2)
  return heads(jax.vmap(kernel)(heads(q) * h ** -0.5, heads(k), heads(v)))


def hidden(params, inputs, *, shape: Shape, policy: str = "none", scan: bool = False,
           stream: str = "float32", attention: str | None = None, dtype=jnp.bfloat16):
  """(B, T) tokens -> (B, T, width) final hidden states, in ``dtype`` (the activations')."""
  s = shape
  t = inputs.shape[1]
  inverse = s.rope_theta ** (-jnp.arange(0, s.head_dim, 2, dtype=jnp.float32) / s.head_dim)
  angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inverse[None, :]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x = params["embed"][inputs].astype(stream)
  layer = functools.partial(block, s, attention, dtype)
  if POLICIES[policy] is not None:
    layer = jax.checkpoint(layer, policy=POLICIES[policy])
  layers = params["layers"]
  if scan:
    x, _ = jax.lax.scan(lambda x, p: (layer(x, p, cos, sin), None), x, layers)
  else:
    for p in (layers if isinstance(layers, list) else unstack(layers)):
      x = layer(x, p, cos, sin)
  return rms_norm(x, params["final_norm"], s.norm_eps, dtype)


def loss_fn(params, tokens, *, shape: Shape, dtype=jnp.bfloat16, **options):
  """Mean next-token cross-entropy of (B, T + 1) tokens (``options``: :func:`hidden`'s)."""
  inputs, labels = tokens[:, :-1], tokens[:, 1:]
  h = hidden(params, inputs, shape=shape, dtype=dtype, **options)
  logits = (h @ params["head"].astype(dtype)).astype(jnp.float32)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def optimizer(steps: int = 10_000, warmup: int = 10, learning_rate: float = 3e-3):
  """models/hparams.py's: clipping at global norm 1, AdamW (0.9, 0.95), weight decay 0.1 on the
  matrices, warmup then cosine to a tenth."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=learning_rate, warmup_steps=warmup, decay_steps=steps,
      end_value=learning_rate * 0.1)
  return optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1,
                  mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)))


def attention_implementation() -> str | None:
  """cuDNN on a GPU (bfloat16), XLA's elsewhere."""
  return "cudnn" if jax.default_backend() == "gpu" else None


def step_fn(shape: Shape, tx, donate: bool = True, **options):
  """The jitted step: ((params, opt_state), tokens) -> ((params, opt_state), loss)."""
  options.setdefault("attention", attention_implementation())

  def step(state, tokens):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, shape=shape, **options)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return jax.jit(step, donate_argnums=0 if donate else ())
