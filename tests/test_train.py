"""python -m models.train: a run killed mid-way resumes to the loss curve of a run never
stopped; the step laid out fully sharded over 8 devices matches one device step for step;
remat="auto" fits its budget; checkpoints restore onto another mesh; the kept program. The
CLI as a user meets it (bad input, signals, refused checkpoints): tests/test_train_cli.py."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import signal
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxkernels import remat
from models import batches, checkpointing, hparams, llama, loop, placement, train_step
from tests import numerics
from tests.runs import ROOT, curve as _curve, launch as _launch, wait_for_steps as _wait_for_steps

# The GPU check's train-125m and interrupt steps run this one and test_train_cli's SIGINT one
# on the device, at the README's sizes; CI runs both at the tiny preset (14 s and 10 s on its
# cores).
def test_killed_run_resumes_to_the_same_curve(tmp_path):
  whole, whole_metrics = _launch(tmp_path, "whole")
  assert whole.wait(timeout=300) == 0, whole.stdout.read()
  want = _curve(whole_metrics)
  assert sorted(want) == list(range(1, 25))
  assert want[24] < want[1] - 0.5, want  # it learned

  checkpoints = tmp_path / "checkpoints"
  killed, metrics = _launch(tmp_path, "resumed", "--checkpoint-dir", str(checkpoints))
  _wait_for_steps(killed, metrics, 14)
  killed.send_signal(signal.SIGKILL)  # past the checkpoint of step 12, before the last one
  killed.wait()
  assert max(_curve(metrics)) < 24
  resumed, _ = _launch(tmp_path, "resumed", "--checkpoint-dir", str(checkpoints))
  out = resumed.communicate(timeout=300)[0]
  assert resumed.returncode == 0, out
  # From the last checkpoint that was whole: the kill may land in a save (orbax writes to a
  # temporary directory and renames it when done), and then it is the one before.
  resumed_at = int(re.search(r"resumed at step (\d+)", out).group(1))
  assert resumed_at in (6, 12, 18) and resumed_at <= max(_curve(metrics)), out
  assert _curve(metrics) == want  # every step's loss, bit for bit


def test_fully_sharded_step_matches_one_device():
  """The batch over (data 2, fsdp 4), every weight split over fsdp along its width: the same
  losses, step for step, as on one device, and the weights and Adam's moments stay split.
  Each weight is gathered in its op's map, so its gradient leaves as a reduce-scatter over
  fsdp of each device's share: no all-reduce over fsdp carries a weight matrix (but the
  embedding table's, whose lookup is XLA's)."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  cfg = llama.preset("tiny", max_len=32, depth=1)
  tc = hparams.TrainConfig(steps=10, warmup=2, batch=8, seq_len=32)
  data, _ = batches.corpus()
  losses = []
  for where in (None, placement.mesh(data=2)):
    graphdef, state = train_step.init(cfg, tc, where)
    step = train_step.step_fn(graphdef)
    got = []
    with jax.set_mesh(where) if where is not None else contextlib.nullcontext():
      if where is not None:
        text = step.lower(state, batches.shard_batch(batches.batch_at(data, 0, tc), where)
                          ).compile().as_text()
      for s in range(3):
        state, metrics = step(state, batches.shard_batch(batches.batch_at(data, s, tc), where))
        got.append(float(metrics["loss"]))
    losses.append(got)
    if where is not None:
      model, opt = nnx.merge(graphdef, state)
      assert model.blocks.qkv[...].sharding.spec == P(None, "fsdp", None, None, None)
      assert model.blocks.mlp.down[...].sharding.spec == P(None, None, "fsdp")
      assert model.embed.embedding[...].sharding.spec == P(None, "fsdp")
      moments = jax.tree.leaves(nnx.state(opt))
      assert sum("fsdp" in str(x.sharding.spec) for x in moments) == 2 * 6  # mu and nu of the 6 weight matrices
  # Float32 throughout; the gradients' sums over the batch and the gathers run in another order.
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
  over_fsdp = [c for c in collectives(text)  # device d * 4 + f: fsdp's groups, or all 8
               if c[2] in (((0, 1, 2, 3), (4, 5, 6, 7)), (tuple(range(8)),))]
  scattered = [c for c in over_fsdp if c[0] == "reduce-scatter"]
  assert len(scattered) == 4 * cfg.depth + 1, over_fsdp  # qkv, out, gate_up, down; the head
  matrices = [shape for kind, shape, _ in over_fsdp if kind == "all-reduce" and "," in shape]
  assert set(matrices) <= {f"f32[{cfg.vocab},{cfg.width}]"}, over_fsdp


