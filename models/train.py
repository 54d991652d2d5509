"""python -m models.train --preset tiny [--steps N] [--checkpoint-dir DIR] ...

Trains the Llama model (``models.llama``) on a byte-level text corpus: optax's AdamW under a
linear warmup and cosine decay, with the gradients' global norm clipped; a progress bar with
the loss, tokens/s and MFU; orbax checkpoints. Run again with the same ``--checkpoint-dir`` and
it resumes where the last checkpoint stopped, on the same batches, to the same loss curve as a
run that was never stopped: the batch of step s is drawn from (seed, s) alone, and the
checkpoint holds the parameters, the optimizer's state and its step.

The corpus is the text of the Python standard library's modules (``--corpus`` takes a file or
a directory of text instead): nothing is fetched. Tokens are bytes (the presets' vocabularies
are at least 256).

The step runs on a mesh of every local device with axes ``data``, ``fsdp``, ``tensor`` and
``sequence`` (``--mesh data=2,fsdp=2,tensor=2``: an axis left out is 1, fsdp takes the devices
the others leave): the parameters and the optimizer's state laid out by their logical names
(``llama.place``: each weight's width over fsdp, its heads, MLP width or vocabulary over
tensor), the batch split over data and fsdp, the sequence over sequence. The layout chosen
and what it costs a device (parameters, optimizer state, the compiled step's activations) are
printed before the first step. On GPUs the step compiles with XLA's collective combiner
thresholds raised (``GPU_COMBINE_BYTES``: a layer's gradients leave as one collective); an
``XLA_FLAGS`` that sets one of them wins.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import signal
import sys
import sysconfig
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxkernels import hardware, partitioning, remat, tuning
from models import llama, programs

CORPUS_BYTES = 8 << 20  # the standard library's first 8 MiB of module text, in path order


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
        raise UsageError(f"--{_flag(name)} {getattr(self, name)}: must be at least 1")
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
        raise UsageError(f"--{_flag(name)} {getattr(self, name)}: must be {accepted}")


class UsageError(ValueError):
  """Input the CLI checked itself (flags, presets, the corpus, a checkpoint directory of
  another run): reported as a usage error. Anything else that fails is a bug, and keeps its
  traceback."""


def _flag(name: str) -> str:
  return name.replace("_", "-")


def optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=tc.learning_rate, warmup_steps=tc.warmup,
      decay_steps=tc.steps, end_value=tc.learning_rate * tc.final_lr_ratio)
  return optax.chain(
      optax.clip_by_global_norm(tc.clip),
      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay, mask=_decayed))


def _decayed(params):
  """AdamW's weight decay mask: the weight matrices, not the norms' scales (named ``scale``;
  not told apart by rank: stacked over the layers a scale is 2-d, as a matrix is)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: not any(getattr(key, "key", None) == "scale" for key in path), params)


# The corpus.

def corpus(path: str | None = None, limit: int = CORPUS_BYTES) -> tuple[np.ndarray, str]:
  """(the bytes, as uint8; what they are): ``path`` (a file, or a directory's files in path
  order), else the Python standard library's module text. At most ``limit`` bytes."""
  if path is None:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))
    described = f"the Python {sys.version_info.major}.{sys.version_info.minor} standard library"
  else:
    root = pathlib.Path(path)
    if not root.exists():
      raise UsageError(f"--corpus {path}: no such file or directory")
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    described = str(path)
  chunks, size = [], 0
  for file in files:
    if size >= limit:
      break
    chunks.append(file.read_bytes()[:limit - size])
    size += len(chunks[-1])
  data = np.frombuffer(b"".join(chunks), np.uint8)
  return data, f"{described}: {len(data)} bytes"


def fingerprint(data: np.ndarray) -> str:
  return hashlib.sha256(data.tobytes()).hexdigest()[:16]


def batch_at(data: np.ndarray, step: int, tc: TrainConfig) -> np.ndarray:
  """Step ``step``'s (batch, seq_len + 1) windows of the corpus: drawn from (seed, step) alone,
  so that a resumed run sees the batches an uninterrupted one would."""
  span = tc.seq_len + 1
  if len(data) < tc.batch * span:
    raise UsageError(f"the corpus ({len(data)} bytes) is shorter than one batch: batch "
                     f"{tc.batch} x (seq_len {tc.seq_len} + 1) = {tc.batch * span} tokens")
  return _windows(data, _starts(data, step, tc), span)


def _windows(data: np.ndarray, starts: np.ndarray, span: int) -> np.ndarray:
  """The corpus' windows of ``span`` tokens at ``starts``, int32 (batch_at's rows)."""
  return np.stack([data[s:s + span] for s in starts]).astype(np.int32)


def _starts(data: np.ndarray, step: int, tc: TrainConfig) -> np.ndarray:
  """Where each of step ``step``'s windows starts in the corpus."""
  span = tc.seq_len + 1
  return np.random.default_rng([tc.seed, step]).integers(0, len(data) - span + 1, tc.batch)


