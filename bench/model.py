"""The model's train step (models/llama.py, AdamW with clipping as models/hparams.py builds it):
ours (kernels="jaxkernels") against two anchors: the independent plain-JAX Llama
(bench/plain_llama.py: no project code, what a JAX user writes) and the model's own twin
(kernels="xla": the same Flax model on XLA's ops, cuDNN attention and optax's loss), per remat
policy, at the issue's shapes. Ours is compared with the fastest anchor of the run.

Each measurement runs in a process of its own, so that its peak memory (the allocator's
``peak_bytes_in_use``) is its own and an out-of-memory leaves the rest standing.

MFU counts the training FLOPs as PaLM does (``llama.Config.flops_per_token``: 6 x matmul
parameters + attention as if unmasked) over the chip's dense bf16 peak; the note also gives it
with the causal half of attention, the work the kernels do.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
import time

import jax

from bench import harness
from jaxkernels import hardware

SEQ = 2048
MODELS = {"350m": 8, "1b": 4}  # preset: batch (the table)
POLICIES = ("none", "dots", "full")
SMOKE = {"tiny": 4}


def kernel_breakdown(step, state, tokens, top: int = 60) -> list[tuple[str, float, int]]:
  """(kernel name, ms per step, launches) of one train step's most expensive kernels, by CUPTI
  (JAX's Mosaic GPU profiler); [] where it is not available. ``step`` must not donate."""
  try:
    from jax.experimental.mosaic.gpu import profiler
    _, runs = profiler.measure(step, aggregate=False, iterations=3)(state, tokens)
  except (ImportError, RuntimeError) as e:
    print(f"kernel_breakdown: no profile ({type(e).__name__}: {e})", file=sys.stderr)
    return []
  totals: dict[str, list] = {}
  for name, ms in runs[-1]:
    entry = totals.setdefault(name[:90], [0.0, 0])
    entry[0] += ms
    entry[1] += 1
  ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
  return [(name, round(ms, 3), n) for name, (ms, n) in ranked[:top]] + [
      ("(all kernels)", round(sum(ms for ms, _ in totals.values()), 3),
       sum(n for _, n in totals.values()))]


def measure(preset: str, kernels: str, policy, batch: int, seq: int, steps: int,
            profile: bool = False, scan_layers: bool = False, budget: int | None = None,
            largest: bool = False, fp8: bool = False, stream: str = "float32") -> dict:
  """One train step's time, memory and loss on this process's first device. ``policy``
  "auto" chooses under ``budget`` bytes; ``largest``: also the largest batch whose compiled
  step fits the device, from the compiled peaks at ``batch`` and twice it (linear in batch);
  ``stream``: the residual stream's dtype (llama.Config.stream)."""
  from jaxkernels import remat
  from models import hparams, llama, train_step
  cfg = llama.preset(preset, kernels=kernels, remat=policy, scan_layers=scan_layers, fp8=fp8,
                     stream=stream)
  seq = min(seq, cfg.max_len)
  tc = hparams.TrainConfig(batch=batch, seq_len=seq, steps=10_000, warmup=10)
  chosen = None
  if policy == "auto":
    cfg, choice = train_step.auto_remat(cfg, tc, budget)
    chosen = str(choice)
  fits = None
  if largest and (jax.devices()[0].memory_stats() or {}).get("bytes_limit"):
    peaks = [train_step.compiled_peak(cfg, dataclasses.replace(tc, batch=b))
             for b in (batch, 2 * batch)]
    per_sample = (peaks[1] - peaks[0]) / batch
    fits = int(batch + (remat.device_budget(fraction=1.0) - peaks[0]) // per_sample)
  graphdef, state = train_step.init(cfg, tc)
  tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, cfg.vocab)
  timed, state, compiled = _timed(train_step.step_fn(graphdef), state, tokens, steps,
                                  lambda metrics: metrics["loss"])
  stats = jax.devices()[0].memory_stats() or {}  # before the profile's second copy of state
  breakdown = kernel_breakdown(train_step.step_fn(graphdef, donate=False), state, tokens) \
      if profile else []
  return {
      **timed, **_rates(cfg, batch, seq, timed["ms"]),
      "peak_bytes": stats.get("peak_bytes_in_use"),
      "compiled_bytes": remat.compiled_peak_bytes(compiled),
      "kernels": breakdown, "auto": chosen, "largest_batch": fits,
  }


def _timed(step, state, tokens, steps: int, loss_of) -> tuple[dict, object, object]:
  """``step`` compiled at (state, tokens) and timed: ({ms, losses, compile_s, lower_s}, the
  last state, the compiled step). Compile time in two parts: tracing and lowering (JAX's, the
  Pallas kernels' own lowering with it: Mosaic GPU builds its modules here) and XLA's compile
  (Triton's kernels compile here); a process of its own starts with no cache in memory, and no
  persistent cache is set. The step's time: the median of three rounds of ``steps`` after
  three warm-up steps. ``loss_of``: the loss from the step's second output."""
  start = time.perf_counter()
  lowered = step.lower(state, tokens)
  lower_s = time.perf_counter() - start
  compiled = lowered.compile()
  compile_s = time.perf_counter() - start
  losses = []
  for _ in range(3):  # warm-up
    state, out = compiled(state, tokens)
    losses.append(float(loss_of(out)))
  times = []
  for _ in range(3):
    start = time.perf_counter()
    for _ in range(steps):
      state, out = compiled(state, tokens)
    losses.append(float(loss_of(out)))
    times.append((time.perf_counter() - start) / steps)
  return ({"ms": sorted(times)[1] * 1e3, "losses": losses, "compile_s": compile_s,
           "lower_s": lower_s}, state, compiled)


def _rates(cfg, batch: int, seq: int, ms: float) -> dict:
  """Tokens/s, TFLOP/s and MFU (PaLM's count; also with the causal half of attention) of a
  step of ``ms`` on this process's first device."""
  from models import llama, loop
  rate = batch * seq / (ms / 1e3)
  peak = loop.peak_flops(jax.devices()[:1])
  return {"tokens_per_s": rate, "tflops": cfg.flops_per_token(seq) * rate / 1e12,
          "mfu": llama.mfu(cfg, rate, seq, peak) if peak else None,
          "mfu_causal_half": llama.mfu(cfg, rate, seq, peak, causal_half=True) if peak else None}


def measure_plain(preset: str, policy: str, batch: int, seq: int, steps: int,
                  scan: bool = False, stream: str = "float32") -> dict:
  """bench.plain_llama's step at ``preset``'s shape, timed and reported as :func:`measure`
  reports ours."""
  from models import llama
  cfg = llama.preset(preset)
  seq = min(seq, cfg.max_len)
  state, step = _plain(cfg, policy, scan, stream)
  tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, cfg.vocab)
  timed, _, _ = _timed(step, state, tokens, steps, lambda loss: loss)
  stats = jax.devices()[0].memory_stats() or {}
  return {**timed, **_rates(cfg, batch, seq, timed["ms"]),
          "peak_bytes": stats.get("peak_bytes_in_use"), "compiled_bytes": None, "kernels": [],
          "auto": None, "largest_batch": None}