_COLLECTIVE = re.compile(r"= (\(.*?\)|\S+) (all-reduce|all-gather|reduce-scatter|"
                         r"collective-permute|all-to-all)(?:-start)?\(.*?replica_groups="
                         r"(mesh\[[^\]]*\](?:, device_ids=\(\S+\))? \{[^}]*\}|\S+)")


def _groups(text: str) -> tuple[tuple[int, ...], ...]:
  """Replica groups as device ids, from any of XLA's spellings: explicit ({{0,1},{2,3}}), iota
  ([4,2]<=[4,2]T(1,0)), or mesh axes (mesh['data'=2,'tensor'=2] {'tensor'}, with jax 0.10's
  ", device_ids=([2,2]T(1,0))" before the braces where the mesh's devices are permuted)."""
  text = text.rstrip(",")
  if text.startswith("{"):
    return tuple(tuple(int(d) for d in g.split(",") if d) for g in re.findall(r"\{([\d,]*)\}",
                                                                              text[1:-1]))
  if text.startswith("mesh"):
    axes = re.findall(r"'(\w+)'=(\d+)", text.split("]", 1)[0])
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    over = re.findall(r"'(\w+)'", text.split("{", 1)[1])
    ids = np.arange(math.prod(sizes))
    if (order := re.search(r"device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)", text)):
      dims, perm = order.groups()
      ids = ids.reshape([int(d) for d in dims.split(",")])
      ids = ids.transpose([int(p) for p in perm.split(",")]) if perm else ids
    ids = ids.reshape(sizes)
    moved = np.moveaxis(ids, [names.index(a) for a in over], range(len(sizes) - len(over),
                                                                  len(sizes)))
    size = math.prod(sizes[names.index(a)] for a in over)
    return tuple(map(tuple, moved.reshape(-1, size).tolist()))
  shape, dims, perm = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?",
                                   text).groups()
  ids = np.arange(math.prod(map(int, dims.split(",")))).reshape(
      [int(d) for d in dims.split(",")])
  if perm:
    ids = ids.transpose([int(p) for p in perm.split(",")])
  return tuple(map(tuple, ids.reshape([int(d) for d in shape.split(",")]).tolist()))


def collectives(text: str) -> list[tuple[str, str, tuple[tuple[int, ...], ...]]]:
  """(kind, shape, replica groups as device ids) of each array each collective in a compiled
  program moves: a combined one (XLA's combiner: a tuple of arrays; jax 0.12's pairs an
  activation's all-reduce with a scalar's) gives one entry an array."""
  return [(kind, shape, _groups(groups)) for shapes, kind, groups in _COLLECTIVE.findall(text)
          for shape in re.findall(r"\w+\[[\d,]*\]", shapes)]


def _three_steps(cfg, where):
  """(three train steps' losses, the compiled step's HLO text (on a mesh), the model after
  them) on ``where`` (None: one device), the kernels interpreted (Triton's)."""
  import jaxkernels as jk
  tc = hparams.TrainConfig(steps=10, warmup=2, batch=8, seq_len=32)
  data, _ = batches.corpus()
  graphdef, state = train_step.init(cfg, tc, where)
  step = train_step.step_fn(graphdef, donate=False)
  text, losses = None, []
  with jax.set_mesh(where) if where else contextlib.nullcontext(), jk.interpret_mode("triton"):
    if where is not None:
      text = step.lower(state, batches.shard_batch(batches.batch_at(data, 0, tc), where)
                        ).compile().as_text()
    for s in range(3):
      state, metrics = step(state, batches.shard_batch(batches.batch_at(data, s, tc), where))
      losses.append(float(metrics["loss"]))
  return losses, text, nnx.merge(graphdef, state)[0]


