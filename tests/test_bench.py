"""The benchmark runs end to end on a CPU (interpret mode) and records what it checked."""

from __future__ import annotations

import json

import chex
import jax
import jax.numpy as jnp
import pytest

import jaxkernels as jk
from bench import __main__ as bench_main


@pytest.mark.cpu_only
def test_a_run_cut_off_keeps_its_rows(tmp_path, monkeypatch):
  """The JSON is rewritten after every row: a run stopped by a time limit keeps what it
  measured (the device's calls end at 10 minutes)."""
  from bench import harness

  def suite(session, sweep=False):
    del sweep
    session.add(harness.Row("fake", "measured", "ours", "(1,)", "float32", ms=1.0))
    raise TimeoutError("the call's time limit")

  monkeypatch.setitem(bench_main.SUITES, "softmax", suite)
  with pytest.raises(TimeoutError):
    bench_main.main(["softmax", "--out", str(tmp_path)])
  [path] = tmp_path.glob("*.json")
  rows = json.loads(path.read_text())["rows"]
  assert [(r["suite"], r["name"], r["ms"]) for r in rows if r["suite"] == "fake"] == [
      ("fake", "measured", 1.0)]


def test_plot_sweep_reads_logs_in_run_order(tmp_path):
  from bench import plot_sweep

  log = tmp_path / "log.txt"
  lines = []
  for size in (128, 129, 256, 257):
    for impl, ms in (("xla", 1.0), ("mosaic_gpu", 0.5), ("cublas(torch)", 2.0)):
      lines.append(f"  matmul sweep bf16 {impl}: {ms * size / 128:.4f} ms  GB/s err 1e-3\n")
  log.write_text("".join(lines))
  series = plot_sweep.from_log(str(log), 128, 256, 128)
  assert sorted(series) == ["cublas", "mosaic_gpu", "xla"]
  assert [s for s, _ in series["xla"]] == [128, 129, 256, 257]
  size, tflops = series["mosaic_gpu"][2]
  assert size == 256 and abs(tflops - 2 * 256 ** 3 / (1e-3 * 0.5 * 256 / 128) / 1e12) < 1e-6
  # Below host_clock_from the kernels' device time is plotted, and cuBLAS (none) left out.
  with_kernels = []
  for line in lines:
    with_kernels.append(line)
    if "cublas" in line:
      with_kernels += [f"  matmul sweep bf16 {impl} kernels: 0.2500 ms\n"
                       for impl in ("xla", "mosaic_gpu")]
  log.write_text("".join(with_kernels))
  series = plot_sweep.from_log(str(log), 128, 256, 128, 256)
  assert [s for s, _ in series["cublas"]] == [256, 257]
  assert series["xla"][0] == (128, 2 * 128 ** 3 / 0.25e-3 / 1e12)
  assert series["xla"][2][1] == 2 * 256 ** 3 / (1e-3 * 256 / 128) / 1e12


def test_plot_sweep_later_source_wins(tmp_path, monkeypatch):
  """A run cut short and the run that completes it share a size: plotted once, from the later."""
  from bench import plot_sweep

  def log(name, sizes, ms):
    path = tmp_path / name
    path.write_text("".join(f"  matmul sweep bf16 {impl}: {ms:.4f} ms\n"
                            for _ in sizes for impl in ("xla", "mosaic_gpu")))
    return f"{path}:{sizes[0]}:{sizes[-2]}:128"

  plotted = {}
  monkeypatch.setattr(plot_sweep, "plot", lambda series, out: plotted.update(series))
  plot_sweep.main(["out.png", log("a.txt", [128, 129, 256, 257], 1.0),
                   log("b.txt", [256, 257, 384, 385], 2.0)])
  assert [s for s, _ in plotted["xla"]] == [128, 129, 256, 257, 384, 385]
  assert dict(plotted["xla"])[256] == plot_sweep._tflops(256, 2.0)