# The step.

def _devices() -> list:
  """Every device of the run: this process's, or with several processes (``distributed``)
  every process's."""
  return jax.devices()


def distributed(coordinator: str | None = None, num_processes: int | None = None,
                process_id: int | None = None) -> None:
  """Joins a run of several processes (hosts) through ``jax.distributed.initialize``: where
  ``coordinator`` is None, JAX reads the cluster from its environment (a Cloud TPU pod
  slice's, SLURM's, ...). Host CPUs exchange through gloo."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # host devices' collectives
  try:
    jax.distributed.initialize(coordinator, num_processes, process_id)
  except (RuntimeError, ValueError) as e:
    raise UsageError(f"--distributed: could not join the run ({type(e).__name__}: {e}); on a "
                     "machine with no cluster environment pass --coordinator HOST:PORT, "
                     "--num-processes and --process-id") from e


def parse_mesh(text: str) -> dict[str, int]:
  """``--mesh``'s value, "data=2,fsdp=2,tensor=2": each named axis' size (one of
  ``llama.MESH_AXES``, a whole number >= 1)."""
  sizes: dict[str, int] = {}
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, sep, value = part.partition("=")
    name = name.strip()
    if not sep or name not in llama.MESH_AXES or name in sizes:
      what = ("is not of the form axis=size" if not sep else
              f"names axis {name!r} twice" if name in sizes else f"has an unknown axis {name!r}")
      raise UsageError(f"--mesh {text!r} {what}; the axes are {', '.join(llama.MESH_AXES)}, "
                       "e.g. --mesh data=2,fsdp=2,tensor=2")
    try:
      sizes[name] = int(value)
    except ValueError:
      sizes[name] = 0
    if sizes[name] < 1:
      raise UsageError(f"--mesh {text!r}: {name}={value.strip()!r} must be a whole number >= 1")
  return sizes


def mesh(data: int = 1, devices=None, *, fsdp: int | None = None, tensor: int = 1,
         sequence: int = 1) -> jax.sharding.Mesh:
  """The devices on axes ``llama.MESH_AXES`` (data, fsdp, tensor, sequence), all Explicit;
  ``fsdp=None`` takes the devices the others leave."""
  devices = _devices() if devices is None else devices
  others = data * tensor * sequence
  if fsdp is None:
    if min(data, tensor, sequence) < 1 or len(devices) % others:
      raise UsageError(f"--mesh data={data},tensor={tensor},sequence={sequence} must divide "
                       f"the {len(devices)} devices (fsdp takes the rest)")
    fsdp = len(devices) // others
  shape = dict(zip(llama.MESH_AXES, (data, fsdp, tensor, sequence)))
  if min(shape.values()) < 1 or math.prod(shape.values()) != len(devices):
    raise UsageError(f"--mesh {_described(shape)} holds {math.prod(shape.values())} devices; "
                     f"there are {len(devices)}: the sizes' product must be the device count")
  return jax.make_mesh(tuple(shape.values()), llama.MESH_AXES,
                       axis_types=(AxisType.Explicit,) * len(shape), devices=devices)


def held(state, where: jax.sharding.Mesh) -> tuple[int, int]:
  """(parameter bytes, optimizer-state bytes) a device holds of (model, optimizer) ``state``
  (may be abstract) laid out on ``where`` by ``llama.place``."""
  shardings = llama.shardings(state, where)

  def local_bytes(x, sharding):
    parts = [partitioning.size(where, partitioning.axes(e)) for e in sharding.spec]
    return x.size * x.dtype.itemsize // math.prod(parts)

  return tuple(sum(jax.tree.leaves(jax.tree.map(local_bytes, state[i], shardings[i])))
               for i in (0, 1))


def layout(state, where: jax.sharding.Mesh) -> list[str]:
  """What ``llama.place`` does with (model, optimizer) ``state`` (may be abstract) on
  ``where``: a line per weight matrix (its shape, the stacked layers' in one, and its mesh
  spec), then the bytes a device holds of the parameters and of the optimizer's state."""
  model = state[0]
  shardings = llama.shardings(state, where)
  lines = []
  leaves = jax.tree_util.tree_leaves_with_path(model)
  for (path, x), sharding in zip(leaves, jax.tree.leaves(shardings[0]), strict=True):
    if x.ndim >= 2:
      keys = (getattr(k, "key", getattr(k, "name", k)) for k in path)
      name = ".".join(str(k) for k in keys if k != "value")
      lines.append(f"  {name:<22} {str(tuple(x.shape)):<22} {sharding.spec}")
  params, moments = held(state, where)
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model))
  lines.append(f"  a device holds {params / 2**20:.1f} MiB of the {total / 2**20:.1f} MiB of "
               f"parameters, and {moments / 2**20:.1f} MiB of optimizer state")
  return lines


