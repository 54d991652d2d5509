"""A decoder-only Llama-style transformer in Flax NNX, built only on jaxkernels' public API.

Each block is  h = x + attn(norm(x)); x' = h + mlp(norm(h))  with every residual add fused into
the norm after it (``jaxkernels.flax.RMSNorm(x, residual=...)``), rotary positions, grouped-query
attention through ``flash_attention`` (causal), the SwiGLU MLP through ``matmul`` and ``glu``
(``jaxkernels.flax.GLUMLP``), and the next-token loss fused with the output projection
(``linear_softmax_cross_entropy``: the (tokens, vocab) logits are never held). The layers are
stacked parameters, each under ``nnx.remat`` with a policy by name (``jaxkernels.remat``), one
for all or one per layer, walked unrolled (the default: a step 22% shorter on an H100 at 350m,
notes/model.md model-2) or by one ``nnx.scan`` (``scan_layers``: one layer's program to
compile). The residual stream is float32 (or ``stream``'s 16 bits), the activations ``dtype``.

On a TPU the norms, products and MLP run on XLA unless ``reference_ops`` says otherwise
(:data:`TPU_REFERENCE_OPS`: XLA:TPU fuses them into its dots); attention and the loss stay
kernels. ``kernels="xla"`` runs the same model as a user of plain JAX would: XLA's ops,
``jax.nn.dot_product_attention`` (cuDNN on a GPU) and optax's loss on the whole logits.

Every weight matrix records logical names for its dimensions (``nnx.get_partition_spec``);
:data:`RULES` maps them onto a mesh's ``data`` and ``fsdp`` axes and :func:`place` lays a
model (and its optimizer) out by them: fully sharded data parallelism, each weight split over
``fsdp`` along its width and gathered whole (in ``dtype``) where a layer uses it, the batch
split over both axes. Logical axis rules set by the user (``jk.sharding_rules``, or Flax's
``nnx.logical_axis_rules``) take the place of :data:`RULES`, for the parameters as for the ops.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxkernels as jk
import jaxkernels.flax as jkf
from jaxkernels import remat

KERNELS = ("jaxkernels", "xla")
# The op groups that ``Config.reference_ops`` can put back on XLA's path one by one (to find
# which kernel a difference from kernels="xla" comes from).
OPS = ("norm", "matmul", "attention", "mlp", "loss")
STREAMS = ("float32", "bfloat16", "float16")  # the residual stream's dtypes
# On a TPU, the groups the model leaves to XLA unless ``Config.reference_ops`` names its own:
# XLA:TPU folds an RMSNorm into the next dot's fusion and SwiGLU into the down projection's,
# which a Pallas call between them stops (each of our norm and GLU kernels is a pass of its
# own). Attention and the loss stay kernels. notes/report.md tpu-step-1: the 350m step
# predicted 13% shorter on v5e and 12% on v6e (remat dots) than with every group a kernel.
TPU_REFERENCE_OPS = ("norm", "matmul", "mlp")


def default_reference_ops(platform: str) -> tuple[str, ...]:
  """The op groups a model on ``platform`` ("gpu", "tpu", "cpu") runs on XLA by default."""
  return TPU_REFERENCE_OPS if platform == "tpu" else ()

# Logical axis -> mesh axis. The width ("embed") of every weight is split over fsdp (gathered
# where a layer uses it); the heads, the MLP's hidden width and the vocabulary over tensor
# (kept split: Megatron's tensor parallelism, the vocabulary-parallel loss); a stacked layer
# axis stays whole. An axis the mesh lacks, or of size 1, splits nothing.
RULES = {"embed": "fsdp", "layers": None, "heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
BATCH = ("data", "fsdp")  # the mesh axes that split the batch
MESH_AXES = ("data", "fsdp", "tensor", "sequence")  # the train CLI's mesh, in this order


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  vocab: int
  width: int
  depth: int
  heads: int
  kv_heads: int
  mlp_width: int
  max_len: int
  rope_theta: float = 10000.0
  tied: bool = False  # the output projection is the embedding's transpose
  norm_eps: float = 1e-5
  z_loss: float = 0.0
  dtype: str = "bfloat16"  # activations; parameters stay float32
  # The residual stream's dtype (STREAMS): float32 keeps every layer's sum exact to f32; a
  # 16-bit stream, as MaxText and most plain-JAX Llamas keep it, halves its traffic.
  stream: str = "float32"
  kernels: str = "jaxkernels"
  # With kernels="jaxkernels": these of OPS run as kernels="xla" runs them; None: the
  # platform's default (default_reference_ops: none on a GPU, TPU_REFERENCE_OPS on a TPU).
  reference_ops: tuple[str, ...] | None = None
  # A jaxkernels.remat policy for every block, or one per block. "auto" is resolved by
  # models.train_step.auto_remat (per layer, under a memory budget) before a model is built.
  remat: str | tuple[str, ...] = "none"
  scan_layers: bool = False  # one nnx.scan over the stacked layers, else the layers unrolled
  # The blocks' products (q/k/v, out, gate/up, down) in fp8, forward and backward
  # (``jk.fp8_matmul``: e4m3 with DeepSeek-V3's block scales); the output head stays 16-bit.
  fp8: bool = False

  def __post_init__(self):
    if self.kernels not in KERNELS:
      raise ValueError(f"Config: kernels={self.kernels!r} is not one of {KERNELS}")
    if self.stream not in STREAMS:
      raise ValueError(f"Config: stream={self.stream!r} is not one of {STREAMS}")
    if self.reference_ops is not None:
      object.__setattr__(self, "reference_ops", tuple(self.reference_ops))
    unknown = [op for op in self.reference_ops or () if op not in OPS]
    if unknown:
      raise ValueError(f"Config: reference_ops={self.reference_ops!r}: each must be one of "
                       f"{OPS}")
    accepted = (*remat.POLICIES, "auto")
    if isinstance(self.remat, str):
      if self.remat not in accepted:
        raise ValueError(f"Config: remat={self.remat!r} is not one of {accepted}")
    else:
      object.__setattr__(self, "remat", tuple(self.remat))
      bad = [name for name in self.remat if name not in remat.POLICIES]
      if len(self.remat) != self.depth or bad:
        raise ValueError(f"Config: remat={self.remat!r}: one policy per layer ({self.depth}), "
                         f"each one of {remat.POLICIES}")
      if self.scan_layers and len(set(self.remat)) > 1:
        raise ValueError("Config: per-layer remat policies need scan_layers=False (a scan has "
                         "one body)")
    if self.width % self.heads or self.heads % self.kv_heads:
      raise ValueError(f"Config: width {self.width} must split into heads {self.heads}, and "
                       f"heads into kv_heads {self.kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"Config: head dim {self.head_dim} must be even (rotary pairs)")
    if self.fp8:
      sizes = {"width": self.width, "mlp_width": self.mlp_width,
               "q/k/v width": (self.heads + 2 * self.kv_heads) * self.head_dim}
      bad = {name: size for name, size in sizes.items() if size % 128}
      if bad:
        raise ValueError(f"Config: fp8=True quantizes in blocks of 128, which must divide "
                         f"every product's sizes; {bad} do not")

  def implementation(self, op: str) -> str | None:
    """``op``'s implementation (one of OPS): the reference for kernels="xla" or where
    ``reference_ops`` names it, else the device's best."""
    return "xla" if self.on_xla(op) else None

  def on_xla(self, op: str) -> bool:
    ops = self.reference_ops
    if ops is None:
      ops = default_reference_ops(jax.default_backend())
    return self.kernels == "xla" or op in ops

  def for_platform(self, platform: str) -> Config:
    """This config with ``reference_ops`` fixed for ``platform`` where it was left to the
    platform's default (a program compiled for a TPU from a CPU host takes the TPU's)."""
    if self.reference_ops is not None:
      return self
    return dataclasses.replace(self, reference_ops=default_reference_ops(platform))

  def layer_policies(self) -> tuple[str, ...]:
    """Each layer's remat policy."""
    if self.remat == "auto":
      raise ValueError("Config: remat='auto' must be resolved first (models.train_step.auto_remat "
                       "picks a policy per layer under a memory budget)")
    return (self.remat,) * self.depth if isinstance(self.remat, str) else self.remat

  @property
  def head_dim(self) -> int:
    return self.width // self.heads

  @property
  def group(self) -> int:
    """Query heads a kv head serves."""
    return self.heads // self.kv_heads

  @property
  def matmul_params(self) -> int:
    """Parameters that multiply each token: the blocks' projections and the output head."""
    qkv = self.width * (self.heads + 2 * self.kv_heads) * self.head_dim
    block = qkv + self.width * self.width + 3 * self.width * self.mlp_width
    return self.depth * block + self.width * self.vocab

  def flops_per_token(self, seq_len: int, *, causal_half: bool = False) -> float:
    """Training FLOPs a token, as PaLM's appendix B counts them (and the issue's table of
    plain-JAX MFUs): 6 x matmul parameters, plus attention's 4·T·width a layer forward times 3
    for the backward, as if no mask skipped anything. ``causal_half``: the attention term
    halved, the work a causal kernel does (the count is then 7-13% lower at the presets)."""
    attention = 12 * self.depth * seq_len * self.width
    return 6 * self.matmul_params + (attention / 2 if causal_half else attention)