def test_time_rounds_cancels_a_rounds_fixed_cost(monkeypatch):
  """A round that pays a fixed start-up F plus t a program: steady is t, whole-round t + F/calls."""
  from jaxkernels import timing  # the one timer the benchmarks and tuning share

  fixed, per_program, clock = 0.8e-3, 0.3e-3, [0.0]
  monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])

  def run(n):  # the device's work for n back-to-back programs, on the fake clock
    clock[0] += fixed + n * per_program

  steady, whole = timing.time_rounds(run, rounds=3, calls=10)
  assert abs(steady - per_program) < 1e-12
  assert abs(whole - (per_program + fixed / 10)) < 1e-12


@pytest.mark.cpu_only
def test_model_step_is_measured_and_plotted(tmp_path):
  """bench.model measures a train step (time, compiled memory, losses) and the remat plot reads
  its rows and the TPU compiled rows back."""
  from bench import harness, model, plot_remat

  got = model.measure("tiny", "jaxkernels", "dots", batch=2, seq=32, steps=1)
  assert got["ms"] > 0 and got["compiled_bytes"] > 0 and len(got["losses"]) == 6
  assert all(0 < loss < 10 for loss in got["losses"])
  session = harness.Session(smoke=True, rounds=1, calls=1)
  model._row(session, "1b", 4, "jaxkernels", "dots", False,
             {**got, "peak_bytes": 3 << 30, "mfu": None}, None)
  model._row(session, "1b", 4, "jaxkernels", "full", False, {"error": "out of memory"}, None)
  compiled = harness.Row("model", "350m train step, compiled for v5e", "jaxkernels, remat none",
                         "batch 8 x 2048", "bfloat16",
                         note="does not fit: RESOURCE_EXHAUSTED: Ran out of memory on HBM, the "
                              "total memory required for HLO temporaries (19.69G) exceeds")
  for name, rows in (("gpu", session.rows), ("tpu", [compiled])):
    (tmp_path / f"{name}.json").write_text(json.dumps({"rows": [r.__dict__ for r in rows]}))
  assert plot_remat.gpu_points([tmp_path / "gpu.json"], "1b") == {"dots": (3.0, got["ms"])}
  assert plot_remat.tpu_bars([tmp_path / "tpu.json"]) == {"v5e": {"none": (19.69, False)}}
  assert session.rows[1].note == "FAILED: out of memory"


def test_model_policies_that_do_not_exist_are_named():
  from bench import harness, model

  session = harness.Session(smoke=True, rounds=1, calls=1)
  with pytest.raises(ValueError, match=r"--policies: \['minimal'\]: the model suite runs none"):
    model.run(session, policies=["none", "minimal"])
  with pytest.raises(ValueError, match=r"--policies: \['dot'\] are not remat policies"):
    model.run_remat(session, policies=["dot"])
  assert not session.rows  # nothing ran


def test_report_from_the_committed_results(tmp_path):
  """The report builds from results alone (no device), with both GPUs, and every
  number's run is a file in the repository."""
  import pathlib
  import re

  bench_dir = pathlib.Path(bench_main.__file__).parent
  out = tmp_path / "report"  # markdown
  plots = tmp_path / "plots"
  assert bench_main.main(["report", "--out", str(out), "--plots", str(plots)]) == 0
  text = out.read_text()
  assert "## NVIDIA H100" in text and "## NVIDIA H200" in text
  links = re.findall(r"\]\(((?:nvidia|tpu)[^)]+\.json)\)", text)  # from results/, its home
  assert links
  assert all((bench_dir.parent / "results" / link).is_file() for link in links)
  # The lessons, each lecture prediction with what a GPU measured and a TPU compiled, and the
  # block-scaled fp8 table; the rooflines and the sweep's plot.
  from bench import lessons
  for lesson in lessons.LESSONS:
    assert f"### {lesson}" in text
  assert "TPU v5e (predicted)" in text.split("### fusion")[1].split("###")[0]
  beside = text.split("## Mosaic GPU beside Triton: NVIDIA H200")[1].split("\n## ")[0]
  assert "| rms_norm+residual fwd+bwd | 16384x4096 |" in beside
  assert "**Block-scaled fp8, NVIDIA H100" in text
  drawn = sorted(p.name for p in plots.glob("*.png"))
  assert drawn == ["matmul_waves.png", "roofline_nvidia_h100_80gb_hbm3.png",
                   "roofline_nvidia_h200.png"]
  for name in drawn:
    assert f"](plots/{name})" in text