def _bytes(n: int) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def device_limit(where: jax.sharding.Mesh) -> int | None:
  """The bytes a device's allocator may hold, where the device says (GPUs, TPUs), else None
  (this process's first device of the mesh: the others' are alike)."""
  mine = [d for d in where.devices.flat if d.process_index == jax.process_index()]
  stats = mine[0].memory_stats() or {}
  return stats.get("bytes_limit")


def _described(shape) -> str:
  return ",".join(f"{name}={size}" for name, size in dict(shape).items())


def init(cfg: llama.Config, tc: TrainConfig, where: jax.sharding.Mesh | None = None):
  """(graphdef, state) of the model and its optimizer, laid out on ``where``: one program
  makes them, its outputs laid out so, each device computing and holding its share alone (made
  whole and then placed, the first device held all of it, the optimizer's moments too: the
  measured peak of a step under fsdp 4 was that, 3.3 GiB over the step's own). A mesh that
  does not divide a parameter is refused first (``llama.check_divides``)."""
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: _model_and_optimizer(cfg, tc)))
  if where is not None:
    llama.check_divides(abstract, where)
  # Compiled on one device too, so that every layout starts from the same bits (an eager
  # initializer's scaling rounds apart from the compiled one's, by an ulp).
  make = jax.jit(lambda: nnx.state(_model_and_optimizer(cfg, tc)),
                 out_shardings=None if where is None else llama.shardings(abstract, where))
  return graphdef, make()


# XLA's combiner thresholds for the step on GPUs (its default is 30 MiB): at 256 MiB a layer's
# weight gradients leave as one reduce-scatter (fsdp) or all-reduce (data parallel), not one a
# weight, and its weights arrive as one all-gather. NCCL moves a few large collectives faster
# than many, and they run beside compute (whose kernels they slow) for less time: fsdp 4 on
# H100s, 0.904 -> 0.933 of linear, collectives 26.1 -> 16.0 ms a step (bench/NOTES.md,
# scaling-3).
GPU_COMBINE_BYTES = {f"xla_gpu_{op}_combine_threshold_bytes": 256 << 20
                     for op in ("reduce_scatter", "all_gather", "all_reduce")}


def compiler_options(platform: str | None = None) -> dict | None:
  """The train step's XLA options for ``platform`` (default: the default backend's): on GPUs
  ``GPU_COMBINE_BYTES``, each unless ``XLA_FLAGS`` sets it (the user's flag wins); elsewhere
  none."""
  if (platform or jax.default_backend()) != "gpu":
    return None
  flags = os.environ.get("XLA_FLAGS", "")
  return {k: v for k, v in GPU_COMBINE_BYTES.items() if f"--{k}=" not in flags} or None


def step_fn(graphdef, donate: bool = True, platform: str | None = None):
  """The jitted train step: (state, tokens) -> (state, {"loss", "grad_norm"}), the old state's
  buffers donated to the new (unless ``donate`` is False), compiled with
  :func:`compiler_options` for ``platform`` (default: the default backend's)."""

  return jax.jit(step_body(graphdef), donate_argnums=0 if donate else (),
                 compiler_options=compiler_options(platform))


def step_body(graphdef):
  """The train step, unjitted: (state, tokens) -> (state, {"loss", "grad_norm"})."""

  def step(state, tokens):
    model, opt = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(llama.loss_fn)(model, tokens)
    opt.update(model, grads)
    return nnx.state((model, opt)), {"loss": loss, "grad_norm": optax.tree.norm(grads)}

  return step


def auto_remat(cfg: llama.Config, tc: TrainConfig, budget: int | None = None,
               where: jax.sharding.Mesh | None = None):
  """(cfg with one remat policy per layer, the ``jaxkernels.remat.AutoChoice``): per layer the
  least recomputation whose compiled train step fits ``budget`` bytes a device (default: 95%
  of what the first device's allocator may hold). Compiles, never runs, the candidates."""
  if budget is None:
    budget = remat.device_budget()
  choice = remat.auto(
      lambda policies: compiled_peak(dataclasses.replace(cfg, remat=policies), tc, where),
      cfg.depth, budget, uniform=cfg.scan_layers)
  return dataclasses.replace(cfg, remat=choice.policies), choice


def compiled_step(cfg: llama.Config, tc: TrainConfig, where: jax.sharding.Mesh | None = None):
  """The train step's compiled program (for the first device, or ``where``; never run), with
  the model's op groups resolved for that device's platform (``llama.Config.for_platform``)."""
  tokens = jax.ShapeDtypeStruct((tc.batch, tc.seq_len + 1), jnp.int32,
                                sharding=batch_sharding(where))
  # For the mesh's devices, which may be another platform's (a TPU topology's, from a CPU).
  platform = None if where is None else where.devices.flat[0].platform
  cfg = cfg.for_platform(platform or jax.default_backend())
  graphdef, state = nnx.split(nnx.eval_shape(lambda: _model_and_optimizer(cfg, tc)))
  if where is not None:
    state = _abstract_on(state, where)
  with jax.set_mesh(where) if where is not None else contextlib.nullcontext():
    return step_fn(graphdef, platform=platform).lower(state, tokens).compile()


