"""One registry of shapes, used by the benchmarks (GPU measured, TPU compiled) and the tests
(tokamax's arg_specs idea): a number that differs between two suites is a choice written here
once, not two copies that drift."""

from __future__ import annotations

import dataclasses

from jaxkernels import roofline

# --------------------------------------------------------------------------- #
# Row-wise ops: norms, softmax, bias+activation, glu
# --------------------------------------------------------------------------- #

# (rows, width) of the activations the row-wise ops see: a 16K-token batch of a 4096-wide model.
HEADLINE_ROWS = (16384, 4096)
# Small enough for interpret mode on a CPU, odd enough to exercise partial blocks.
SMOKE_ROWS = (300, 1000)
# Llama 2 7B's MLP width (11008 = 43 x 256): Mosaic GPU walks its rows in 256-column chunks.
MLP_ROWS = (8192, 11008)

# The tests' grid for every dtype: one element, odd widths under one block, a partial row block.
SMALL_ROWS = ((1, 1), (3, 7), (37, 200), (130, 129))
# Shapes the tests draw from: partial row blocks, widths that are not multiples of any block,
# one row, one column, and a row too wide for one register pass (the chunked Triton path).
ODD_ROWS = (*SMALL_ROWS[:3], (64, 256), SMALL_ROWS[3], (8, 20000))
# Leading dimensions the ops must flatten and restore.
BATCHED = ((2, 3, 40), (2, 1, 5, 24))


def softmax_rows(smoke: bool) -> tuple[tuple[int, int], ...]:
  """A model-width row, a vocabulary-wide one (the online, chunked path on Triton), and GPT-2's
  vocabulary, whose rows are not a whole number of 16-byte vectors."""
  rows, cols = SMOKE_ROWS if smoke else HEADLINE_ROWS
  return ((rows, cols), (rows // 16, cols * 16 if not smoke else 20000),
          (rows // 16, 50257 if not smoke else 20001))


# --------------------------------------------------------------------------- #
# Cross-entropy
# --------------------------------------------------------------------------- #

VOCAB = 128256  # Llama 3's
# (rows, vocabulary) of the loss on materialized logits.
CROSS_ENTROPY_ROWS, SMOKE_CROSS_ENTROPY_ROWS = (8192, VOCAB), (300, 1000)
# (tokens, width, vocabulary) of the loss fused with the output projection: the bar.
LINEAR_CROSS_ENTROPY, SMOKE_LINEAR_CROSS_ENTROPY = (16384, 2048, 131072), (300, 64, 1000)

# --------------------------------------------------------------------------- #
# matmul: (M, N, K) unless named otherwise
# --------------------------------------------------------------------------- #

# Square sizes: the 8192 and 4096, the wave-quantization cliffs 8193 and 2049 with their
# aligned neighbours, and 6144/6145.
MATMUL_SQUARE = (8192, 4096, 8193, 2048, 2049, 6144, 6145)
# The kernels' word on odd shapes, on the GPU (bench matmul --only checks): 2 x M x N x K.
MATMUL_CHECKS = ((100, 130, 70), (257, 383, 129), (3, 2, 1027), (1024, 1024, 1024),
                 (1700, 1800, 333))
# The tests': one odd size each and none a multiple of any block, a batched a, K under a block.
MATMUL_ODD = ((37, 45, 70), (2, 19, 130, 33), (8, 16, 5))
# (M, K, N): the gated MLP's first product in the 350m and 1b models (bench/model.py), 8 x 2048
# and 4 x 2048 tokens; y has N columns, B 2N.
MATMUL_GLU = ((16384, 1024, 2816), (8192, 2048, 5632))
# (M, K, N): 8192^3, and the 1b model's products at 4 x 2048 tokens: q, k, v (16 heads and
# 2 x 4 kv heads of 128), the MLP's [gate | up] and its down projection.
MATMUL_BLOCK_SCALED = ((8192, 8192, 8192), (8192, 2048, 3072), (8192, 2048, 11264),
                       (8192, 5632, 2048))

# --------------------------------------------------------------------------- #
# Attention
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class Attention:
  """One flash_attention shape: q (batch, length, heads, head_dim), k and v with kv_heads."""
  name: str
  batch: int
  length: int
  heads: int
  kv_heads: int
  head_dim: int
  causal: bool = False
  window: tuple[int, int] | None = None
  segments: int = 0  # packed sequences a row, equal lengths
  soft_cap: float | None = None
  # A bias over the heads, (1, N, T, S) (a learned relative-position bias): "bias" times the
  # gradients of q, k and v (as with a mask given as a bias), "bias+grad" the bias's too.
  bias: str | None = None
  check: bool = True  # the float64 reference fits beside the run
  anchors: bool = True

  @property
  def grads(self) -> tuple[int, ...]:
    """The inputs whose gradients forward+backward computes: q, k, v (and the bias)."""
    return (0, 1, 2, 3) if self.bias == "bias+grad" else (0, 1, 2)

  def flops(self, label: str) -> float:
    return roofline.attention_flops(self.batch, self.length, self.length, self.heads,
                                    self.head_dim, causal=self.causal,
                                    backward=label == "fwd+bwd")

  def __str__(self):
    return f"{self.batch}x{self.length}x{self.heads}/{self.kv_heads}x{self.head_dim}"


def attention(smoke: bool) -> list[Attention]:
  if smoke:
    # Causal is in "gqa" and "all features" (a fourth shape cost the GPU check ~15 s).
    return [Attention("plain", 1, 200, 2, 2, 64),
            Attention("gqa", 1, 130, 4, 2, 96, causal=True),
            Attention("all features", 1, 200, 2, 2, 64, causal=True, window=(64, 0), segments=2,
                      soft_cap=30.0)]
  return [Attention("plain", 2, 4096, 16, 16, 128),
          Attention("causal", 2, 4096, 16, 16, 128, causal=True),
          Attention("gqa", 2, 4096, 32, 8, 128),
          Attention("gqa causal", 2, 4096, 32, 8, 128, causal=True),
          Attention("gqa h64", 2, 4096, 32, 8, 64),
          Attention("gqa h64 causal", 2, 4096, 32, 8, 64, causal=True),
          Attention("gqa h256", 2, 4096, 32, 8, 256),
          Attention("gqa h256 causal", 2, 4096, 32, 8, 256, causal=True),
          # The mask features on the plain shape: their time against the plain row's.
          Attention("segments x4", 2, 4096, 16, 16, 128, segments=4, anchors=False),
          Attention("window 1024", 2, 4096, 16, 16, 128, window=(1024, 1024), anchors=False),
          Attention("soft-cap", 2, 4096, 16, 16, 128, soft_cap=30.0, anchors=False),
          Attention("causal+segments+window+cap", 2, 4096, 16, 16, 128, causal=True,
                    window=(1024, 0), segments=4, soft_cap=30.0, anchors=False),
          Attention("bias", 4, 2048, 16, 16, 128, bias="bias"),
          Attention("bias with d(bias)", 4, 2048, 16, 16, 128, bias="bias+grad"),
          # Past head dim 128 the forward reads its bias tiles one buffer deep.
          Attention("bias with d(bias) h256", 2, 2048, 16, 16, 256, bias="bias+grad"),
          Attention("long causal", 1, 32768, 16, 16, 128, causal=True, check=False)]


# (batch, cache length, heads, kv heads, head_dim) of decode_attention's one query.
DECODE, SMOKE_DECODE = (8, 32768, 32, 8, 128), (2, 300, 4, 2, 64)