def _plain(cfg, policy: str, scan: bool, stream: str):
  """(state, jitted step) of bench.plain_llama at ``cfg``'s shape: its parameters and AdamW's
  state made on the device, the step in the configuration asked for."""
  from bench import plain_llama
  shape = plain_llama.Shape(**{f.name: getattr(cfg, f.name)
                               for f in dataclasses.fields(plain_llama.Shape)})
  tx = plain_llama.optimizer()
  params = jax.jit(plain_llama.init, static_argnums=(0, 2))(shape, jax.random.key(0), scan)
  state = (params, jax.jit(tx.init)(params))
  return state, plain_llama.step_fn(shape, tx, policy=policy, scan=scan, stream=stream)


def _models(session: harness.Session, only=None) -> dict[str, int]:
  """The presets a run measures (preset: batch), ``only`` those named."""
  models = SMOKE if session.smoke else MODELS
  return {name: batch for name, batch in models.items() if not only or name in only}


def _child(args: dict, timeout: float = 540, function: str = "measure") -> dict:
  """``function(**args)`` (``measure``, ``measure_plain`` or ``measure_compile``) in a process
  of its own."""
  return harness.child("model", function, args, timeout)


def _row(session, preset, batch, kernels, policy, scan, got, best_xla, stream=None):
  seq = min(SEQ, 128) if session.smoke else SEQ
  name = "plain JAX" if kernels == "plain" else kernels
  impl = (f"{name}, remat {policy}" + (f", stream {stream}" if stream else "")
          + (", scan" if scan else ""))
  row = harness.Row("model", f"{preset} train step", impl, f"batch {batch} x {seq}", "bfloat16")
  if "error" in got:
    row.note = f"FAILED: {got['error']}"
    return session.add(row)
  row.ms, row.tflops, row.pct_roofline = got["ms"], got["tflops"], got["mfu"]
  if kernels == "jaxkernels" and best_xla:
    row.vs_xla = best_xla / got["ms"]
  peak = got["peak_bytes"]
  row.note = "; ".join(part for part in (
      f"{got['tokens_per_s']:,.0f} tokens/s",
      f"MFU {got['mfu']:.1f}% (causal half {got['mfu_causal_half']:.1f}%)" if got["mfu"] else "",
      f"peak {peak / 2**30:.1f} GiB" if peak else "",
      f"compiled {got['compiled_bytes'] / 2**30:.1f} GiB" if got.get("compiled_bytes") else "",
      f"largest batch {got['largest_batch']}" if got.get("largest_batch") else "",
      got.get("auto") or "",
      f"loss {got['losses'][0]:.3f}->{got['losses'][-1]:.3f}",
      f"compile {got['compile_s']:.0f} s (trace and lower {got['lower_s']:.0f} s)"
      if "lower_s" in got else f"compile {got['compile_s']:.0f} s") if part)
  return session.add(row)


