"""The model's train step (models/llama.py, AdamW with clipping as models/train.py runs it):
kernels="jaxkernels" against kernels="xla" (XLA's ops, cuDNN attention, optax's loss on the
whole logits: what a user of plain JAX has), per remat policy, at the issue's shapes.

Each measurement runs in a process of its own, so that its peak memory (the allocator's
``peak_bytes_in_use``) is its own and an out-of-memory leaves the rest standing.

MFU counts the training FLOPs as PaLM does (``llama.Config.flops_per_token``: 6 x matmul
parameters + attention as if unmasked) over the chip's dense bf16 peak; the note also gives it
with the causal half of attention, the work the kernels do.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import jax

from bench import harness

SEQ = 2048
MODELS = {"350m": 8, "1b": 4}  # preset: batch (the table)
POLICIES = ("none", "dots", "full")
SMOKE = {"tiny": 4}


def kernel_breakdown(step, state, tokens, top: int = 25) -> list[tuple[str, float, int]]:
  """(kernel name, ms per step, launches) of one train step's most expensive kernels, by CUPTI
  (JAX's Mosaic GPU profiler); [] where it is not available. ``step`` must not donate."""
  try:
    from jax.experimental.mosaic.gpu import profiler
    _, runs = profiler.measure(step, aggregate=False, iterations=3)(state, tokens)
  except (ImportError, RuntimeError):
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


def measure(preset: str, kernels: str, policy: str, batch: int, seq: int, steps: int,
            profile: bool = False, scan_layers: bool = True) -> dict:
  """One train step's time, memory and loss on this process's first device."""
  from models import llama, train
  cfg = llama.preset(preset, kernels=kernels, remat=policy, scan_layers=scan_layers)
  seq = min(seq, cfg.max_len)
  tc = train.TrainConfig(batch=batch, seq_len=seq, steps=10_000, warmup=10)
  graphdef, state = train.init(cfg, tc)
  tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, cfg.vocab)
  start = time.perf_counter()
  compiled = train.step_fn(graphdef).lower(state, tokens).compile()
  compile_s = time.perf_counter() - start
  memory = compiled.memory_analysis()
  losses = []
  for _ in range(3):  # warm-up
    state, metrics = compiled(state, tokens)
    losses.append(float(metrics["loss"]))
  times = []
  for _ in range(3):
    start = time.perf_counter()
    for _ in range(steps):
      state, metrics = compiled(state, tokens)
    losses.append(float(metrics["loss"]))
    times.append((time.perf_counter() - start) / steps)
  seconds = sorted(times)[1]
  stats = jax.devices()[0].memory_stats() or {}  # before the profile's second copy of state
  breakdown = kernel_breakdown(train.step_fn(graphdef, donate=False), state, tokens) \
      if profile else []
  rate = batch * seq / seconds
  chip = harness.hardware.chip_for(jax.devices()[0].device_kind)
  peak = chip.peak_flops["bfloat16"] if chip else None
  return {
      "ms": seconds * 1e3, "tokens_per_s": rate, "losses": losses, "compile_s": compile_s,
      "peak_bytes": stats.get("peak_bytes_in_use"),
      "compiled_bytes": memory.temp_size_in_bytes + memory.argument_size_in_bytes
      + memory.output_size_in_bytes - memory.alias_size_in_bytes,
      "tflops": cfg.flops_per_token(seq) * rate / 1e12,
      "mfu": llama.mfu(cfg, rate, seq, peak) if peak else None,
      "mfu_causal_half": llama.mfu(cfg, rate, seq, peak, causal_half=True) if peak else None,
      "kernels": breakdown,
  }


def _child(args: dict, timeout: float = 540) -> dict:
  """``measure(**args)`` in a process of its own."""
  code = ("import json, sys; from bench import model; "
          "print('RESULT ' + json.dumps(model.measure(**json.loads(sys.argv[1]))))")
  try:
    done = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True,
                          text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout:.0f} s"}
  for line in done.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT "):])
  tail = (done.stderr or done.stdout).strip().splitlines()
  memory = any("RESOURCE_EXHAUSTED" in line or "out of memory" in line.lower()
               for line in tail)
  return {"error": "out of memory" if memory else (tail[-1][:300] if tail else
                                                   f"exit {done.returncode}")}


def run(session: harness.Session, sweep: bool = False, only=None, policies=None) -> None:
  del sweep
  models = SMOKE if session.smoke else MODELS
  if only:
    models = {name: batch for name, batch in models.items() if name in only}
  policies = policies or POLICIES
  for preset, batch in models.items():
    best_xla = None
    for kernels in ("xla", "jaxkernels"):
      for policy in policies:
        got = _child({"preset": preset, "kernels": kernels, "policy": policy, "batch": batch,
                      "seq": SEQ, "steps": 2 if session.smoke else 10})
        row = harness.Row("model", f"{preset} train step", f"{kernels}, remat {policy}",
                          f"batch {batch} x {min(SEQ, 128) if session.smoke else SEQ}",
                          "bfloat16")
        if "error" in got:
          row.note = f"FAILED: {got['error']}"
          session.add(row)
          continue
        row.ms, row.tflops = got["ms"], got["tflops"]
        row.pct_roofline = got["mfu"]
        if kernels == "xla":
          best_xla = min(best_xla or got["ms"], got["ms"])
        elif best_xla:
          row.vs_xla = best_xla / got["ms"]
        peak = got["peak_bytes"]
        row.note = (f"{got['tokens_per_s']:,.0f} tokens/s; MFU "
                    + (f"{got['mfu']:.1f}% (causal half {got['mfu_causal_half']:.1f}%)"
                       if got["mfu"] else "n/a")
                    + (f"; peak {peak / 2**30:.1f} GiB" if peak else "")
                    + f"; compiled {got['compiled_bytes'] / 2**30:.1f} GiB"
                    + f"; loss {got['losses'][0]:.3f}->{got['losses'][-1]:.3f}"
                    + f"; compile {got['compile_s']:.0f} s")
        session.add(row)