PRESETS = {
    # Trains on a laptop CPU in a minute: bytes as tokens.
    "tiny": Config(vocab=256, width=64, depth=2, heads=4, kv_heads=2, mlp_width=172,
                   max_len=128, dtype="float32"),
    "125m": Config(vocab=32000, width=768, depth=12, heads=12, kv_heads=4, mlp_width=2048,
                   max_len=2048),
    "350m": Config(vocab=32000, width=1024, depth=24, heads=16, kv_heads=4, mlp_width=2816,
                   max_len=2048),
    "1b": Config(vocab=32000, width=2048, depth=16, heads=16, kv_heads=4, mlp_width=5632,
                 max_len=2048),
    # Llama 3 8B's shape: past one device (its parameters and Adam's moments take 96 GB in
    # float32); for meshes that split it (fsdp x tensor).
    "8b": Config(vocab=128256, width=4096, depth=32, heads=32, kv_heads=8, mlp_width=14336,
                 max_len=8192, rope_theta=500000.0),
}


def preset(name: str, **changes) -> Config:
  """The preset called ``name``, with ``changes`` (any Config field)."""
  if name not in PRESETS:
    raise ValueError(f"preset {name!r} does not exist; presets: {', '.join(PRESETS)}")
  return dataclasses.replace(PRESETS[name], **changes)