# The plain-JAX Llama's configurations: (policy, scan, the residual stream's dtype).
PLAIN = (("none", False, "float32"), ("none", False, "bfloat16"), ("dots", False, "bfloat16"),
         ("none", True, "bfloat16"), ("dots", True, "bfloat16"))


def run(session: harness.Session, sweep: bool = False, only=None, policies=None,
        unrolled: bool = False) -> None:
  """Per preset: the independent plain-JAX Llama (:data:`PLAIN`), the model's twin and ours,
  unrolled, under none, dots and full (or ``policies`` of them); ours also with a bfloat16
  residual stream (plain JAX's fastest) under none; and, unless ``unrolled``, each scanned
  under its fastest policy (dots; none for ours) where that policy is run. Ours is compared
  with the fastest anchor, plain or twin."""
  del sweep
  models = _models(session, only)
  unknown = set(policies or ()) - set(POLICIES)
  if unknown:
    raise ValueError(f"--policies: {sorted(unknown)}: the model suite runs {', '.join(POLICIES)}"
                     " (--remat runs every policy)")
  steps = 2 if session.smoke else 10
  for preset, batch in models.items():
    best_xla = None
    for policy, scan, stream in PLAIN:
      if (policies and policy not in policies) or (unrolled and scan):
        continue
      got = _child({"preset": preset, "policy": policy, "batch": batch, "seq": SEQ,
                    "steps": steps, "scan": scan, "stream": stream}, function="measure_plain")
      if "ms" in got:
        best_xla = min(best_xla or got["ms"], got["ms"])
      _row(session, preset, batch, "plain", policy, scan, got, None, stream)
    cases = [(k, p, False, None) for k in ("xla", "jaxkernels") for p in POLICIES]
    cases[3:3] = [("xla", "dots", True, None)]
    cases += [("jaxkernels", "none", False, "bfloat16"), ("jaxkernels", "none", True, None)]
    cases = [case for case in cases if (not policies or case[1] in policies)
             and not (unrolled and case[2])]
    for kernels, policy, scan, stream in cases:
      got = _child({"preset": preset, "kernels": kernels, "policy": policy, "batch": batch,
                    "seq": SEQ, "steps": steps, "scan_layers": scan,
                    "stream": stream or "float32"})
      if kernels == "xla" and "ms" in got:
        best_xla = min(best_xla or got["ms"], got["ms"])
      _row(session, preset, batch, kernels, policy, scan, got, best_xla, stream)


def measure_compile(preset: str, kernels: str, batch: int, seq: int, cache: str) -> dict:
  """What a run of the train step spends before its first step, with JAX's persistent
  compilation cache in ``cache``: {lower_s (tracing and lowering), compile_s (XLA's compile,
  the cache's lookup), loaded}. Ours (``kernels`` "jaxkernels" or "xla", the twin) as the
  CLI lowers it (``train_step.lower_step``: the program kept by an earlier run where there is
  one); "plain" bench.plain_llama's fastest configuration (remat none, unrolled, a bfloat16
  stream), jitted as a plain-JAX user's step is. Run twice on one ``cache``, in two processes:
  a cold and a second run."""
  jax.config.update("jax_compilation_cache_dir", cache)
  from models import hparams, llama, train_step
  cfg = llama.preset(preset, kernels="xla" if kernels == "plain" else kernels)
  seq = min(seq, cfg.max_len)
  tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, cfg.vocab)
  loaded = False
  if kernels == "plain":
    state, step = _plain(cfg, "none", False, "bfloat16")
    start = time.perf_counter()
    lowered = step.lower(state, tokens)
  else:
    tc = hparams.TrainConfig(batch=batch, seq_len=seq, steps=10_000, warmup=10)
    graphdef, state = train_step.init(cfg, tc)
    start = time.perf_counter()
    lowered, _, loaded = train_step.lower_step(cfg, tc, graphdef, state, tokens)
  lower_s = time.perf_counter() - start
  lowered.compile()
  return {"lower_s": lower_s, "compile_s": time.perf_counter() - start - lower_s,
          "loaded": loaded}


