"""The training run's configuration (``TrainConfig``: what, with the model's Config and the
corpus, decides the loss curve) and its optimizer: optax's AdamW under a linear warmup and
cosine decay, the gradients' global norm clipped."""

from __future__ import annotations

import dataclasses
import math

import jax
import optax

@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """What, with the model's Config and the corpus, decides the loss curve; a checkpoint
  directory holds one of each, and a resumed run must match it."""

  steps: int = 300
  batch: int = 16
  seq_len: int = 128
  learning_rate: float = 3e-3
  warmup: int | None = None  # steps of linear warmup; None: a tenth of the steps, at most 30
  final_lr_ratio: float = 0.1  # the cosine ends at learning_rate times this
  weight_decay: float = 0.1  # on the weight matrices, not the norms' scales
  clip: float = 1.0  # the gradients' global norm
  seed: int = 0  # the parameters' and the batches'
  # Whether warmup came from its default (a tenth of the steps): a resumed run then keeps the
  # warmup its checkpoint was written with, so that a finished run trains on with more steps.
  warmup_defaulted: bool = dataclasses.field(default=False, init=False, repr=False,
                                             compare=False)

  def __post_init__(self):
    for name in ("steps", "batch", "seq_len"):
      if getattr(self, name) < 1:
        raise UsageError(f"--{flag(name)} {getattr(self, name)}: must be at least 1")
    if not 0 <= self.seed < 2**32:  # NumPy's generator and jax.random both take this range
      raise UsageError(f"--seed {self.seed}: must be a whole number in [0, 2**32)")
    if self.warmup is None:
      object.__setattr__(self, "warmup", min(30, self.steps // 10))
      object.__setattr__(self, "warmup_defaulted", True)
    if not 0 <= self.warmup < self.steps:
      raise UsageError(f"--warmup {self.warmup}: must be in [0, --steps {self.steps})")
    for name, ok, accepted in (
        ("learning_rate", lambda v: 0 < v < math.inf, "a finite number > 0"),
        ("final_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
        ("weight_decay", lambda v: 0 <= v < math.inf, "a finite number >= 0"),
        ("clip", lambda v: 0 < v < math.inf, "a finite number > 0")):
      if not ok(getattr(self, name)):  # NaN fails every comparison
        raise UsageError(f"--{flag(name)} {getattr(self, name)}: must be {accepted}")


class UsageError(ValueError):
  """Input the CLI checked itself (flags, presets, the corpus, a checkpoint directory of
  another run): reported as a usage error. Anything else that fails is a bug, and keeps its
  traceback."""


def flag(name: str) -> str:
  return name.replace("_", "-")


def optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=tc.learning_rate, warmup_steps=tc.warmup,
      decay_steps=tc.steps, end_value=tc.learning_rate * tc.final_lr_ratio)
  return optax.chain(
      optax.clip_by_global_norm(tc.clip),
      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay, mask=decayed))


def decayed(params):
  """AdamW's weight decay mask: the weight matrices, not the norms' scales (named ``scale``;
  not told apart by rank: stacked over the layers a scale is 2-d, as a matrix is)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: not any(getattr(key, "key", None) == "scale" for key in path), params)
