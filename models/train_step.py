"""The train step: the model and optimizer built and laid out on the mesh, the step jitted
(donated state, GPU collective thresholds), lowered or loaded from an earlier run's program
(``programs``), compiled, its peak memory read; remat chosen under a memory budget."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pathlib

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxkernels import remat, tuning
from models import llama, programs
from models.hparams import TrainConfig, optimizer
from models.batches import batch_sharding
from models.placement import describe_shape

def init(cfg: llama.Config, tc: TrainConfig, where: jax.sharding.Mesh | None = None):
  """(graphdef, state) of the model and its optimizer, laid out on ``where``: one program
  makes them, its outputs laid out so, each device computing and holding its share alone (made
  whole and then placed, the first device held all of it, the optimizer's moments too: the
  measured peak of a step under fsdp 4 was that, 3.3 GiB over the step's own). A mesh that
  does not divide a parameter is refused first (``llama.check_divides``)."""
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: model_and_optimizer(cfg, tc)))
  if where is not None:
    llama.check_divides(abstract, where)
  # Compiled on one device too, so that every layout starts from the same bits (an eager
  # initializer's scaling rounds apart from the compiled one's, by an ulp).
  make = jax.jit(lambda: nnx.state(model_and_optimizer(cfg, tc)),
                 out_shardings=None if where is None else llama.shardings(abstract, where))
  return graphdef, make()


# XLA's combiner thresholds for the step on GPUs (its default is 30 MiB): at 256 MiB a layer's
# weight gradients leave as one reduce-scatter (fsdp) or all-reduce (data parallel), not one a
# weight, and its weights arrive as one all-gather. NCCL moves a few large collectives faster
# than many, and they run beside compute (whose kernels they slow) for less time: fsdp 4 on
# H100s, 0.904 -> 0.933 of linear, collectives 26.1 -> 16.0 ms a step (notes/scale.md,
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
  graphdef, state = nnx.split(nnx.eval_shape(lambda: model_and_optimizer(cfg, tc)))
  if where is not None:
    state = abstract_on(state, where)
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
  return nnx.state(nnx.eval_shape(lambda: model_and_optimizer(cfg, tc)))


def model_and_optimizer(cfg, tc):
  model = llama.Llama(cfg, rngs=nnx.Rngs(tc.seed))
  return model, nnx.Optimizer(model, optimizer(tc), wrt=nnx.Param)


def abstract_on(state, where):
  """Abstract ``state`` with the layout ``llama.place`` gives on ``where``."""
  shardings = llama.shardings(state, where)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                      shardings)


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
          "mesh": None if where is None else describe_shape(where.shape)}


def kept_programs() -> pathlib.Path | None:
  """Where the train step's lowered program is kept across runs (:mod:`models.programs`):
  beside JAX's persistent compilation cache, where that is on, in one process."""
  cache = jax.config.values.get("jax_compilation_cache_dir")
  if not cache or jax.process_count() > 1:
    return None
  return pathlib.Path(cache) / "jaxkernels-programs"


def default_compilation_cache() -> str:
  return str(tuning.cache_dir() / "xla")