def compiled_peak(cfg: llama.Config, tc: TrainConfig,
                  where: jax.sharding.Mesh | None = None) -> int:
  """The peak bytes a device of the train step's compiled program needs (compiled for the
  first device, or ``where``; never run)."""
  return remat.compiled_peak_bytes(compiled_step(cfg, tc, where))


def abstract_state(cfg: llama.Config, tc: TrainConfig) -> nnx.State:
  """The (model, optimizer) state's shapes and dtypes, nothing allocated. Remat changes no
  shape, so a config whose remat is still "auto" has them too."""
  if cfg.remat == "auto":
    cfg = dataclasses.replace(cfg, remat="none")
  return nnx.state(nnx.eval_shape(lambda: _model_and_optimizer(cfg, tc)))


def _model_and_optimizer(cfg, tc):
  model = llama.Llama(cfg, rngs=nnx.Rngs(tc.seed))
  return model, nnx.Optimizer(model, optimizer(tc), wrt=nnx.Param)


def _abstract_on(state, where):
  """Abstract ``state`` with the layout ``llama.place`` gives on ``where``."""
  shardings = llama.shardings(state, where)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                      shardings)


def batch_sharding(where: jax.sharding.Mesh | None) -> NamedSharding | None:
  """The batch's layout on ``where``: its rows split over both axes."""
  return None if where is None else NamedSharding(where, P(llama.BATCH, None))


def shard_batch(tokens, where: jax.sharding.Mesh | None):
  """The (whole) batch ``tokens`` laid out on ``where``; each process places its rows."""
  if where is None:
    return jnp.asarray(tokens)
  return jax.make_array_from_callback(tokens.shape, batch_sharding(where),
                                      lambda index: tokens[index])


def batch_on(data: np.ndarray, step: int, tc: TrainConfig, where: jax.sharding.Mesh):
  """Step ``step``'s batch (:func:`batch_at`'s) laid out on ``where``, each process reading
  only the rows its devices hold (the data loader sharded per process)."""
  span = tc.seq_len + 1
  starts = _starts(data, step, tc)

  def rows(index):
    return _windows(data, starts[np.arange(tc.batch)[index[0]]], span)[:, index[1]]

  return jax.make_array_from_callback((tc.batch, span), batch_sharding(where), rows)


# Checkpoints.

def _identity(cfg: llama.Config, tc: TrainConfig, data: np.ndarray) -> dict:
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


def _resumed_warmup(tc: TrainConfig, there: dict | None) -> TrainConfig:
  """``tc`` with the warmup of the checkpoint it resumes (``there``, its identity), where the
  user left --warmup to its default: that default follows --steps, and a finished run that
  trains on with a larger --steps is the same run."""
  warmup = (there or {}).get("train", {}).get("warmup")
  if not tc.warmup_defaulted or not isinstance(warmup, int) or not 0 <= warmup < tc.steps:
    return tc
  return dataclasses.replace(tc, warmup=warmup)


def _differences(want: dict, got: dict, prefix="") -> list[str]:
  out = []
  for key in sorted(set(want) | set(got)):
    a, b = want.get(key), got.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      out += _differences(a, b, f"{prefix}{key}.")
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
    differences = [] if self.there is None else _differences(identity, self.there)
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


# The loop.

class Progress:
  """Every ``every`` steps and at the last: one line redrawn in place on a terminal, on a
  pipe a line each."""

  def __init__(self, total: int, every: int, stream=sys.stderr):
    self.total, self.every, self.stream = total, every, stream
    self.live = stream.isatty()

  def due(self, step: int) -> bool:
    """Whether step ``step`` gets a line."""
    return step % self.every == 0 or step == self.total

  def show(self, step: int, text: str) -> None:
    if self.live:
      done = int(30 * step / self.total)
      self.stream.write(f"\r[{'#' * done}{'.' * (30 - done)}] {step}/{self.total} {text}")
      if step == self.total:
        self.stream.write("\n")
      self.stream.flush()
    else:
      print(f"step {step}/{self.total} {text}", file=self.stream, flush=True)


def peak_flops(devices) -> float | None:
  chip = hardware.chip_for(devices[0].device_kind)
  return None if chip is None else chip.peak_flops["bfloat16"] * len(devices)


class _Stopper:
  """SIGINT (Ctrl-C) and SIGTERM while training: the step in flight finishes, the run saves a
  checkpoint (where it has a directory) and returns, instead of dying mid-step."""

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self):
    self.received: int | None = None
    self._before = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():  # signals reach only it
      for number in self.SIGNALS:
        self._before[number] = signal.signal(number, self._receive)
    return self

  def _receive(self, number, frame):
    del frame
    if self.received is not None:  # a second one: stop now, as the first would have
      raise KeyboardInterrupt
    self.received = number

  def __exit__(self, *exc):
    for number, handler in self._before.items():
      signal.signal(number, handler)


