"""Orbax checkpoints: the parameters, the optimizer's state and its step, beside the identity of
the run that wrote them (the model's Config, the TrainConfig, the corpus's fingerprint); a
resumed run must match it, and says what differs where it does not."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import numpy as np
from flax import nnx

from models import llama
from models.hparams import TrainConfig, UsageError
from models.batches import fingerprint

def run_identity(cfg: llama.Config, tc: TrainConfig, data: np.ndarray) -> dict:
  """What a checkpoint directory's run was, as its JSON holds it. Not its length: a finished
  run trains on with a larger ``--steps`` (the cosine then decays over the new length); not
  its ``--reference-ops`` (a switch for finding where a difference comes from, which leaves
  the state as it is; checkpoints from before it existed stay whole)."""
  train = {k: v for k, v in dataclasses.asdict(tc).items()
           if k not in ("steps", "warmup_defaulted")}
  # Older runs have no fp8 and no stream: a field at its old behaviour is left out.
  model = {k: v for k, v in dataclasses.asdict(cfg).items()
           if k != "reference_ops" and not (k == "fp8" and not v)
           and not (k == "stream" and v == "float32")}
  return json.loads(json.dumps({"model": model, "train": train,
                                "corpus": fingerprint(data)}))


def resumed_warmup(tc: TrainConfig, there: dict | None) -> TrainConfig:
  """``tc`` with the warmup of the checkpoint it resumes (``there``, its identity), where the
  user left --warmup to its default: that default follows --steps, and a finished run that
  trains on with a larger --steps is the same run."""
  warmup = (there or {}).get("train", {}).get("warmup")
  if not tc.warmup_defaulted or not isinstance(warmup, int) or not 0 <= warmup < tc.steps:
    return tc
  return dataclasses.replace(tc, warmup=warmup)


def config_differences(want: dict, got: dict, prefix="") -> list[str]:
  out = []
  for key in sorted(set(want) | set(got)):
    a, b = want.get(key), got.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      out += config_differences(a, b, f"{prefix}{key}.")
    elif a != b:
      out.append(f"{prefix}{key}: {b!r} there, {a!r} here")
  return out


class Checkpoints:
  """Orbax checkpoints of (state, identity) in ``directory``, kept ``keep`` deep. Opening a
  directory that holds another run's checkpoints (``check``, or ``identity`` given) raises
  before anything is written; ``there`` is the identity its latest checkpoint holds (None in
  a new directory)."""

  def __init__(self, directory: str, identity: dict | None = None, keep: int = 2):
    import orbax.checkpoint as ocp
    self._ocp = ocp
    self.directory = pathlib.Path(directory).absolute()
    if self.directory.exists() and not self.directory.is_dir():
      raise UsageError(f"--checkpoint-dir {directory}: is a file, not a directory")
    self.manager = ocp.CheckpointManager(
        self.directory, item_names=("state", "identity"),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))
    self.named, self.identity, self.there = directory, None, None
    step = self.latest()
    if step is not None:
      try:
        self.there = self.manager.restore(step, args=ocp.args.Composite(
            identity=ocp.args.JsonRestore()))["identity"]
      except Exception as e:  # noqa: BLE001 - a directory some other program wrote
        raise UsageError(f"--checkpoint-dir {directory}: step {step} there is not a "
                         f"models.train checkpoint ({type(e).__name__}); nothing was "
                         "changed") from e
    if identity is not None:
      self.check(identity)

  def check(self, identity: dict) -> None:
    """Takes ``identity`` as this run's, raising where the directory's checkpoints are
    another's."""
    differences = [] if self.there is None else config_differences(identity, self.there)
    if differences:
      raise UsageError(
          f"--checkpoint-dir {self.named}: its checkpoints were written by another config; "
          f"nothing was changed. Differences: {'; '.join(differences)}. Pass the same "
          "options to resume, or another directory to start afresh")
    self.identity = identity

  def latest(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state) -> None:
    ocp = self._ocp
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(nnx.to_pure_dict(state)),
        identity=ocp.args.JsonSave(self.identity)))

  def restore(self, step: int, state):
    """``state`` (the freshly initialised one: its shapes, dtypes and layout) with step
    ``step``'s values."""
    ocp = self._ocp
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          nnx.to_pure_dict(state))
    values = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target)))["state"]
    nnx.replace_by_pure_dict(state, values)
    return state

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