def test_lessons_smoke(tmp_path):  # 8 s on CI's 2 cores (2026-12-06)
  """Every lesson runs on the CPU at its smoke size (kernels interpreted), each case checked
  against its reference where it has one; none fails."""
  assert bench_main.main(["lessons", "--smoke", "--rounds", "1", "--calls", "1", "--out",
                          str(tmp_path)]) == 0
  (path,) = tmp_path.glob("*_lessons_smoke.json")
  rows = [r for r in json.loads(path.read_text())["rows"] if r["suite"] == "lessons"]
  from bench import lessons
  ran = {r["name"].split(":")[0] for r in rows}
  assert ran == {"fusion", "tiling", "coalescing", "masking", "low precision", "host overhead"}
  assert not [r for r in rows if "FAILED" in r["note"] or "WRONG" in r["note"]]
  assert all(r["error"] <= 1e-2 for r in rows if r["error"] is not None)
  assert set(lessons.LESSONS) >= ran


def _result(path, date, rows, smoke=False):
  path.parent.mkdir(parents=True, exist_ok=True)
  base = dict(suite="norms", name="rms_norm fwd", shape="8x8", dtype="bfloat16", gbps=None,
              tflops=None, pct_roofline=None, error=None, tolerance=None)
  record = dict(date=date, commit="abc", device="Chip", jax="0.11", smoke=smoke)
  path.write_text(json.dumps(dict(**record, rows=[{**base, **row} for row in rows])))


def test_report_takes_the_newest_run_and_only_right_rows(tmp_path):
  """Per shape: the newest run with one of our kernels beside an anchor serves; a row outside
  its tolerance, a variant (an impl with a config in its name), a smoke run and a sweep are
  left out."""
  from bench import report

  results = tmp_path / "results"
  _result(results / "chip/old.json", "2026-01-01",
          [dict(impl="triton", ms=2.0), dict(impl="xla", ms=1.0)])
  _result(results / "chip/new.json", "2026-02-01",
          [dict(impl="triton", ms=1.0), dict(impl="xla", ms=2.0),
           dict(impl="mosaic_gpu", ms=0.1, error=1.0, tolerance=0.1),
           dict(impl="triton, block 4096", ms=0.05)])
  _result(results / "chip/newer_smoke.json", "2026-03-01",
          [dict(impl="triton", ms=9.0), dict(impl="xla", ms=1.0)], smoke=True)
  _result(results / "chip/newest-sweep.json", "2026-04-01",
          [dict(impl="triton", ms=9.0), dict(impl="xla", ms=1.0)])
  (line,) = report.lines(report.load(results))["Chip"]
  assert line.run.path.name == "new.json"
  assert (line.ours["impl"], line.ours["ms"], line.anchor["ms"]) == ("triton", 1.0, 2.0)
  assert line.speedup == 2.0
  text = report.render(report.lines(report.load(results)), results)
  assert "| Chip | norms, elementwise, softmax | 1 | 1 | 2.00x |" in text
  assert "Mosaic GPU beside Triton" not in text  # its Mosaic GPU row was over its tolerance