@dataclasses.dataclass
class Outcome:
  """What a call of :func:`train` did: the losses of the steps it ran, and why it stopped
  early (None where it reached ``tc.steps``)."""

  losses: list[float]
  stopped: str | None = None
  code: int = 0  # the CLI's exit status: 0, 1 (the loss diverged), 128 + a signal's number
  tokens_per_s: float | None = None  # over the last interval shown
  step: int | None = None  # the last step run


def train(cfg: llama.Config, tc: TrainConfig, *, corpus_path: str | None = None,
          checkpoint_dir: str | None = None, checkpoint_every: int = 100,
          mesh_sizes: dict[str, int] | None = None, metrics_path: str | None = None,
          log_every: int = 10,
          remat_budget: int | None = None, stream=None) -> Outcome:
  """Trains to ``tc.steps``, resuming from ``checkpoint_dir``'s latest checkpoint.
  ``remat_budget``: bytes a device for remat="auto" (default: 95% of the device's memory).

  Stops early, saying why, where a step's loss or gradient norm is not finite (no checkpoint
  is written from that step on: the last one holds the last good state) or where SIGINT or
  SIGTERM arrives (the step in flight finishes and is saved)."""
  stream = sys.stderr if stream is None else stream
  if jax.process_index() != 0:  # one process of several speaks and writes the metrics
    stream, metrics_path = open(os.devnull, "w"), None  # noqa: SIM115 - for the whole run
  if checkpoint_every < 1 or log_every < 1:
    raise UsageError(f"--checkpoint-every {checkpoint_every} and --log-every {log_every}: "
                     "each must be at least 1")
  data, described = corpus(corpus_path)
  batch_at(data, 0, tc)  # a corpus shorter than one batch fails here, before anything is written
  where = mesh(**(mesh_sizes or {}))
  cfg = cfg.for_platform(where.devices.flat[0].platform)
  on = f"--mesh {_described(where.shape)} ({where.size} devices)"
  rows = math.prod(where.shape[a] for a in llama.BATCH)
  if tc.batch % rows:
    raise UsageError(f"--batch {tc.batch} must be a multiple of the {rows} devices of data x "
                     f"fsdp that split it ({on})")
  if cfg.fp8 and where.size > 1:
    raise UsageError(f"--fp8 runs on one device ({on}): its blocks' quantization is not yet "
                     "laid out over a mesh; use --mesh data=1 with one device, or leave --fp8 "
                     "out")
  if tc.seq_len % where.shape["sequence"]:
    raise UsageError(f"--seq-len {tc.seq_len} must be a multiple of the sequence axis' "
                     f"{where.shape['sequence']} devices that split it ({on})")
  abstract = abstract_state(cfg, tc)
  try:  # before anything is written: the layout of the model's shapes alone
    llama.check_divides(abstract, where)
  except ValueError as e:
    raise UsageError(f"{on}: {e}") from e
  params, moments = held(abstract, where)
  if (limit := device_limit(where)) is not None and params + moments > limit:
    raise UsageError(
        f"{on}: a device would hold {_bytes(params)} of parameters and {_bytes(moments)} of "
        f"optimizer state, more than its {_bytes(limit)}; spread them over more devices (a "
        "larger fsdp or tensor axis)")
  checkpoints = None
  if checkpoint_dir is not None:
    checkpoints = Checkpoints(checkpoint_dir)
    tc = _resumed_warmup(tc, checkpoints.there)
    checkpoints.check(_identity(cfg, tc, data))
  start = (checkpoints.latest() if checkpoints is not None else None) or 0  # where it resumes
  if cfg.remat == "auto" and start >= tc.steps:
    # No step will run, so none to fit: no probe (each candidate is a compile of the step).
    # Remat changes no shape: the state restores as it would under any policy.
    cfg = dataclasses.replace(cfg, remat="none")
  elif cfg.remat == "auto":
    try:
      cfg, choice = auto_remat(cfg, tc, remat_budget, where)
    except ValueError as e:  # no plan fits --remat-budget
      raise UsageError(str(e)) from e
    print(choice, file=stream, flush=True)
  graphdef, state = init(cfg, tc, where)
  if start:
    state = checkpoints.restore(start, state)
  kernels = cfg.kernels + (f" (on XLA: {', '.join(cfg.reference_ops)})"
                           if cfg.reference_ops and cfg.kernels != "xla" else "")
  print(f"kernels={kernels}; corpus: {described}; mesh {dict(where.shape)}; "
        f"{sum(x.size for x in jax.tree.leaves(nnx.state(state, nnx.Param)))/1e6:.1f}M "
        f"parameters; " + (f"resumed at step {start}" if start else "from step 0"),
        file=stream, flush=True)
  print("layout:\n" + "\n".join(layout(state, where)), file=stream, flush=True)
  if start >= tc.steps:
    print(f"nothing to do: the checkpoint is at step {start} of {tc.steps} (a larger --steps "
          "trains on)", file=stream)
  progress = Progress(tc.steps, log_every, stream)
  peak = peak_flops(list(where.devices.flat))
  report = functools.partial(_report, cfg=cfg, tc=tc, peak=peak, progress=progress)
  outcome = Outcome([])
  saved = start if checkpoints is not None and start else None
  with contextlib.ExitStack() as stack:
    metrics_file = stack.enter_context(open(metrics_path, "a")) if metrics_path else None
    stopper = stack.enter_context(_Stopper())
    stack.enter_context(jax.set_mesh(where))
    if start < tc.steps:  # compiled here, to say how long it took (the calls below reuse it)
      began = time.perf_counter()
      lowered, run, loaded = lower_step(cfg, tc, graphdef, state,
                                        batch_on(data, start, tc, where), where)
      lowered_at = time.perf_counter()
      compiled = lowered.compile()
      step = run(compiled)
      how = " (the program kept by an earlier run)" if loaded else ""
      print(f"train step: traced and lowered in {lowered_at - began:.1f} s{how}, compiled in "
            f"{time.perf_counter() - lowered_at:.1f} s", file=stream, flush=True)
      if (memory := compiled.memory_analysis()) is not None:
        print(f"  a device's step needs {memory.temp_size_in_bytes / 2**20:.1f} MiB beyond its "
              "arguments (activations and the gradients' buffers, as compiled)", file=stream,
              flush=True)
    pending, meter = None, Meter(start, tc.batch * tc.seq_len)

    def flush():
      """Reports the pending step; False where its numbers are not finite."""
      nonlocal pending
      done, metrics = pending
      loss, grad_norm = report(done, metrics, meter, metrics_file=metrics_file)
      outcome.losses.append(loss)
      outcome.tokens_per_s, outcome.step = meter.shown or meter.step_rate, done
      pending = None
      if math.isfinite(loss) and math.isfinite(grad_norm):
        return True
      kept = (f"the last checkpoint, step {saved}, holds the last good state" if saved
              else "no checkpoint was written")
      outcome.stopped = (f"stopped at step {done}: its loss is {loss} and its gradients' norm "
                         f"{grad_norm}; {kept}. Try a lower --learning-rate or --clip")
      outcome.code = 1
      return False

    for s in range(start, tc.steps):
      state, metrics = step(state, batch_on(data, s, tc, where))
      if pending is not None and not flush():  # the previous step's, read while this one runs
        break
      pending = (s + 1, metrics)
      # The signal read once a step: one landing between the save's decision and the stop's
      # (while the step was waited for, say) stopped the run unsaved, saying it had saved (the
      # GPU check: SIGINT at step 55, resumed from 0). One that lands after this read is the
      # next step's.
      received = stopper.received
      save = checkpoints is not None and (
          received is not None or s + 1 == tc.steps or (s + 1) % checkpoint_every == 0)
      # A step that gets a line is waited for here, right after it is dispatched: its clock
      # is then read as it finishes whether the device or the host is the slower, and each
      # line's interval holds its own steps (read one step behind, as the others are, a run
      # whose host is the slower showed the last line at twice the rate: nothing followed it).
      if save or received is not None or progress.due(s + 1):
        if not flush():  # never save a state that a non-finite step made
          break
        if save:
          checkpoints.save(s + 1, state)
          saved, meter.saves = s + 1, meter.saves + 1
      if received is not None and s + 1 < tc.steps:
        name = signal.Signals(received).name
        outcome.stopped = (f"stopped at step {s + 1} by {name}; " + (
            "saved: the same command resumes" if checkpoints is not None else
            "nothing saved (no --checkpoint-dir)"))
        outcome.code = 128 + received
        break
    if pending is not None:
      flush()
  if checkpoints is not None:
    checkpoints.close()
  return outcome