def rotary(positions, head_dim: int, theta: float):
  """(cos, sin), each (T, head_dim / 2), float32."""
  inverse = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = positions.astype(jnp.float32)[:, None] * inverse[None, :]
  return jnp.cos(angles), jnp.sin(angles)


def _rotate(x, cos, sin):
  """x (B, T, N, H) rotated pairwise (the two halves of H: Llama's layout)."""
  first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  cos, sin = cos[:, None, :], sin[:, None, :]
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin],
                         axis=-1).astype(x.dtype)


def sequence_split() -> tuple[tuple[str, ...], int]:
  """(the mesh axes that split the sequence, their size): the ``sequence`` axis of the mesh in
  context where it has more than one device, else ((), 1)."""
  mesh = jax.sharding.get_abstract_mesh()
  if getattr(mesh, "empty", True) or "sequence" not in mesh.axis_names:
    return (), 1
  n = dict(mesh.shape)["sequence"]
  return (("sequence",), n) if n > 1 else ((), 1)


def _entry(names: tuple[str, ...]):
  """A PartitionSpec entry for mesh axes ``names``: one name, or a tuple of them."""
  return names[0] if len(names) == 1 else names


def _lookup(table, tokens, sequence: tuple[str, ...] = ()):
  """table[tokens] in float32, split as the tokens are, and along the sequence over
  ``sequence``: on a mesh of Explicit axes a gather must say how its output is split."""
  spec = tuple(jax.typeof(tokens).sharding.spec) + (None,) * tokens.ndim
  spec = (spec[0], _entry(sequence) if sequence else spec[1])
  split = any(axes is not None for axes in spec)
  return table.at[tokens].get(out_sharding=P(*spec, None) if split else None).astype(
      jnp.float32)


def _replicated(value):
  """``value`` in float32, whole on every device (a table that a lookup gathers rows of)."""
  w = value.astype(jnp.float32)
  if any(axes is not None for axes in jax.typeof(w).sharding.spec):
    w = jax.sharding.reshard(w, P())
  return w