def test_report_marks_a_line_older_than_a_kernel_of_its_suite(tmp_path):
  """A shape last timed before a later run of its suite timed another of our kernels (Triton's
  attention rows from before Mosaic GPU's, 0.34x on the H200) is marked stale and left out of
  the summary; a later run that times fewer kernels stales nothing."""
  from bench import report

  results = tmp_path / "results"
  _result(results / "chip/old.json", "2026-01-01",
          [dict(impl="triton", ms=3.0), dict(impl="xla", ms=1.0),
           dict(name="softmax fwd", impl="triton", ms=1.0),
           dict(name="softmax fwd", impl="xla", ms=2.0)])
  _result(results / "chip/new.json", "2026-02-01",
          [dict(name="glu fwd", impl="mosaic_gpu", ms=1.0), dict(name="glu fwd", impl="xla",
                                                                    ms=1.5)])
  _result(results / "chip/newer.json", "2026-03-01",
          [dict(name="softmax fwd", impl="triton", ms=1.0),
           dict(name="softmax fwd", impl="xla", ms=2.0)])
  by_name = {line.name: line for line in report.lines(report.load(results))["Chip"]}
  assert by_name["rms_norm fwd"].stale == ("mosaic_gpu",)
  assert by_name["softmax fwd"].stale == () and by_name["glu fwd"].stale == ()
  text = report.render(report.lines(report.load(results)), results)
  assert "| Chip | norms, elementwise, softmax | 2 | 2 | 1.73x | 1.50-2.00x |" in text, text
  assert "| rms_norm fwd **stale**: before mosaic_gpu |" in text
  assert "Left out of this summary: 1 stale lines" in text


def test_report_shows_the_mosaic_gpu_kernel_beside_the_triton_one(tmp_path):
  """Where a run timed both of our GPU kernels (at their default configs), a table puts the
  Mosaic GPU one beside the Triton one it replaces, with Triton's time over its."""
  from bench import report

  results = tmp_path / "results"
  _result(results / "chip/run.json", "2026-01-01",
          [dict(impl="xla", ms=2.0), dict(impl="mosaic_gpu", ms=0.8), dict(impl="triton", ms=1.0),
           dict(impl="triton", ms=0.5, config="Config(block_rows=4)")])
  text = report.render(report.lines(report.load(results)), results)
  section = text.split("## Mosaic GPU beside Triton: Chip")[1]
  row = next(r for r in section.splitlines() if r.startswith("| rms_norm fwd |"))
  assert "mosaic_gpu 0.800 ms" in row and "triton 1.000 ms" in row and "| 1.25x |" in row