def run_compile(session: harness.Session, only=None) -> None:
  """Per preset, plain JAX's step, the twin's and ours: a cold run (an empty persistent
  compilation cache) and a second run (the same cache), each in a process of its own; ours
  against plain JAX's, cold as a ratio and second as a difference (issue 57's bars: at most
  1.3x cold, within 3 s second)."""
  import tempfile
  seq = min(SEQ, 128) if session.smoke else SEQ
  for preset, batch in _models(session, only).items():
    got = {}
    for kernels in ("plain", "xla", "jaxkernels"):
      with tempfile.TemporaryDirectory() as cache:
        for run in ("cold", "second"):
          got[kernels, run] = _child({"preset": preset, "kernels": kernels, "batch": batch,
                                      "seq": seq, "cache": cache}, function="measure_compile")
    for (kernels, run), g in got.items():
      name = "plain JAX" if kernels == "plain" else kernels
      row = harness.Row("model", f"{preset} train step: compile, {run} run", name,
                        f"batch {batch} x {seq}", "bfloat16")
      if "error" in g:
        row.note = f"FAILED: {g['error']}"
        session.add(row)
        continue
      total = g["lower_s"] + g["compile_s"]
      row.ms = total * 1e3
      plain = got["plain", run]
      versus = ""
      if kernels != "plain" and "error" not in plain:
        base = plain["lower_s"] + plain["compile_s"]
        versus = (f"; {total / base:.2f}x plain JAX's {base:.1f} s" if run == "cold" else
                  f"; {total - base:+.1f} s against plain JAX's {base:.1f} s")
      row.note = (f"{total:.1f} s: trace and lower {g['lower_s']:.1f} s"
                  + (" (the kept program)" if g["loaded"] else "")
                  + f", XLA {g['compile_s']:.1f} s{versus}")
      session.add(row)


REMAT_PRESET = ("1b", 4)


def run_remat(session: harness.Session, only=None, policies=None) -> None:
  """Every remat policy (or ``policies``) on our kernels, measured, with the largest batch
  each fits; then "auto" under a budget halfway between "none"'s compiled peak and "full"'s
  (one that "none" overflows)."""
  preset, batch = ("tiny", 4) if session.smoke else REMAT_PRESET
  if only:
    preset = only[0]
  from jaxkernels import remat
  unknown = set(policies or ()) - set(remat.POLICIES)
  if unknown:
    raise ValueError(f"--policies: {sorted(unknown)} are not remat policies; "
                     f"policies: {', '.join(remat.POLICIES)}")
  peaks = {}
  for policy in policies or remat.POLICIES:
    got = _child({"preset": preset, "kernels": "jaxkernels", "policy": policy, "batch": batch,
                  "seq": SEQ, "steps": 2 if session.smoke else 5, "largest": True})
    if "compiled_bytes" in got:
      peaks[policy] = got["compiled_bytes"]
    _row(session, preset, batch, "jaxkernels", policy, False, got, None)
  if "none" in peaks and "full" in peaks:
    budget = (peaks["none"] + peaks["full"]) // 2
    got = _child({"preset": preset, "kernels": "jaxkernels", "policy": "auto", "batch": batch,
                  "seq": SEQ, "steps": 2 if session.smoke else 5, "budget": budget})
    _row(session, preset, batch, "jaxkernels", "auto", False, got, None).note += (
        f"; budget {budget / 2**30:.2f} GiB")


TPU_TOPOLOGIES = harness.hardware.TPU_TOPOLOGIES
TPU_PRESETS = {"350m": 8, "1b": 4}  # preset -> batch (x 2048), as on the GPUs
# The sharded train steps compiled for TPU slices: (preset, topology, mesh sizes, batch,
# scan_layers). The 1b under fsdp and fsdp x tensor on four chips of v5p and of v6e; the
# 8b-shaped model (width 4096, 32 / 8 heads, MLP 14336) under fsdp x tensor on eight of v5p,
# its layers one scanned body (one layer's program to compile).
TPU_LAYOUTS = (
    ("1b", "v5p:2x2x1", {"fsdp": 4}, 16, False),
    ("1b", "v5p:2x2x1", {"fsdp": 2, "tensor": 2}, 16, False),
    ("1b", "v6e:2x2", {"fsdp": 4}, 16, False),
    ("1b", "v6e:2x2", {"fsdp": 2, "tensor": 2}, 16, False),
    ("8b", "v5p:2x2x2", {"fsdp": 4, "tensor": 2}, 16, True),
)