def test_init_makes_each_devices_share_where_it_lies(monkeypatch, default_emitters):
  """The model and its optimizer come from one program laid out on the mesh: each device
  computes and holds its share alone (nothing is made whole and then placed: the first device
  held all of it, Adam's moments too), with one device's values, bit for bit."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  if not default_emitters:  # bits across shapes: run with XLA's default CPU emitters
    return
  cfg = llama.preset("tiny", max_len=32, depth=1)
  tc = hparams.TrainConfig(steps=10, warmup=2, batch=8, seq_len=32)
  _, whole = train_step.init(cfg, tc)
  where = placement.mesh(fsdp=4, tensor=2)

  def placed(*args, **kwargs):
    raise AssertionError("init placed an array made elsewhere")

  monkeypatch.setattr(jax, "device_put", placed)
  _, state = train_step.init(cfg, tc, where)
  monkeypatch.undo()
  shardings = jax.tree.leaves(llama.shardings(state, where))
  split = 0
  for got, sharding, want in zip(jax.tree.leaves(state), shardings, jax.tree.leaves(whole)):
    assert got.sharding == sharding
    chex.assert_trees_all_equal(np.asarray(got), np.asarray(want))
    shard = got.addressable_shards[0].data
    split += shard.size * 8 == got.size  # over fsdp 4 x tensor 2: an eighth a device
  assert split == 18  # six matrices (q/k/v, out, gate/up, down, embedding, head), 3 each


@pytest.mark.cpu_only
def test_tensor_parallel_step_matches_one_device():
  """(data 2, fsdp 2, tensor 2), the kernels interpreted: the same losses step for step as on
  one device; q/k/v's kv heads, the MLP's hidden width, out's and down's rows and the
  vocabulary split over tensor (the loss vocabulary-parallel); and the compiled step's
  collectives over tensor are Megatron's: of the activations, an all-reduce after each
  row-parallel product (attention's out, the MLP's down) forward, one before each
  column-parallel product (qkv, gate_up) backward, one for the loss' dx; nothing else of an
  activation's size is gathered, permuted or reduced over tensor."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  cfg = llama.preset("tiny", max_len=32, depth=1)
  want, _, _ = _three_steps(cfg, None)
  got, text, model = _three_steps(cfg, placement.mesh(data=2, fsdp=2, tensor=2))
  losses = {"one device": want, "tensor": got}
  specs = {name: tuple(getattr(model.blocks, name)[...].sharding.spec) for name in ("qkv", "out")}
  assert specs == {"qkv": (None, "fsdp", "tensor", None, None), "out": (None, "tensor", "fsdp")}
  assert model.blocks.mlp.gate_up[...].sharding.spec == P(None, "fsdp", None, "tensor")
  assert model.blocks.mlp.down[...].sharding.spec == P(None, "tensor", "fsdp")
  assert model.head.kernel[...].sharding.spec == P("fsdp", "tensor")
  # Float32 throughout; sums over the batch, the heads and the vocabulary in another order.
  np.testing.assert_allclose(losses["tensor"], losses["one device"], rtol=1e-5)

  found = collectives(text)
  tensor_pairs = ((0, 1), (2, 3), (4, 5), (6, 7))  # device d*4 + f*2 + t: tensor's groups
  rows = "f32[2,32,"  # a device's activations: 2 sequences of 32 tokens
  activations = [c for c in found if re.match(r"\w+\[\d+,32,", c[1])]  # any batch of them
  over_tensor = [c for c in activations if c[2] == tensor_pairs]
  assert [c[0] for c in over_tensor] == ["all-reduce"] * (4 * cfg.depth + 1), found
  assert all(shape.startswith(f"{rows}{cfg.width}]") for _, shape, _ in over_tensor), over_tensor
  # Of the activations nothing else crosses devices (a group of one device is no transfer).
  moved = [c for c in activations if c[2] != tensor_pairs and any(len(g) > 1 for g in c[2])]
  assert not moved, moved
  assert not [c for c in found if c[0] in ("collective-permute", "all-to-all")], found