def test_tpu_prediction_bounds_the_compiled_program():
  """The TPU columns without a TPU: a program compiled for a v5e chip, its time predicted from
  what the compiled program moves and computes at the chip's peaks (labelled predicted); an
  attention kernel, whose FLOPs the compiler cannot see, gets our own count."""
  import numpy as np
  pytest.importorskip("libtpu")
  from jax.experimental import topologies
  from jax.sharding import AxisType

  from bench import tpu_predicted
  from jaxkernels import hardware, roofline

  device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
  chip = hardware.chip_for(device.device_kind)
  mesh = jax.sharding.Mesh(np.array([device]), ("chip",), axis_types=(AxisType.Explicit,))
  rows = ((1024, 512), jnp.bfloat16)
  norm = tpu_predicted.Case("norms", "rms_norm fwd", "1024x512", (rows, ((512,), jnp.bfloat16),
                                                                  rows),
                            tpu_predicted._norm(False, False), False)
  row = tpu_predicted.predict(norm, "mosaic_tpu", mesh, chip)
  assert row["note"].startswith("predicted, not measured")
  at_least = 2 * 1024 * 512 * 2 / chip.hbm_bandwidth  # x read and y written once
  assert at_least * 1e3 <= row["ms"] <= 2 * at_least * 1e3, row
  q = ((1, 256, 2, 64), jnp.bfloat16)
  attention = tpu_predicted.Case("attention", "plain fwd+bwd", "1x256x2/2x64", (q,) * 3,
                                 lambda impl, q, k, v: jk.flash_attention(
                                     q, k, v, implementation=impl), True)
  row = tpu_predicted.predict(attention, "mosaic_tpu", mesh, chip)
  flops = roofline.attention_flops(1, 256, 256, 2, 64, backward=True)
  assert row["ms"] >= flops / chip.flops("bfloat16") * 1e3 and "our FLOP count" in row["note"]
  # What moves around the kernels, counted from the compiled program alike for every kernel:
  # nothing around ours, which reads (B, T, N, H) in place; around the heads-major kernels the
  # (B, T, N, H) <-> (B, N, T, H) transposes of q, k, v and out, each at least one read and one
  # write of the array; a lone elementwise pass reads and writes it once.
  from jaxkernels.ops.attention import mosaic_tpu
  q = ((1, 512, 2, 128), jnp.bfloat16)
  array = 512 * 2 * 128 * 2
  heads_major = mosaic_tpu.Config(block_q=512, block_k=128, bwd_block_q=512, bwd_block_k=512,
                                  vmem_limit_bytes=64 << 20)
  for config, low, high in ((None, 0, 0), (heads_major, 4 * 2 * array, 8 * 2 * array)):
    attention = tpu_predicted.Case("attention", "plain fwd", "1x512x2/2x128", (q,) * 3,
                                   lambda impl, q, k, v, config=config: jk.flash_attention(
                                       q, k, v, implementation=impl, config=config), False)
    around = tpu_predicted._passes_around_kernels(
        tpu_predicted._compiled(attention, "mosaic_tpu", mesh))
    assert low <= around <= high, (config, around)
  scale = tpu_predicted.Case("attention", "scale", "", (q,), lambda impl, q: q * 3, False)
  assert tpu_predicted._passes_around_kernels(
      tpu_predicted._compiled(scale, "xla", mesh)) == 2 * array


def test_bench_checks_by_the_tests_numerics_rule():
  """A bench row is checked by jaxkernels.testing's rule, the tests' own: the float64 oracle,
  each label's leaves (forward, the gradients, both) against twice the naive bfloat16 error plus
  the float32 floor. A softmax that drops a column's term is WRONG; the naive one is within."""
  from bench import harness
  from jaxkernels import testing
  from jaxkernels.ops.softmax import reference
  from tests import numerics

  gen = numerics.rng("bench-rule")
  x = numerics.normal(gen, (64, 300), jnp.bfloat16, 3.0)
  ct = numerics.normal(gen, (64, 300), jnp.bfloat16)
  spec = lambda cd: lambda x: reference.softmax(x, compute_dtype=cd)
  rule = harness.Rule(spec, (x,), ct, dtype=jnp.bfloat16, reduction=300, grads=(0,))
  _, want = testing.tolerances(spec, (x,), ct, dtype=jnp.bfloat16, reduction=300)
  right, vjp = jax.vjp(spec(jnp.bfloat16), x)
  error, tolerance = rule.verdict("fwd+bwd", (right, vjp(ct)))
  assert error <= tolerance and tolerance in want
  # The column dropped is row 0's largest: its share there is at least 1/300 and in practice a
  # sizable fraction (a column picked at random may carry too little of every row to show).
  column = int(jnp.argmax(x[0].astype(jnp.float32)))
  dropped = jax.nn.softmax(x.astype(jnp.float32).at[:, column].set(-jnp.inf)).astype(
      jnp.bfloat16)
  error, tolerance = rule.verdict("fwd", dropped)
  assert error > tolerance


