"""A pre-norm decoder-only transformer (Flax NNX) whose memory-bound ops are jaxkernels'.

Each block is  h = x + attn(norm(x)); x' = h + mlp(norm(h))  with the second
residual add and norm fused into one pass (``rms_norm(..., residual=...)``)
and the MLP's SwiGLU gate fused (``glu``). Attention is
``jax.nn.dot_product_attention`` until jaxkernels has its own. Every op takes
the model config's ``implementation`` (None: the best kernel for the device).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxkernels as jk


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  vocab: int
  width: int
  depth: int
  heads: int
  mlp_width: int
  max_len: int
  dtype: str = "bfloat16"  # activations; parameters stay float32
  implementation: str | None = None

  @property
  def head_dim(self) -> int:
    return self.width // self.heads

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token (6 x matmul parameters + attention), as in PaLM's MFU."""
    matmul_params = self.depth * (4 * self.width**2 + 3 * self.width * self.mlp_width)
    matmul_params += self.vocab * self.width
    return 6 * matmul_params + 12 * self.depth * self.width * seq_len


PRESETS = {
    "test": Config(vocab=64, width=32, depth=2, heads=4, mlp_width=64, max_len=16,
                   dtype="float32"),
    "small": Config(vocab=32000, width=768, depth=12, heads=12, mlp_width=2048, max_len=1024),
    "1b": Config(vocab=32000, width=2048, depth=22, heads=16, mlp_width=5632, max_len=2048),
}


class Block(nnx.Module):
  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dense = dict(use_bias=False, dtype=jnp.dtype(cfg.dtype), rngs=rngs)
    self.attn_scale = nnx.Param(jnp.ones((cfg.width,)))
    self.mlp_scale = nnx.Param(jnp.ones((cfg.width,)))
    self.qkv = nnx.Linear(cfg.width, 3 * cfg.width, **dense)
    self.out = nnx.Linear(cfg.width, cfg.width, **dense)
    self.gate_up = nnx.Linear(cfg.width, 2 * cfg.mlp_width, **dense)
    self.down = nnx.Linear(cfg.mlp_width, cfg.width, **dense)

  def __call__(self, x, attn_residual):
    """x: the previous block's output delta (BTD); attn_residual: the residual stream (BTD).

    Returns (this block's MLP output, the residual stream after attention).
    """
    cfg, impl = self.cfg, self.cfg.implementation
    normed, stream = jk.rms_norm(x, self.attn_scale[...], residual=attn_residual,
                                 implementation=impl)
    b, t, _ = x.shape
    q, k, v = jnp.split(self.qkv(normed).reshape(b, t, 3 * cfg.heads, cfg.head_dim), 3, axis=2)
    attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # BTNH
    delta = self.out(attended.reshape(b, t, cfg.width))
    normed, stream = jk.rms_norm(delta, self.mlp_scale[...], residual=stream,
                                 implementation=impl)
    gate, up = jnp.split(self.gate_up(normed), 2, axis=-1)
    return self.down(jk.glu(gate, up, activation="silu", implementation=impl)), stream


class Transformer(nnx.Module):
  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.depth)])
    self.final_scale = nnx.Param(jnp.ones((cfg.width,)))

  def __call__(self, tokens):  # BT -> BTV logits (float32)
    dtype = jnp.dtype(self.cfg.dtype)
    stream = _lookup(self.embed.embedding[...], tokens).astype(jnp.float32)  # stays float32
    delta = jnp.zeros(stream.shape, dtype)
    for block in self.blocks:
      delta, stream = block(delta, stream)
    normed, _ = jk.rms_norm(delta, self.final_scale[...], residual=stream,
                            implementation=self.cfg.implementation)
    return self.embed.attend(normed.astype(jnp.float32))


def _lookup(table, tokens):
  """table[tokens], split as the tokens are: on a mesh of Explicit axes a gather must say how
  its output is split (the batch, as data parallelism splits it)."""
  spec = jax.typeof(tokens).sharding.spec
  split = any(axes is not None for axes in spec)
  return table.at[tokens].get(out_sharding=P(*spec, None) if split else None)


def loss_fn(model: Transformer, tokens):
  """Next-token cross-entropy (mean over positions)."""
  logits = model(tokens[:, :-1])
  # The label's log-probability picked by a one-hot product rather than a gather: elementwise
  # work that splits as the batch does (on a mesh of Explicit axes a gather would have to name
  # its output's split, and its transpose its cotangent's); one more logits-sized array.
  labels = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1], dtype=logits.dtype)
  return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, axis=-1))


@nnx.jit
def train_step(model: Transformer, optimizer: nnx.Optimizer, tokens):
  loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
  optimizer.update(model, grads)
  return loss


def mfu(cfg: Config, tokens_per_second: float, seq_len: int, peak_flops: float) -> float:
  """Model FLOPs utilisation, in percent of ``peak_flops``."""
  return 100.0 * cfg.flops_per_token(seq_len) * tokens_per_second / peak_flops


def make(cfg: Config, seed: int = 0, learning_rate: float = 3e-3):
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  return model, nnx.Optimizer(model, optax.adamw(learning_rate), wrt=nnx.Param)


def data_parallel(model: Transformer, optimizer: nnx.Optimizer, devices=None):
  """A mesh of ``devices`` (default: all local ones) on one Explicit axis, "data", with the
  model and optimizer state replicated over it. Put each batch with ``shard_batch``; the train
  step then runs each device on its share of the batch (jaxkernels' ops split with it) and
  sums the gradients."""
  devices = jax.local_devices() if devices is None else devices
  mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Explicit,),
                       devices=devices)
  state = nnx.state((model, optimizer))
  nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))
  return mesh


def shard_batch(tokens, mesh):
  """(B, T) tokens split over the mesh's "data" axis along B."""
  return jax.device_put(tokens, NamedSharding(mesh, P("data")))