@pytest.mark.cpu_only
def test_sequence_parallel_step_matches_one_device():
  """(fsdp 4, sequence 2), the kernels interpreted: the stream split along the sequence,
  attention as ring attention on the zig-zag layout: the same losses step for step as on one
  device; the k/v blocks go around the ring (collective-permutes) and no activation is
  gathered."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  cfg = llama.preset("tiny", max_len=32, depth=1)
  want, _, _ = _three_steps(cfg, None)
  got, text, _ = _three_steps(cfg, placement.mesh(fsdp=4, sequence=2))
  losses = {"one device": want, "sequence": got}
  # Float32 throughout; the online softmax merges the ring's blocks in another order.
  np.testing.assert_allclose(losses["sequence"], losses["one device"], rtol=1e-5)
  assert "collective-permute" in text
  # A device's activations are 2 sequences of 16 positions; nothing of the batch's size moves.
  gathered = [c for c in collectives(text) if c[0] == "all-gather"
              and re.match(r"\w+\[\d+,(16|32),", c[1])]
  assert not gathered, gathered


@pytest.mark.cpu_only
# 47 s on CI's 2 cores (2026-12-06): two jax processes compiling the step.
def test_two_processes_train_as_one(tmp_path):
  """Two processes of 4 host devices each (jax.distributed, gloo), the mesh fsdp 4 x data 2
  over all 8, each process loading only its rows and orbax saving each one's shards: the same
  losses as one process with 8 devices, and the checkpoint they wrote resumes in one process
  to the uninterrupted run's next losses."""
  port = 20000 + os.getpid() % 20000
  common = ["--steps", "4", "--warmup", "1", "--batch", "8", "--seq-len", "32",
            "--mesh", "data=2,fsdp=4", "--checkpoint-every", "4", "--log-every", "2",
            "--no-compilation-cache"]
  run = lambda devices, *extra: subprocess.Popen(
      [sys.executable, "-m", "models.train", *common, *extra], cwd=ROOT,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"})
  checkpoints = tmp_path / "two"
  pair = [run(4, "--coordinator", f"localhost:{port}", "--num-processes", "2",
              "--process-id", str(i), "--metrics", str(tmp_path / "two.jsonl"),
              "--checkpoint-dir", str(checkpoints)) for i in range(2)]
  outs = [p.communicate(timeout=600)[0] for p in pair]
  assert [p.returncode for p in pair] == [0, 0], outs
  assert "mesh {'data': 2, 'fsdp': 4, 'tensor': 1, 'sequence': 1}" in outs[0], outs[0]
  assert not re.search(r"^step \d|final loss", outs[1], re.M), outs[1]  # process 0 speaks
  # One process, 8 devices: the same 4 steps, then on to 6 from its own checkpoint and from
  # the pair's (a longer --steps trains on, the cosine over the new length).
  for name in ("one", "one", "pair's"):
    directory = checkpoints if name == "pair's" else tmp_path / "one"
    steps = "4" if not (tmp_path / "one.jsonl").exists() else "6"
    single = run(8, "--metrics", str(tmp_path / f"{name}.jsonl"), "--steps", steps,
                 "--checkpoint-dir", str(directory))
    out = single.communicate(timeout=600)[0]
    assert single.returncode == 0 and (steps == "4" or "resumed at step 4" in out), out
  want, got = _curve(tmp_path / "one.jsonl"), _curve(tmp_path / "two.jsonl")
  assert sorted(got) == [1, 2, 3, 4] and sorted(want) == [1, 2, 3, 4, 5, 6]
  # Float32; the sums across the processes' devices run in another order.
  np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=1e-5)
  after = _curve(tmp_path / "pair's.jsonl")
  np.testing.assert_allclose([after[5], after[6]], [want[5], want[6]], rtol=1e-5)