def test_report_keeps_a_run_with_every_anchor_over_a_newer_one_without(tmp_path):
  """A newer run that lacks an anchor an older run timed at the shape (cut short, or torch
  missing) does not replace it: the speedup stays against the best baseline measured."""
  from bench import report

  results = tmp_path / "results"
  _result(results / "chip/full.json", "2026-01-01",
          [dict(impl="triton", ms=1.0), dict(impl="xla", ms=3.0), dict(impl="cudnn", ms=0.9)])
  _result(results / "chip/cut.json", "2026-02-01",
          [dict(impl="triton", ms=1.0), dict(impl="xla", ms=3.0)])
  (line,) = report.lines(report.load(results))["Chip"]
  assert line.run.path.name == "full.json" and line.anchor["impl"] == "cudnn"
  _result(results / "chip/rerun.json", "2026-03-01",
          [dict(impl="triton", ms=0.8), dict(impl="xla", ms=3.0), dict(impl="cudnn", ms=0.9)])
  (line,) = report.lines(report.load(results))["Chip"]
  assert line.run.path.name == "rerun.json" and line.speedup == 0.9 / 0.8


def test_profile_overlap_reads_each_gpus_streams():
  """bench.scaling.overlap: compute and collective time a step from the streams' kernels alone
  (not the derived lines that repeat them), the collective time under compute, per device."""
  from types import SimpleNamespace as NS

  from bench import scaling

  def plane(name, lines):
    return NS(name=name, lines=[NS(name=line, events=[
        NS(name=event, start_ns=start, duration_ns=end - start) for event, start, end in events])
        for line, events in lines.items()])

  gpu0 = plane("/device:GPU:0", {
      "Stream #13(Compute)": [("loop_fusion", 0, 10e6), ("jk_matmul", 20e6, 30e6)],
      "Stream #20(Nccl)": [("ncclDevKernel_AllGather_RING_LL(args)", 5e6, 25e6)],
      "Stream #30(MemcpyD2D)": [("MemcpyD2D", 30e6, 50e6)],
      "XLA Ops": [("fusion", 0, 50e6)]})
  gpu1 = plane("/device:GPU:1", {
      "Stream #13(Compute)": [("loop_fusion", 0, 10e6)],
      "Stream #20(Nccl)": [("ncclDevKernel_AllReduce_Sum_f32(args)", 10e6, 14e6)]})
  idle = plane("/device:GPU:2", {"Stream #7": []})  # the host's GPU the program did not use
  got = scaling.overlap([plane("/host:CPU", {"python": [("step", 0, 1e9)]}), gpu0, gpu1, idle],
                        steps=2)
  # Device 0: compute 20 ms, collectives 20 of which 10 under compute; device 1: 10, 4, 0.
  chex.assert_trees_all_close(
      {k: got[k] for k in ("compute_ms", "collective_ms", "overlapped_ms", "exposed_ms",
                           "exposed_ms_max", "overlapped")},
      {"compute_ms": 7.5, "collective_ms": 6.0, "overlapped_ms": 2.5, "exposed_ms": 3.5,
       "exposed_ms_max": 5.0, "overlapped": 2.5 / 6.0})
  assert list(got["collectives"]) == ["ncclDevKernel_AllGather_RING_LL",
                                      "ncclDevKernel_AllReduce_Sum_f32"]
  assert "collectives 6.0 ms, 42% of it beside compute" in scaling._profile_note(got)
  with pytest.raises(ValueError, match="no GPU stream"):
    scaling.overlap([plane("/host:CPU", {"python": [("step", 0, 1e9)]})], steps=1)


def test_scrub_takes_out_every_kind_of_machine_path():
  """What a log may carry from the machine it ran on: a venv's interpreter and packages, the
  standard library's frames in a traceback, a work directory, the device call's $OUT."""
  from bench import harness
  text = ("/opt/torch/bin/python3 -m pytest; /opt/torch/lib/python3.12/site-packages/jax/x.py:3; "
          "/usr/lib/python3.12/dataclasses.py:1581: in replace; /tmp/tmpab_c1/ckpt; /root/out/x")
  assert harness.scrub(text) == (
      "python -m pytest; <site-packages>/jax/x.py:3; <python-lib>/dataclasses.py:1581: in "
      "replace; <tmp>/ckpt; $OUT/x")