def _named(init, *axes):
  """``init`` whose parameters carry the logical names ``axes`` (laid out by :func:`place`)."""
  return nnx.with_partitioning(init, axes, eager_sharding=False)


def shardings(state: nnx.State, mesh: jax.sharding.Mesh):
  """``state``'s layout on ``mesh``: each leaf's NamedSharding from its parameters' logical
  names and the logical axis rules set (``jk.sharding_rules``, or Flax's), else :data:`RULES`;
  what has no names is replicated."""
  def mesh_spec(spec):
    return jk.partition_spec(tuple(spec), mesh, rules=RULES)

  # The logical names as the parameters record them (under Flax's rules nnx would already
  # have mapped them to mesh axes; the rules in ``rules`` include Flax's).
  with nnx.logical_axis_rules(()):
    specs = nnx.get_partition_spec(state)
  return jax.tree.map(lambda spec: NamedSharding(mesh, mesh_spec(spec)), specs,
                      is_leaf=lambda x: isinstance(x, P))


def check_divides(state: nnx.State, mesh: jax.sharding.Mesh) -> None:
  """Raises a ValueError naming the first parameter whose dimension the mesh axes it is laid
  out over (:func:`shardings`) do not divide: which parameter, which dimension and its logical
  name, which axes. ``state`` may be abstract (``nnx.eval_shape``'s)."""
  with nnx.logical_axis_rules(()):
    logical = nnx.get_partition_spec(state)

  def check(path, value, sharding, names):
    for dim, entry in enumerate(sharding.spec):
      axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
      k = math.prod(dict(mesh.shape)[a] for a in axes)
      if axes and value.shape[dim] % k:
        name = tuple(names)[dim] if dim < len(tuple(names)) else None
        raise ValueError(
            f"the model's {jax.tree_util.keystr(path)} {tuple(value.shape)}: its dimension "
            f"{dim} ({name or 'unnamed'}, size {value.shape[dim]}) is laid out over mesh axes "
            f"{axes} of size {k}, which does not divide it; lay it out on a mesh whose "
            f"{' x '.join(axes)} divides {value.shape[dim]}")
  jax.tree_util.tree_map_with_path(check, state, shardings(state, mesh), logical,
                                   is_leaf=lambda x: isinstance(x, P))


def place(tree, mesh: jax.sharding.Mesh):
  """``tree`` (a model, an optimizer, or their ``nnx.state``) laid out on ``mesh``
  (:func:`shardings`); a mesh that does not divide a parameter is refused
  (:func:`check_divides`)."""
  state = tree if isinstance(tree, nnx.State) else nnx.state(tree)
  check_divides(state, mesh)
  placed = jax.device_put(state, shardings(state, mesh))
  if isinstance(tree, nnx.State):
    return placed
  nnx.update(tree, placed)
  return tree