def _predicted(compiled, cfg, tokens: int, seq_len: int, chip, causal_half: bool = False
               ) -> tuple[float, float, float, str]:
  """(seconds, MFU %, FLOPs, a note) of one device's compiled program: max(FLOPs / dense bf16 peak,
  bytes / HBM bandwidth) by its cost analysis; a lower bound (no bubble, no exposed latency,
  no collective time)."""
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, list) else cost) or {}
  flops, moved = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
  compute_s, memory_s = flops / chip.flops("bfloat16"), moved / chip.hbm_bandwidth
  seconds = max(compute_s, memory_s)
  from models import llama
  mfu = llama.mfu(cfg, tokens / seconds, seq_len, chip.flops("bfloat16"), causal_half=causal_half)
  bound = "compute" if compute_s >= memory_s else "memory"
  return seconds, mfu, flops, (f"{flops / 1e12:.2f} TFLOP and {moved / 1e9:.1f} GB a chip by the "
                        f"compiled program's cost analysis, {bound}-bound")


def tpu_layouts(session: harness.Session, layouts=TPU_LAYOUTS) -> None:
  """The sharded train step (models.train's mesh: data, fsdp, tensor, sequence) AOT-compiled
  for TPU slices from this host: per chip, the compiled program's memory (its arguments, the
  parameters' and optimizer's share, and its peak) against the chip's HBM, the collectives in
  the program, and the step time predicted from its cost analysis (:func:`_predicted`, with
  every chip's tokens: MFU by PaLM's count). Compiled, not measured."""
  import re

  import numpy as np
  from jax.experimental import topologies
  from jax.sharding import AxisType, Mesh

  from jaxkernels import remat
  from models import hparams, llama, placement, train_step
  for name, topology_name, sizes, batch, scanned in layouts:
    layout = " x ".join(f"{axis} {n}" for axis, n in sizes.items())
    row = harness.Row("model", f"{name} train step, compiled for {topology_name}",
                      f"jaxkernels, {layout}", f"batch {batch} x 2048", "bfloat16")
    start = time.perf_counter()
    try:
      topology = topologies.get_topology_desc(platform="tpu", topology_name=topology_name)
      devices = np.array(topology.devices)
      shape = tuple(sizes.get(axis, 1) for axis in llama.MESH_AXES)
      mesh = Mesh(devices.reshape(shape), llama.MESH_AXES,
                  axis_types=(AxisType.Explicit,) * len(shape))
      cfg = llama.preset(name, scan_layers=scanned)
      tc = hparams.TrainConfig(batch=batch, seq_len=2048, steps=10_000, warmup=10)
      compiled = train_step.compiled_step(cfg, tc, mesh)
      peak = remat.compiled_peak_bytes(compiled)
      params, moments = placement.held(train_step.abstract_state(cfg, tc), mesh)
      chip = hardware.chip_for(topology.devices[0].device_kind)
      if scanned:  # the cost analysis counts a loop's body once: no time from it
        note = ("no time predicted: the layers are one scanned body, which the cost analysis "
                "counts once")
      else:
        seconds, mfu, _, note = _predicted(compiled, cfg, batch * tc.seq_len // devices.size,
                                           tc.seq_len, chip, causal_half=True)
        row.ms, row.pct_roofline = seconds * 1e3, mfu
      text = compiled.as_text()
      counts = {kind: len(re.findall(rf" {kind}(?:-start)?\(", text))
                for kind in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")}
      fits = "fits" if peak <= chip.hbm_bytes else "DOES NOT FIT"
      row.note = (f"predicted, not measured: {note}; per chip: parameters "
                  f"{params / 2**30:.2f} GiB, optimizer {moments / 2**30:.2f} GiB, compiled peak "
                  f"{peak / 2**30:.2f} GiB of {chip.hbm_bytes / 2**30:.0f} ({fits}); "
                  f"collectives {', '.join(f'{k} {v}' for k, v in counts.items())}; "
                  f"{devices.size} chips; compile {time.perf_counter() - start:.0f} s")
    except Exception as e:  # noqa: BLE001 - one that does not compile is a row
      row.note = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
    session.add(row)


@dataclasses.dataclass(frozen=True)
class Published:
  """A TPU training run whose speed was published, as the predictor reproduces it: the model's
  shape (a preset), its depth, the tokens a chip takes a step and the published rate."""

  name: str
  preset: str
  chip: str  # a TPU_TOPOLOGIES key: the 4-chip slice compiled for
  depth: int
  chip_batch: int  # sequences a chip takes a step
  seq_len: int
  tokens_per_chip_s: float | None  # published; None: from tflops_per_chip
  mfu: float  # published, %
  remat: str  # ours nearest theirs
  source: str
  changes: tuple = ()  # (field, value) pairs over the preset's Config
  # Where a run published TFLOP/s a chip, not tokens: MaxText's count (6 x the matmul
  # parameters plus attention's 12·L·T·width a token, unhalved by the mask) is PaLM's,
  # llama.Config.flops_per_token, which turns it into tokens.
  tflops_per_chip: float | None = None
  depths: tuple = (2, 4)  # compiled at these, extended linearly (small enough to fit a slice)

  def tokens_per_s(self, cfg) -> float:
    """The published tokens a chip a second; ``cfg``: the run's model at its full depth."""
    if self.tokens_per_chip_s is not None:
      return self.tokens_per_chip_s
    return self.tflops_per_chip * 1e12 / cfg.flops_per_token(self.seq_len)


# Published runs the TPU predictions are checked against (issue 56): their error bar.
PUBLISHED = (
    Published("Llama 3.1 8B, MaxText on v6e-256", "8b", "v6e", 32, 4, 8192, 7207.0, 45.46,
              "offload",
              "MaxText's optimized-models tiering table (maxtext.readthedocs.io, reference/"
              "models/tiering: v6e Gold, 256 chips, bf16, SL 8192: 45.46% MFU, ~7,207 tokens/s "
              "a chip); its recipe (benchmarks/maxtext_trillium_model_configs.py, "
              "llama3_1_8b_8192): per-device batch 4, FSDP over every chip, remat 'custom' "
              "offloading the layer input and q/k/v/out projections to the host, splash "
              "attention with 2048 blocks"),
    Published("Llama 2 70B, MaxText on v6e-256", "8b", "v6e", 80, 4, 4096, 900.0, 43.8, "full",
              "MaxText's optimized-models tiering table (v6e Gold, 256 chips, bf16, SL 4096: "
              "43.8% MFU, ~900 tokens/s a chip); its recipe (benchmarks/"
              "maxtext_trillium_model_configs.py, llama2_70b_4096): per-device batch 4, FSDP "
              "(transpose) over every chip, remat 'full', splash attention with 1024/2048 blocks",
              (("vocab", 32000), ("width", 8192), ("heads", 64), ("kv_heads", 8),
               ("mlp_width", 28672), ("rope_theta", 10000.0))),
    # MaxText's "global_parameter_scale=32" model on its base config (Llama 2 blocks, float32
    # weights, SwiGLU, untied 32,000-token head): width 8192, 64 heads of 128 (no GQA), MLP
    # 28,672, 32 layers. (Its v5e 16B, scale 16, has 64 heads of 128 over width 4096, which
    # our model, heads x head dim = width, cannot build.)
    Published("MaxText 32B (scale 32) on v5e-256", "8b", "v5e", 32, 4, 2048, None, 66.86,
              "full",
              "the README of MaxText/configs/v5e (1x v5e-256: 132 TFLOP/s a chip, 66.86% MFU); its "
              "script (MaxText/configs/v5e/32b.sh): per-device batch 4, FSDP over every chip, "
              "remat 'full', attention 'flash'. Depths 1 and 2: depth 4 would not fit a "
              "4-chip v5e slice's 16 GiB a chip",
              (("vocab", 32000), ("width", 8192), ("heads", 64), ("kv_heads", 64),
               ("mlp_width", 28672), ("rope_theta", 10000.0)), tflops_per_chip=132.0,
              depths=(1, 2)),
    Published("MaxText 32B (scale 32) on v5p-128", "8b", "v5p", 32, 7, 2048, None, 71.47,
              "dots",
              "the README of MaxText/configs/v5p (1x v5p-128: 328 TFLOP/s a chip, 71.47% MFU); its "
              "script (MaxText/configs/v5p/32b.sh): per-device batch 7, FSDP x tensor 4, remat "
              "'minimal' (dots without batch dimensions saved: our 'dots'), attention 'flash'. "
              "Ours compiled under FSDP alone",
              (("vocab", 32000), ("width", 8192), ("heads", 64), ("kv_heads", 64),
               ("mlp_width", 28672), ("rope_theta", 10000.0)), tflops_per_chip=328.0),
)


def tpu_published(session: harness.Session, runs=PUBLISHED) -> None:
  """The predictor against published TPU runs (:data:`PUBLISHED`): each run's model and batch a
  chip compiled for a 4-chip slice of its TPU under FSDP (our kernels, our remat policy nearest
  theirs), the step predicted as :func:`tpu_layouts` predicts every TPU step, at two depths
  (``Published.depths``) and extended linearly to the run's (the layers are identical; the
  compiler's cost analysis counts a scanned body once, so the layers are unrolled, and the
  full depth would not fit one slice's compile), beside the published rate. Published /
  predicted is how far a "predicted" TPU time is from a measured one."""
  import numpy as np
  from jax.experimental import topologies
  from jax.sharding import AxisType, Mesh

  from models import hparams, llama, train_step
  for run in runs:
    topology = topologies.get_topology_desc(platform="tpu",
                                            topology_name=TPU_TOPOLOGIES[run.chip])
    devices = np.array(topology.devices)
    shape = tuple(devices.size if axis == "fsdp" else 1 for axis in llama.MESH_AXES)
    mesh = Mesh(devices.reshape(shape), llama.MESH_AXES,
                axis_types=(AxisType.Explicit,) * len(shape))
    chip = hardware.chip_for(topology.devices[0].device_kind)
    tokens = run.chip_batch * run.seq_len
    row = harness.Row("model", f"{run.name}: predicted against published",
                      f"jaxkernels, fsdp {devices.size}, remat {run.remat}",
                      f"batch {run.chip_batch} x {run.seq_len} a chip", "bfloat16")
    start = time.perf_counter()
    try:
      seconds = {}
      for depth in run.depths:
        cfg = llama.preset(run.preset, depth=depth, remat=run.remat, **dict(run.changes))
        tc = hparams.TrainConfig(batch=run.chip_batch * devices.size, seq_len=run.seq_len,
                               steps=10_000, warmup=10)
        seconds[depth] = _predicted(train_step.compiled_step(cfg, tc, mesh), cfg, tokens,
                                    run.seq_len, chip, causal_half=True)[0]
      low, high = run.depths
      layer = (seconds[high] - seconds[low]) / (high - low)
      predicted = seconds[low] + (run.depth - low) * layer
      cfg = llama.preset(run.preset, depth=run.depth, **dict(run.changes))
      published = tokens / run.tokens_per_s(cfg)
      mfu = llama.mfu(cfg, tokens / predicted, run.seq_len, chip.flops("bfloat16"),
                      causal_half=True)
      row.ms, row.pct_roofline = predicted * 1e3, mfu
      row.note = (f"predicted, not measured: {predicted:.3f} s a step ({mfu:.1f}% MFU) against "
                  f"the published {published:.3f} s ({run.mfu}% MFU): published / predicted "
                  f"{published / predicted:.2f}; depths {low} and {high} predicted "
                  f"{seconds[low]:.3f} and {seconds[high]:.3f} s, {layer * 1e3:.1f} ms a "
                  f"layer; source: {run.source}; compile {time.perf_counter() - start:.0f} s")
    except Exception as e:  # noqa: BLE001 - one that does not compile is a row
      row.note = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
    session.add(row)


def _plain_policies() -> tuple[str, ...]:
  from bench import plain_llama
  return tuple(plain_llama.POLICIES)


def _plain_compiled(cfg, policy: str, batch: int, seq: int, mesh):
  """bench.plain_llama's step at ``cfg``'s shape compiled for ``mesh``'s one chip (abstract
  state: nothing made), with splash attention and a bfloat16 residual stream."""
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  from bench import plain_llama
  shape = plain_llama.Shape(**{f.name: getattr(cfg, f.name)
                               for f in dataclasses.fields(plain_llama.Shape)})
  tx = plain_llama.optimizer()
  params = jax.eval_shape(lambda: plain_llama.init(shape, jax.random.key(0), False))
  state = (params, jax.eval_shape(tx.init, params))
  on = NamedSharding(mesh, PartitionSpec())
  state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on), state)
  tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=on)
  step = plain_llama.step_fn(shape, tx, policy=policy, scan=False, stream="bfloat16",
                             attention="splash")
  with jax.set_mesh(mesh):
    return step.lower(state, tokens).compile()