@pytest.mark.cpu_only
def test_the_plain_jax_anchor_is_our_model_written_without_us():
  """bench.plain_llama computes the function models.llama computes (its twin on XLA's ops),
  given the same weights: the step it times does the same work, so the ratio is fair. Weights
  drawn at a scale where attention is peaked and every layer moves the stream, so that a head
  paired with the wrong kv head, a rotation of the wrong halves or a swapped gate would show."""
  from flax import nnx

  from bench import model as bench_model, plain_llama
  from models import llama

  cfg = llama.preset("tiny", kernels="xla", dtype="float32")
  ours = llama.Llama(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(ours)

  def redraw(path, x):  # scales near 1; each product's weights at unit gain by its fan-in
    key = jax.random.fold_in(jax.random.key(1), hash(jax.tree_util.keystr(path)) % 2**31)
    names = jax.tree_util.keystr(path)
    if "scale" in names:
      return 1 + 0.3 * jax.random.normal(key, x.shape)
    fan_in = 1 if "embed" in names else x.shape[0 if "head" in names else 1]
    return jax.random.normal(key, x.shape) / fan_in ** 0.5

  ours = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(redraw, state))
  blocks, g = ours.blocks, cfg.group
  qkv = blocks.qkv[...]  # (L, D, kv_heads, group + 2, H)
  flat = lambda w: w.reshape(*w.shape[:2], -1)
  params = {
      "embed": ours.embed.embedding[...],
      "layers": {
          "attn_norm": blocks.attn_norm.scale[...],
          "wqkv": jnp.concatenate([flat(qkv[:, :, :, :g]), flat(qkv[:, :, :, g]),
                                   flat(qkv[:, :, :, g + 1])], axis=-1),
          "wo": blocks.out[...],
          "mlp_norm": blocks.mlp_norm.scale[...],
          "w_gate_up": flat(blocks.mlp.gate_up[...]),
          "w_down": blocks.mlp.down[...],
      },
      "final_norm": ours.final_norm.scale[...],
      "head": ours.head.kernel[...],
  }
  shape = plain_llama.Shape(**{f: getattr(cfg, f) for f in plain_llama.Shape.__dataclass_fields__})
  tokens = jax.random.randint(jax.random.key(2), (2, 48), 0, cfg.vocab)
  want = ours.hidden(tokens)
  for policy, scan in (("none", False), ("dots", True)):
    got = plain_llama.hidden(params, tokens, shape=shape, policy=policy, scan=scan,
                             dtype=jnp.float32)
    # float32 both, the same operations up to their order: a few ulps of the O(1) normalized
    # states, amplified through two layers of O(1) weights.
    chex.assert_trees_all_close(got, want, atol=1e-4, rtol=1e-4)
  assert float(jnp.std(want - ours.embed.embedding[...][tokens])) > 0.5  # the layers moved it

  got = bench_model.measure_plain("tiny", "dots", batch=2, seq=32, steps=1, scan=True,
                                  stream="bfloat16")
  assert got["ms"] > 0 and len(got["losses"]) == 6 and got["tokens_per_s"] > 0
  assert got["losses"][-1] < got["losses"][0] < 10  # it trains


def test_shown_paths_are_the_repositorys():
  """A result file's path as the bench prints it and logs keep it: relative to the repository
  (results/ moved out of bench/, and the repository's root once pointed one folder too
  high: paths came out as "<clone's name>/results/...")."""
  from bench import harness

  assert (harness.ROOT / "pyproject.toml").is_file() and harness.RESULTS == harness.ROOT / "results"
  shown = harness.shown_path(harness.RESULTS / "nvidia_h100" / "run.json")
  assert shown == "results/nvidia_h100/run.json", shown
  assert harness.scrub(f"log: {harness.ROOT}/results/x.log") == "log: results/x.log"