def _cudnn(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cudnn_attention(specs, q, k, v):
  """Causal ``jax.nn.dot_product_attention`` on cuDNN, its gradients laid out as q, k and v are
  (``specs``): on a mesh of Explicit axes cuDNN's backward (jax 0.11.2) returns them without
  their mesh type, which the slices of the qkv product that made q, k and v refuse ("Expected
  cotangent type bfloat16[2@(data,fsdp),...] but got bfloat16[2,...]")."""
  del specs
  return _cudnn(q, k, v)


def _cudnn_attention_fwd(specs, q, k, v):
  del specs
  out, vjp = jax.vjp(_cudnn, q, k, v)
  return out, vjp


def _cudnn_attention_bwd(specs, vjp, ct):
  grads = vjp(ct)
  return tuple(g if all(e is None for e in spec) else jax.sharding.reshard(g, P(*spec))
               for g, spec in zip(grads, specs))


_cudnn_attention.defvjp(_cudnn_attention_fwd, _cudnn_attention_bwd)


class Block(nnx.Module):
  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    norm = cfg.implementation("norm")
    init = nnx.initializers.normal(0.02)
    self.attn_norm = jkf.RMSNorm(cfg.width, epsilon=cfg.norm_eps, dtype=cfg.dtype,
                                 implementation=norm, rngs=rngs)
    # q, k and v's weights grouped by kv head: (width, kv_heads, group + 2, head_dim), each
    # kv head's `group` query heads, then its k, then its v. Split over the kv heads (tensor
    # parallelism), each shard's slice is a whole set of groups: one column-parallel product,
    # attention over its own heads, nothing paired across shards.
    self.qkv = nnx.Param(_named(init, "embed", "heads", None, None)(
        rngs.params(), (cfg.width, cfg.kv_heads, cfg.group + 2, cfg.head_dim)))
    out_init = nnx.initializers.normal(0.02 / (2 * cfg.depth) ** 0.5)
    self.out = nnx.Param(_named(out_init, "heads", "embed")(
        rngs.params(), (cfg.heads * cfg.head_dim, cfg.width)))
    self.mlp_norm = jkf.RMSNorm(cfg.width, epsilon=cfg.norm_eps, dtype=cfg.dtype,
                                implementation=norm, rngs=rngs)
    self.mlp = jkf.GLUMLP(cfg.width, cfg.mlp_width, kernel_init=init,
                          implementation=cfg.implementation("mlp"),
                          axes=("embed", "mlp"), fp8=cfg.fp8, rngs=rngs)

  def __call__(self, delta, stream, cos, sin, layout="contiguous"):
    """(this block's MLP output, the residual stream up to it): ``delta`` is the previous
    block's output, added to ``stream`` inside the first norm; the MLP's output is added
    inside the next block's (or the final) norm."""
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    impl = cfg.implementation("matmul")
    product = functools.partial(jk.fp8_matmul if cfg.fp8 else jk.matmul, implementation=impl)
    normed, stream = self.attn_norm(delta.astype(dtype), residual=stream)
    b, t, _ = normed.shape
    w = jkf.whole_weight(self.qkv[...], dtype, impl)  # split over tensor where the heads are
    qkv = product(normed, w.reshape(cfg.width, -1))
    qkv = qkv.reshape(b, t, cfg.kv_heads, cfg.group + 2, cfg.head_dim)
    # Query head n = g * group + j attends with kv head g = n // group (flash_attention's).
    q = qkv[:, :, :, :cfg.group].reshape(b, t, cfg.heads, cfg.head_dim)
    k, v = qkv[:, :, :, cfg.group], qkv[:, :, :, cfg.group + 1]
    q = remat.tag(_rotate(q, cos, sin), remat.QUERY)
    k = remat.tag(_rotate(k, cos, sin), remat.KEY)
    v = remat.tag(v, remat.VALUE)
    if cfg.on_xla("attention"):
      cudnn = jax.default_backend() == "gpu" and dtype in (jnp.bfloat16, jnp.float16)
      if cudnn:
        specs = tuple(tuple(jax.typeof(x).sharding.spec) for x in (q, k, v))
        attended = _cudnn_attention(specs, q, k, v)
      else:
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    else:
      attended = jk.flash_attention(q, k, v, causal=True, sequence_layout=layout)
    delta = product(attended.reshape(b, t, -1), jkf.whole_weight(self.out[...], dtype, impl))
    normed, stream = self.mlp_norm(delta, residual=stream)
    return self.mlp(normed), stream


class Llama(nnx.Module):
  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    cfg.layer_policies()  # "auto" must have been resolved
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs, embedding_init=_named(
        nnx.initializers.normal(0.02), "vocab", "embed"))

    @nnx.split_rngs(splits=cfg.depth)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def blocks(rngs):
      return Block(cfg, rngs=rngs)

    self.blocks = blocks(rngs)
    self.final_norm = jkf.RMSNorm(cfg.width, epsilon=cfg.norm_eps, dtype=cfg.dtype,
                                  implementation=cfg.implementation("norm"), rngs=rngs)
    self.head = jkf.LMHead(cfg.width, cfg.vocab, tied=self.embed if cfg.tied else None,
                           kernel_init=nnx.initializers.normal(0.02),
                           implementation=cfg.implementation("loss"),
                           axes=("embed", "vocab"), rngs=rngs)

  def hidden(self, tokens, positions=None, layout: str = "contiguous"):
    """(B, T) tokens -> (B, T, width) final hidden states (after the last norm). On a mesh
    whose ``sequence`` axis splits the sequence (:func:`sequence_split`), the stream is split
    along T over it and attention runs as ring attention; ``positions`` (default 0..T-1) are
    the tokens' positions, and ``layout`` how they lie over the sequence's shards
    (``flash_attention``'s ``sequence_layout``: "zigzag" with positions ``jk.zigzag(T, n)``)."""
    cfg = self.cfg
    sequence, _ = sequence_split()
    positions = jnp.arange(tokens.shape[1]) if positions is None else positions
    cos, sin = rotary(positions, cfg.head_dim, cfg.rope_theta)
    if sequence:  # split along T as the stream is
      cos, sin = (jax.sharding.reshard(x, P(_entry(sequence), None))
                  for x in (cos, sin))
    # The residual stream, in cfg.stream whatever the activations' dtype.
    stream = _lookup(_replicated(self.embed.embedding[...]), tokens, sequence).astype(cfg.stream)
    delta = jnp.zeros_like(stream, jnp.dtype(cfg.dtype))  # split as the stream is

    policies = cfg.layer_policies()

    def apply(carry, block):
      return block(*carry, cos, sin, layout)

    # One function per policy, built once: layers that share it share its traced program, and
    # so each kernel's lowering (a Mosaic GPU kernel's is ~1 s; one function per layer took
    # the 350m step's compile from 38 s to 424 s).
    layer = {name: jkf.checkpointed(apply, name) for name in set(policies)}

    if cfg.scan_layers:
      delta, stream = nnx.scan(layer[policies[0]], in_axes=(nnx.Carry, 0),
                               out_axes=nnx.Carry)((delta, stream), self.blocks)
    else:  # one program per layer: no stacked residuals to slice in and out of
      graphdef, stacked = nnx.split(self.blocks)
      layers = jax.tree.map(lambda x: jnp.split(x, cfg.depth), stacked)
      carry = (delta, stream)
      for i in range(cfg.depth):
        state = jax.tree.map(lambda parts: parts[i][0], layers,
                             is_leaf=lambda x: isinstance(x, list))
        carry = layer[policies[i]](carry, nnx.merge(graphdef, state))
      delta, stream = carry
    normed, _ = self.final_norm(delta, residual=stream)
    return normed

  def __call__(self, tokens):
    """(B, T) tokens -> (B, T, vocab) logits (what the loss never materializes)."""
    return self.head(self.hidden(tokens))