def splash_flops(preset: str, batch: int, seq: int, policy: str) -> float:
  """The FLOPs of a plain-JAX step's splash attention calls (:func:`_plain_compiled`), which
  they do not state to the compiler (a custom call without a cost estimate counts none, so
  the compiled program's FLOPs leave them out; its bytes count their operands and outputs).
  Per layer one forward kernel (two where remat recomputes it: every policy but none, as the
  compiled programs show: 24, 48 and 48 forwards at 350m under none, dots and full), one dk/dv
  and one dq kernel, each counted as our kernels count theirs
  (``mosaic_tpu_blocks.costs``: 4, 8 and 6 x H FLOPs per visited query-key pair), causal
  blocks skipped, at MaxText's 512-row blocks."""
  from jaxkernels import roofline
  from models import llama
  cfg = llama.PRESETS[preset]
  block = 512
  pairs = (batch * cfg.heads * block * block
           * roofline.attention_block_visits(seq, seq, block, block, causal=True))
  forwards = 1 if policy == "none" else 2
  return cfg.depth * pairs * cfg.head_dim * (4 * forwards + 8 + 6)


def tpu_compiled(session: harness.Session, policies=None, chips=tuple(TPU_TOPOLOGIES),
                 presets=None, plain: bool = True, streams=None) -> None:
  """The train step on our kernels AOT-compiled for each TPU generation (one chip of a
  topology; libtpu's compiler, no TPU needed): each policy's peak memory by the compiled
  program's memory analysis, and its time predicted from the compiled program's cost analysis
  (our kernels state theirs: roofline.py) as max(FLOPs / dense bf16 peak, bytes / HBM
  bandwidth), with the MFU that time would give (PaLM's count, llama.mfu). Compiled, not
  measured: a lower bound that sees no pipeline bubble or exposed latency. With ``plain``,
  beside them bench.plain_llama's step compiled for the same chip at JAX's own policies among
  ``policies`` (:func:`_plain_compiled`), predicted alike: the anchor, as on the GPUs. Ours
  with each residual stream of ``streams`` (float32 and bfloat16; plain JAX's is bfloat16)."""
  import numpy as np
  from jax.experimental import topologies
  from jax.sharding import AxisType, Mesh

  from jaxkernels import remat
  from models import hparams, llama, train_step
  unknown = set(presets or ()) - set(TPU_PRESETS)
  if unknown:
    raise ValueError(f"--only: {sorted(unknown)}: the TPU step runs {', '.join(TPU_PRESETS)}")
  policies = policies or remat.POLICIES
  streams = streams or ("float32", "bfloat16")
  if set(streams) - set(llama.STREAMS):
    raise ValueError(f"--streams: {streams}: each must be one of {llama.STREAMS}")
  for name, chip_name in itertools.product(presets or TPU_PRESETS, chips):
    batch = TPU_PRESETS[name]
    tc = hparams.TrainConfig(batch=batch, seq_len=min(SEQ, llama.PRESETS[name].max_len),
                           steps=10_000, warmup=10)
    topology = topologies.get_topology_desc(platform="tpu",
                                            topology_name=TPU_TOPOLOGIES[chip_name])
    chip = hardware.chip_for(topology.devices[0].device_kind)
    mesh = Mesh(np.array(topology.devices[:1]).reshape(1, 1), llama.BATCH,
                axis_types=(AxisType.Explicit,) * 2)
    row = lambda impl: harness.Row("model", f"{name} train step, compiled for {chip_name}",
                                   impl, f"batch {batch} x {tc.seq_len}", "bfloat16")
    for policy, stream in itertools.product(policies, streams):
      # The model's TPU default: norms, products and the MLP on XLA, which fuses them into
      # its dots (llama.TPU_REFERENCE_OPS); attention and the loss ours.
      cfg = llama.preset(name, remat=policy, stream=stream).for_platform("tpu")
      on_xla = f" ({'/'.join(cfg.reference_ops)} on XLA)" if cfg.reference_ops else ""
      label = f"jaxkernels{on_xla}, remat {policy}" + (
          f", stream {stream}" if stream != "float32" else "")
      _compiled_row(session, row(label),
                    functools.partial(train_step.compiled_step, cfg, tc, mesh), cfg, batch,
                    tc.seq_len, chip, "MFU (PaLM's count) at that time")
    if not plain:
      continue
    # The anchor: bench.plain_llama's step (no jaxkernels; JAX's splash attention as MaxText
    # calls it, a bfloat16 residual stream, the GPU's fastest plain configuration) compiled
    # for the same chip at JAX's own policies, predicted alike.
    for policy in [p for p in policies if p in _plain_policies()]:
      cfg = llama.preset(name)
      _compiled_row(session, row(f"plain JAX, remat {policy}"),
                    functools.partial(_plain_compiled, cfg, policy, batch, tc.seq_len, mesh),
                    cfg, batch, tc.seq_len, chip, "splash attention, MaxText's call and blocks")


def _compiled_row(session: harness.Session, row: harness.Row, compile_step, cfg, batch: int,
                  seq_len: int, chip, what: str) -> None:
  """``row`` with the step ``compile_step()`` compiles predicted (:func:`_predicted`), its
  compiled peak, or why it did not compile."""
  from jaxkernels import remat
  start = time.perf_counter()
  try:
    compiled = compile_step()
    peak = remat.compiled_peak_bytes(compiled)
    seconds, row.pct_roofline, flops, note = _predicted(compiled, cfg, batch * seq_len, seq_len,
                                                        chip)
    row.ms, row.tflops = seconds * 1e3, flops / seconds / 1e12
    row.note = (f"predicted, not measured: {note}; {what}; compiled peak "
                f"{peak / 2**30:.2f} GiB; compile {time.perf_counter() - start:.0f} s")
  except Exception as e:  # noqa: BLE001 - one that does not compile is a row
    message = str(e)
    if "RESOURCE_EXHAUSTED" in message:  # the compiler's own sum: what it would need
      row.note = "does not fit: " + message[message.index("RESOURCE_EXHAUSTED"):][:200]
    else:
      row.note = f"FAILED: {type(e).__name__}: {message[:300]}"
  session.add(row)