class Meter:
  """Tokens/s over each shown interval of steps. The clock is read as soon as a step's result
  is on the host, before anything is printed or written: read after the report, the report's
  own time fell out of the next interval and the rate was over-counted. (The loop waits for
  each shown step as it is dispatched, so that its clock is read as it finishes.)"""

  def __init__(self, step: int, tokens_per_step: int):
    self.tokens_per_step = tokens_per_step
    self.step, self.at = step, time.perf_counter()  # the last step ready, and when
    self.since, self.since_at = self.step, self.at  # where the shown interval began
    self.step_rate: float = 0.0  # the last step's tokens/s
    self.shown: float | None = None  # the last shown interval's tokens/s
    self.saves = 0  # checkpoints written in the interval: their time is in its rate

  def ready(self, step: int) -> None:
    """Step ``step``'s result is on the host."""
    now = time.perf_counter()
    self.step_rate = (step - self.step) * self.tokens_per_step / max(now - self.at, 1e-9)
    self.step, self.at = step, now

  def interval(self) -> float:
    """Tokens/s since the last shown interval ended, which this one now ends."""
    rate = (self.step - self.since) * self.tokens_per_step / max(self.at - self.since_at, 1e-9)
    self.since, self.since_at, self.shown = self.step, self.at, rate
    return rate

  def said(self) -> str:
    """What the shown interval held beside its steps (then forgotten)."""
    saves, self.saves = self.saves, 0
    return f" (with {saves} checkpoint save{'s' * (saves > 1)})" if saves else ""