def loss_fn(model: Llama, tokens):
  """Next-token cross-entropy (mean over positions), with the config's z-loss."""
  cfg = model.cfg
  inputs, labels = tokens[:, :-1], tokens[:, 1:]
  _, shards = sequence_split()
  if shards > 1 and not cfg.on_xla("attention"):
    # Ring attention, causal, balanced: the tokens (and their labels and positions) in the
    # zig-zag order over the sequence's shards; the mean loss is the same in any order.
    order = jk.zigzag(inputs.shape[1], shards)
    inputs, labels = inputs[:, order], labels[:, order]
    hidden = model.hidden(inputs, positions=jnp.asarray(order), layout="zigzag")
  else:
    hidden = model.hidden(inputs)
  if not cfg.on_xla("loss"):
    return model.head(hidden, labels, z_loss=cfg.z_loss)
  logits = model.head(hidden).astype(jnp.float32)
  spec = tuple(jax.typeof(logits).sharding.spec)
  if len(spec) == logits.ndim and spec[-1] is not None:  # split over the vocabulary (tensor)
    logits = jax.sharding.reshard(logits, P(*spec[:-1], None))  # optax takes each row whole
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  if cfg.z_loss:
    loss = loss + cfg.z_loss * jax.nn.logsumexp(logits, axis=-1) ** 2
  return jnp.mean(loss)


@nnx.jit
def train_step(model: Llama, optimizer: nnx.Optimizer, tokens):
  loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
  optimizer.update(model, grads)
  return loss


def mfu(cfg: Config, tokens_per_second: float, seq_len: int, peak_flops: float, *,
        causal_half: bool = False) -> float:
  """Model FLOPs utilisation, in percent of ``peak_flops`` (:meth:`Config.flops_per_token`)."""
  return (100.0 * cfg.flops_per_token(seq_len, causal_half=causal_half) * tokens_per_second
          / peak_flops)


def make(cfg: Config, seed: int = 0, learning_rate: float = 3e-3):
  model = Llama(cfg, rngs=nnx.Rngs(seed))
  return model, nnx.Optimizer(model, optax.adamw(learning_rate), wrt=nnx.Param)