def test_a_checkpoint_restores_onto_another_mesh(tmp_path):
  """Saved after two steps on one layout, restored onto another (data 2 x fsdp 4 to one
  device, one device to data 4 x fsdp 2, data 2 x fsdp 4 to data 2 x fsdp 2 x tensor 2): the
  arrays come back laid out as the new mesh lays them, and the third step's loss is the one
  the saving run took."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  cfg = llama.preset("tiny", max_len=32, depth=1)
  tc = hparams.TrainConfig(steps=10, warmup=2, batch=8, seq_len=32)
  data, _ = batches.corpus()
  meshes = {"one device": None, "data 2 x fsdp 4": placement.mesh(2),
            "data 4 x fsdp 2": placement.mesh(4),
            "data 2 x fsdp 2 x tensor 2": placement.mesh(2, tensor=2)}
  steps = {}  # one compiled step a mesh

  def run(name, s, state):
    where = meshes[name]
    step = steps.setdefault(name, train_step.step_fn(graphdef, donate=False))
    with jax.set_mesh(where) if where is not None else contextlib.nullcontext():
      state, metrics = step(state, batches.shard_batch(batches.batch_at(data, s, tc), where))
    return state, float(metrics["loss"])

  pairs = (("data 2 x fsdp 4", "data 2 x fsdp 2 x tensor 2"),  # CI: the one that re-splits most
           ("data 2 x fsdp 4", "one device"), ("one device", "data 4 x fsdp 2"))
  for saved_on, restored_on in pairs if numerics.SLOW else pairs[:1]:
    graphdef, state = train_step.init(cfg, tc, meshes[saved_on])
    for s in range(2):
      state, _ = run(saved_on, s, state)
    _, want = run(saved_on, 2, state)
    directory = str(tmp_path / f"{saved_on} to {restored_on}")
    checkpoints = checkpointing.Checkpoints(directory, {"test": saved_on})
    checkpoints.save(2, state)
    checkpoints.close()
    where = meshes[restored_on]
    graphdef, fresh = train_step.init(cfg, tc, where)
    reopened = checkpointing.Checkpoints(directory, {"test": saved_on})
    restored = reopened.restore(2, fresh)
    reopened.close()
    qkv = nnx.merge(graphdef, restored)[0].blocks.qkv[...]
    if where is None:
      assert len(qkv.sharding.device_set) == 1
    else:  # laid out as the new mesh lays it: over tensor too where it has one
      assert qkv.sharding.mesh.shape == where.shape and qkv.sharding.spec == P(
          None, "fsdp", "tensor" if where.shape["tensor"] > 1 else None, None, None)
    _, got = run(restored_on, 2, restored)
    # The same float32 numbers; the sums over the batch and the gathers in another order.
    np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"{saved_on} -> {restored_on}")


@pytest.mark.cpu_only
def test_the_kernels_train_step_matches_xla_on_explicit_meshes():
  """The train step with the kernels (interpreted: Triton's generic interpreter) on a 1x1 and a
  (4, 2) mesh of Explicit axes, against kernels="xla" on one device, step for step. On one GPU
  with jax 0.11 the 1x1 mesh's step once failed in the fused loss's gradient (a cotangent
  that lost its sharding), which jax 0.10 on the CPU never checked."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  import jaxkernels as jk
  tc = hparams.TrainConfig(steps=10, warmup=2, batch=8, seq_len=32)
  data, _ = batches.corpus()
  losses = {}
  for kernels, data_axis, devices in (("xla", 1, jax.devices()[:1]),
                                      ("jaxkernels", 1, jax.devices()[:1]),
                                      ("jaxkernels", 4, jax.devices())):
    cfg = llama.preset("tiny", max_len=32, depth=1, kernels=kernels)
    where = placement.mesh(data_axis, devices)
    graphdef, state = train_step.init(cfg, tc, where)
    step = train_step.step_fn(graphdef)
    got = []
    with jax.set_mesh(where), jk.interpret_mode("triton"):
      for s in range(2):  # the second step runs on the first's update
        state, metrics = step(state, batches.shard_batch(batches.batch_at(data, s, tc), where))
        got.append(float(metrics["loss"]))
    losses[kernels, data_axis] = got
  # Float32 throughout ("tiny"): the kernels' sums run in another order than XLA's.
  for key in (("jaxkernels", 1), ("jaxkernels", 4)):
    np.testing.assert_allclose(losses[key], losses["xla", 1], rtol=1e-5, err_msg=str(key))


def test_auto_remat_fits_its_budget_and_says_so():  # 13 s on CI's 2 cores (2026-12-06)
  cfg = llama.preset("tiny", max_len=32, depth=2)
  tc = hparams.TrainConfig(steps=10, warmup=2, batch=8, seq_len=32)
  peaks = {policy: train_step.compiled_peak(dataclasses.replace(cfg, remat=policy), tc)
           for policy in ("none", "full")}
  assert peaks["full"] < peaks["none"]
  budget = (peaks["none"] + peaks["full"]) // 2  # "none" overflows it
  planned, choice = train_step.auto_remat(dataclasses.replace(cfg, remat="auto"), tc, budget)
  assert choice.peak_bytes <= budget < peaks["none"]
  assert planned.remat == choice.policies and len(choice.policies) == 2
  assert set(choice.policies) <= set(remat.LADDER) and choice.policies != ("none",) * 2
  assert "remat auto:" in str(choice) and "budget" in str(choice)
  with pytest.raises(ValueError, match="over the budget of"):
    train_step.auto_remat(dataclasses.replace(cfg, remat="auto"), tc, peaks["full"] // 4)


def test_auto_steps_layers_down_the_ladder():
  """A synthetic program: 100 bytes plus each layer's saved bytes under its policy."""
  saved = {"none": 10, "dots": 6, "attention": 3, "full": 1}
  peak = lambda plan: 100 + sum(saved[p] for p in plan)
  assert remat.auto(peak, 24, 400).policies == ("none",) * 24
  choice = remat.auto(peak, 24, 200)
  assert peak(choice.policies) <= 200 and "none" not in choice.policies
  assert choice.policies.count("dots") > 0 and choice.policies.count("attention") > 0
  assert remat.auto(peak, 24, 200, uniform=True).policies == ("attention",) * 24
  with pytest.raises(ValueError, match="ladder has 'most'"):
    remat.auto(peak, 2, 200, ladder=("none", "most"))










def test_the_step_combines_collectives_on_gpus_and_the_users_xla_flags_win(monkeypatch):
  """On a GPU the step compiles with XLA's combiner thresholds raised (a layer's gradients as
  one collective); a threshold the user's XLA_FLAGS sets is left to it; other backends get no
  options."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_all_gather_combine_threshold_bytes=1024")
  assert train_step.compiler_options() == {
      "xla_gpu_reduce_scatter_combine_threshold_bytes": 256 << 20,
      "xla_gpu_all_reduce_combine_threshold_bytes": 256 << 20}
  monkeypatch.setenv("XLA_FLAGS", " ".join(f"--{k}=1" for k in train_step.GPU_COMBINE_BYTES))
  assert train_step.compiler_options() is None
  monkeypatch.delenv("XLA_FLAGS")
  assert train_step.compiler_options("tpu") is None  # a TPU topology's compile from a GPU host
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert train_step.compiler_options() is None
  assert train_step.compiler_options("gpu") == train_step.GPU_COMBINE_BYTES










def test_throughput_is_timed_from_ready_to_ready(monkeypatch):
  """Each shown interval's tokens/s is its steps' tokens over the time between the results
  of its first and last steps being ready, whatever the reporting itself costs."""
  clock = iter([0.0, 1.0, 2.0, 3.0, 4.5])
  monkeypatch.setattr(loop.time, "perf_counter", lambda: next(clock))
  meter = loop.Meter(0, tokens_per_step=100)  # starts at 0.0
  meter.ready(1)  # 1.0
  meter.ready(2)  # 2.0
  assert meter.step_rate == 100 and meter.interval() == 100  # 2 steps over 2 s
  meter.ready(3)  # 3.0
  meter.ready(4)  # 4.5
  assert meter.step_rate == 100 / 1.5 and meter.interval() == 200 / 2.5






def test_weight_decay_takes_the_matrices_not_the_norms_scales():
  """AdamW's mask: every weight matrix and the embedding decayed, no norm's scale (the layers'
  parameters are stacked: their scales are (layers, width), 2-d as a matrix is, and a mask by
  rank decayed them)."""
  cfg = llama.preset("tiny", max_len=32)
  tc = hparams.TrainConfig(steps=2, warmup=0, batch=2, seq_len=16)
  _, state = train_step.init(cfg, tc)
  params = state[0]  # the model's
  mask = hparams.decayed(params)
  named = {jax.tree_util.keystr(path): (leaf, x.ndim) for (path, leaf), x in zip(
      jax.tree_util.tree_leaves_with_path(mask), jax.tree.leaves(params))}
  scales = {k: v for k, v in named.items() if "scale" in k}
  assert len(scales) == 3 and not any(leaf for leaf, _ in scales.values()), scales
  assert sorted(ndim for _, ndim in scales.values()) == [1, 2, 2]  # the final norm's is 1-d
  others = {k: v for k, v in named.items() if "scale" not in k}
  assert len(others) == 6 and all(leaf for leaf, _ in others.values()), others


def test_a_resumed_run_describes_the_program_its_first_run_kept():
  """The kept program's description (part of its key) is the same for a run and its resumption
  (which takes its checkpoint's warmup by another path: the GPU check's resumed 125m run once
  lowered again for that alone), and differs where the program does."""
  cfg = llama.preset("tiny")
  tc = hparams.TrainConfig(steps=60)
  resumed = checkpointing.resumed_warmup(tc, {"train": {"warmup": tc.warmup}})
  assert tc.warmup_defaulted != resumed.warmup_defaulted
  assert train_step.program_description(cfg, resumed) == train_step.program_description(cfg, tc)
  for other in (dataclasses.replace(tc, steps=61), dataclasses.replace(tc, batch=8)):
    assert train_step.program_description(cfg, other) != train_step.program_description(cfg, tc)
  assert train_step.program_description(dataclasses.replace(cfg, remat="full"), tc) != (
      train_step.program_description(cfg, tc))


def test_the_kept_program_is_the_step(tmp_path):
  """models.programs: the first Program lowers the step and keeps it; the second loads it (no
  tracing: the step function is not called) and computes the same state and metrics, bit for
  bit, as the jitted step; other arguments or another description key another program; a
  damaged file is lowered again, with a warning that names it."""
  from models import programs

  cfg = llama.preset("tiny", max_len=32, depth=1)
  tc = hparams.TrainConfig(steps=4, warmup=1, batch=2, seq_len=16)
  data, _ = batches.corpus()
  graphdef, state = train_step.init(cfg, tc)
  tokens = batches.batch_at(data, 0, tc)
  want = train_step.step_fn(graphdef, donate=False)(state, tokens)
  traced = []

  def body(*args):
    traced.append(True)
    return train_step.step_body(graphdef)(*args)

  make = lambda described="run", tokens=tokens: programs.Program(
      body, state, tokens, directory=tmp_path, described=described, donate=False)
  first = make()
  assert not first.loaded and traced and first.path.exists()
  traced.clear()
  second = make()
  assert second.loaded and not traced and second.path == first.path
  for program in (first, second):
    chex.assert_trees_all_equal(program.run(program.lowered.compile(), state, tokens), want)
  assert make(described="another run").path != first.path
  longer = batches.batch_at(data, 0, dataclasses.replace(tc, seq_len=8))
  assert make(tokens=longer).path != first.path
  first.path.write_bytes(b"not a program")
  with pytest.warns(UserWarning, match=f"the kept train step {first.path} did not load"):
    again = make()
  assert not again.loaded
  assert make().loaded