def _report(step, metrics, meter, *, cfg, tc, peak, progress, metrics_file):
  metrics = jax.device_get(metrics)  # waits for the step
  meter.ready(step)
  loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
  if progress.due(step):
    rate = meter.interval()
    mfu = f"{llama.mfu(cfg, rate, tc.seq_len, peak):.1f}%" if peak else "n/a"
    progress.show(step, f"loss {loss:.4f} | {rate:,.0f} tokens/s | MFU {mfu}{meter.said()}")
  if metrics_file:
    metrics_file.write(json.dumps({"step": step, "loss": loss, "grad_norm": grad_norm,
                                   "tokens_per_s": meter.step_rate}) + "\n")
    metrics_file.flush()
  return loss, grad_norm


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
  """The module's docstring as written, and every flag's default in --help (where its help
  does not already say it)."""

  def _get_help_string(self, action):
    if action.default is None or action.default is False or "default" in (action.help or ""):
      return action.help
    return super()._get_help_string(action)


_FLAG_HELP = {
    "steps": "steps to train to (a resumed run counts from its checkpoint)",
    "batch": "sequences a step", "seq_len": "tokens a sequence",
    "learning_rate": "AdamW's peak learning rate",
    "warmup": "steps of linear warmup (default: a tenth of --steps, at most 30)",
    "final_lr_ratio": "the cosine decays to --learning-rate times this",
    "weight_decay": "AdamW's, on the weight matrices", "clip": "the gradients' global norm",
    "seed": "of the parameters and the batches"}


def _train_flags():
  """TrainConfig's fields that the CLI sets, one flag each."""
  return [f for f in dataclasses.fields(TrainConfig) if f.init]


def lower_step(cfg: llama.Config, tc: TrainConfig, graphdef, state, tokens,
               where: jax.sharding.Mesh | None = None):
  """(lowered, run, loaded): the train step lowered for (state, tokens) as the CLI lowers it,
  ``run(lowered.compile())`` the step to call, and whether the program was one an earlier run
  kept (:func:`kept_programs`, where JAX's compilation cache is on; else traced here)."""
  kept = kept_programs()
  if kept is None:
    return step_fn(graphdef).lower(state, tokens), lambda compiled: compiled, False
  program = programs.Program(
      step_body(graphdef), state, tokens, directory=kept, compiler_options=compiler_options(),
      described=program_description(cfg, tc, where))
  return program.lowered, lambda compiled: functools.partial(program.run, compiled), \
      program.loaded


def program_description(cfg: llama.Config, tc: TrainConfig,
                        where: jax.sharding.Mesh | None = None) -> dict:
  """What of a run decides its train step's program (part of a kept program's key): the
  model's and training's configs (the schedule's constants are in the program), the mesh; not
  how a field got its value (``warmup_defaulted``: a resumed run keeps its checkpoint's warmup
  through another path, and must find the program its first run kept)."""
  train = {f.name: getattr(tc, f.name) for f in dataclasses.fields(tc) if f.compare}
  return {"model": dataclasses.asdict(cfg), "train": train,
          "mesh": None if where is None else _described(where.shape)}


def kept_programs() -> pathlib.Path | None:
  """Where the train step's lowered program is kept across runs (:mod:`models.programs`):
  beside JAX's persistent compilation cache, where that is on, in one process."""
  cache = jax.config.values.get("jax_compilation_cache_dir")
  if not cache or jax.process_count() > 1:
    return None
  return pathlib.Path(cache) / "jaxkernels-programs"


def default_compilation_cache() -> str:
  return str(tuning.cache_dir() / "xla")


def parser() -> argparse.ArgumentParser:
  """The CLI's flags."""
  parser = argparse.ArgumentParser(prog="python -m models.train", description=__doc__,
                                   formatter_class=_Formatter)
  parser.add_argument("--preset", default="tiny", help=f"one of {', '.join(llama.PRESETS)}")
  parser.add_argument("--kernels", default="jaxkernels", help=f"one of {llama.KERNELS}")
  parser.add_argument("--reference-ops", default=None, help="with the kernels: these op "
                      f"groups (comma-separated, of {', '.join(llama.OPS)}) run as --kernels xla "
                      "runs them, to find which kernel a difference comes from (default: none "
                      f"on a GPU; on a TPU {','.join(llama.TPU_REFERENCE_OPS)}, which XLA:TPU "
                      "fuses into its dots)")
  parser.add_argument("--remat", default=None, help=f"one of {remat.POLICIES}, or auto "
                      "(default: the preset's, none)")
  parser.add_argument("--stream", default="float32", help=f"the residual stream's dtype, one "
                      f"of {', '.join(llama.STREAMS)} (a 16-bit one, as plain-JAX Llamas keep "
                      "it, halves its traffic; float32 keeps every layer's sum exact to f32)")
  parser.add_argument("--fp8", action="store_true", help="the blocks' products in fp8, "
                      "forward and backward (e4m3, DeepSeek-V3's block scales; one device)")
  parser.add_argument("--remat-budget", type=float, default=None, help="GiB a device for "
                      "--remat auto (default: 95%% of the device's memory)")
  for field in _train_flags():
    kind = int if field.name == "warmup" else type(field.default)
    parser.add_argument(f"--{_flag(field.name)}", type=kind, default=field.default,
                        help=_FLAG_HELP[field.name])
  parser.add_argument("--corpus", default=None, help="a text file or directory (default: the "
                      "Python standard library's modules)")
  parser.add_argument("--checkpoint-dir", default=None, help="resume from it, save into it")
  parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between "
                      "checkpoints (and at the end, and on SIGINT/SIGTERM)")
  parser.add_argument("--mesh", default="", help="devices on each mesh axis, e.g. "
                      "data=2,fsdp=2,tensor=2,sequence=1: the axes are "
                      f"{', '.join(llama.MESH_AXES)}; one left out is 1, fsdp takes the devices "
                      "the others leave (default: every device on fsdp)")
  parser.add_argument("--distributed", action="store_true", help="one process of a run on "
                      "several hosts: jax.distributed.initialize() from the cluster's "
                      "environment (a Cloud TPU pod slice, SLURM), or from --coordinator")
  parser.add_argument("--coordinator", default=None, help="HOST:PORT of process 0, for "
                      "--distributed where no cluster environment says it")
  parser.add_argument("--num-processes", type=int, default=None, help="with --coordinator")
  parser.add_argument("--process-id", type=int, default=None, help="with --coordinator")
  parser.add_argument("--metrics", default=None, help="append each step's numbers here (JSON "
                      "lines)")
  parser.add_argument("--log-every", type=int, default=10, help="steps between progress lines "
                      "(redrawn in place on a terminal)")
  parser.add_argument("--compilation-cache", default=default_compilation_cache(),
                      help="JAX's persistent compilation cache: a second run of the same "
                      "step loads its compiled program from here")
  parser.add_argument("--no-compilation-cache", action="store_true",
                      help="compile everything afresh, and write no cache")
  return parser


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  if args.coordinator is not None or args.num_processes is not None or (
      args.process_id is not None):
    args.distributed = True
  if args.distributed:
    try:
      distributed(args.coordinator, args.num_processes, args.process_id)
    except UsageError as e:
      print(f"python -m models.train: error: {e}", file=sys.stderr)
      return 2
  if not args.no_compilation_cache:
    jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
  try:
    changes = {"kernels": args.kernels, "stream": args.stream,
               "reference_ops": (None if args.reference_ops is None else
                                 tuple(op for op in args.reference_ops.split(",") if op))}
    if args.remat is not None:
      changes["remat"] = args.remat
    if args.fp8:
      changes["fp8"] = True
    try:
      cfg = llama.preset(args.preset, **changes)
    except ValueError as e:  # the preset's name, --kernels, --stream, --reference-ops, --remat
      raise UsageError(str(e)) from e
    tc = TrainConfig(**{f.name: getattr(args, f.name) for f in _train_flags()})
    if tc.seq_len > cfg.max_len:
      raise UsageError(f"--seq-len {tc.seq_len} is longer than the preset's max_len "
                       f"{cfg.max_len}")
    outcome = train(cfg, tc, corpus_path=args.corpus, checkpoint_dir=args.checkpoint_dir,
                    checkpoint_every=args.checkpoint_every, mesh_sizes=parse_mesh(args.mesh),
                    metrics_path=args.metrics, log_every=args.log_every,
                    remat_budget=None if args.remat_budget is None else
                    int(args.remat_budget * 2**30))
  except UsageError as e:
    print(f"python -m models.train: error: {e}", file=sys.stderr)
    return 2
  if outcome.stopped:
    print(f"python -m models.train: {outcome.stopped}", file=sys.stderr)
  if outcome.losses and outcome.code != 1 and jax.process_index() == 0:
    print(summary(outcome), flush=True)
  return outcome.code


def summary(outcome: Outcome) -> str:
  """The run's one line on stdout, for scripts: ``final loss L at step S`` first, then the
  perplexity a byte and the last interval's tokens/s."""
  loss = outcome.losses[-1]
  rate = f", {outcome.tokens_per_s:,.0f} tokens/s" if outcome.tokens_per_s else ""
  return (f"final loss {loss:.4f} at step {outcome.step} ({math.exp(min(loss, 50)):.2f} "
          f"perplexity per byte{rate})")


if __name__ == "__main__":
  sys.exit(main())
