"""matmul: ours (Mosaic GPU, Triton) against cuBLAS (torch), XLA and JAX's Pallas Hopper example.

Headline cases are the issue's: bf16 8192^3 and 4096^3, the wave-quantization
cliffs 8193^3 and 2049^3 (with their aligned neighbours), fp8 e4m3 8192^3,
the fused bias+gelu epilogue against the plain product and against our product
followed by XLA's fused bias+gelu, and a forward+backward with the epilogue.
``--sweep`` adds square sizes (``--sweep-range``, step ``--step``, each with its odd
neighbour) for ours, XLA and cuBLAS; ``bench/plot_sweep.py`` plots them. ``--tune``
autotunes ours at 8192, 8193, 2049 and 4096 first (into the user's tuning cache). ``--only``
runs some of the parts: checks, headline, sweep, glu (the gated product, fused against our
product then glu and against XLA, at the models' MLP shapes). (The investigations that chose the shipped
configs, epilogue pieces, schedules, CTA tiles by waves, stream-K and clusters, were parts here
too; notes/README.md keeps their results and the commit that last had them.)

Every output is checked before it is timed by the numerics rule (jaxkernels.testing): its
error against the float64 product at most twice that of the plain product in the same dtype;
fp8, whose plain product runs on the same tensor cores, within its documented accuracy.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
import random
import statistics
import time

import jax
import jax.numpy as jnp

import jaxkernels as jk
from bench import harness, shapes
from jaxkernels import _activations, backend, tuning
from jaxkernels.ops.matmul import mosaic_gpu, triton
from jaxkernels.ops.matmul import reference
from jaxkernels.ops.matmul.common import Problem

BF16 = jnp.bfloat16
F8 = jnp.float8_e4m3fn
def _inputs(m, n, k, dtype, seed, *, bias=False):
  keys = jax.random.split(jax.random.key(seed), 3)
  a = jax.random.normal(keys[0], (m, k), jnp.float32)
  b = jax.random.normal(keys[1], (k, n), jnp.float32) / (k ** 0.25)
  a = a / (k ** 0.25)
  out = [a.astype(dtype), b.astype(dtype)]
  if bias:
    out.append(jax.random.normal(keys[2], (n,), BF16))
  return tuple(out)


def _flops(m, n, k):
  return 2.0 * m * n * k


def _rule(args, dtype, *, reduction, cotangent=None, grads=(), **spec):
  """The numerics rule for ``jk.matmul(*args, **spec)``: args are (a, b) and, as the spec
  names them, bias and residual; the scales are constants of the spec."""
  fp8 = jnp.dtype(dtype).itemsize == 1
  # fp8's documented accuracy (reference.fp8_accuracy), in the rule's max-norm terms.
  fp8_rtol = sum(reference.fp8_accuracy(reduction, tensor_cores=jax.default_backend() == "gpu"))
  names = [name for name in ("bias", "residual") if spec.pop(name, False)]
  def computed_in(cd):
    return lambda a, b, *rest: reference.in_dtype(cd, a, b, **dict(zip(names, rest)), **spec)
  return harness.Rule(computed_in, args, cotangent, dtype=dtype, reduction=reduction,
                      grads=grads, naive=not fp8,
                      pointwise_rtol=max(fp8_rtol if fp8 else 0.0,
                                         _activations.RTOL if spec.get("activation") else 0.0))


def _time(session, fn, m, n, k, dtype, *, bias=False):
  n_sets = harness.sets_for(session, (m * k + k * n) * jnp.dtype(dtype).itemsize, most=4)
  sets = [_inputs(m, n, k, dtype, seed, bias=bias) for seed in range(n_sets)]
  return harness.time_sets(fn, sets, rounds=session.rounds, calls=session.calls)


def _torch_seconds(session, m, n, k, dtype="bfloat16", rounds=None, n_sets=None):
  import torch

  if not torch.cuda.is_available():
    raise ImportError("torch sees no CUDA device")
  tdtype = {"bfloat16": torch.bfloat16}[dtype]
  sets = [(torch.randn(m, k, device="cuda", dtype=tdtype), torch.randn(k, n, device="cuda",
                                                                       dtype=tdtype))
          for _ in range(n_sets or harness.sets_for(session, (m * k + k * n) * 2, most=4))]
  for a, b in sets:
    torch.matmul(a, b)
  torch.cuda.synchronize()
  times = []
  for _ in range(rounds or session.rounds):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(session.calls):
      for a, b in sets:
        torch.matmul(a, b)
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / 1e3 / session.calls / len(sets))
  return statistics.median(times)


def _jax_example(a, b):
  """JAX's Pallas Hopper matmul, with its own example's config."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as example
  config = example.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                                grid_minor_dim=example.MatmulDimension.N, grid_tile_width=8,
                                wg_dimension=example.MatmulDimension.N)
  return example.matmul(a, b, None, config)


def _row(session, name, impl, m, n, k, dtype, fn, *, check=True, bias=False, flops=None,
         spec=None):
  """Checks ``fn`` by the rule for the product of ``spec`` (default: the plain product), times
  it alone, adds the row."""
  row = harness.Row("matmul", name, impl, f"{m}x{n}x{k}", jnp.dtype(dtype).name)
  try:
    jitted = jax.jit(fn)
    if check:
      args = _inputs(m, n, k, dtype, 0, bias=bias)
      rule = _rule(args, dtype, reduction=k, bias=bias, **(spec or {}))
      row.error, row.tolerance = rule.verdict("fwd", jitted(*args))
      if not row.error <= row.tolerance:
        row.note = f"WRONG: error {row.error:.2e} > {row.tolerance:.2e}; not timed"
        return session.add(row)
    seconds = _time(session, jitted, m, n, k, dtype, bias=bias)
  except Exception as e:  # noqa: BLE001 - a kernel that fails to build is a row
    row.note = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
    return session.add(row)
  row.ms = seconds * 1e3
  row.tflops = (flops or _flops(m, n, k)) / seconds / 1e12
  if session.chip is not None:
    peak = session.chip.peak_flops.get(jnp.dtype(dtype).name)
    if peak:
      row.pct_roofline = 100 * row.tflops * 1e12 / peak
  return session.add(row)


def _check_row(session, row, rule, run):
  """``row`` with ``run()``'s error and tolerance by ``rule`` (or why it failed), added."""
  try:
    row.error, row.tolerance = rule.verdict("fwd", run())
    if not row.error <= row.tolerance:
      row.note = "WRONG"
  except Exception as e:  # noqa: BLE001
    row.note = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
  session.add(row)


def _ours(impl, config=None, **kw):
  return lambda a, b, *rest: jk.matmul(a, b, *rest, implementation=impl, config=config, **kw)


def headline(session, impls):
  big = 8192 if not session.smoke else 512
  mid = 4096 if not session.smoke else 256
  sizes = [big] if session.smoke else shapes.MATMUL_SQUARE
  for s in sizes:
    fns = {"xla": lambda a, b: a @ b}
    fns.update({impl: _ours(impl) for impl in impls})
    if session.anchors and s in (8192, 4096):
      fns["jax_pallas_mgpu_example"] = _jax_example
    interleaved(session, "bf16", s, fns, torch=session.anchors,
                n_sets=program_sets(s))
  # fp8 e4m3, per-tensor scales, bf16 out.
  s = big
  scales = dict(a_scale=jnp.float32(1.5), b_scale=jnp.float32(0.5))
  xla = _row(session, "fp8 e4m3 (bf16 out)", "xla", s, s, s, F8,
             lambda a, b: jk.matmul(a, b, **scales, implementation="xla"), spec=scales)
  f8 = jax.ShapeDtypeStruct((s, s), F8)
  rows = [_row(session, "fp8 e4m3 (bf16 out)", impl, s, s, s, F8, _ours(impl, **scales),
               spec=scales) for impl in impls
          if jk.supports("matmul", impl, f8, f8, **scales)]  # Mosaic TPU takes no fp8
  _ratios(xla, rows)
  # The fused epilogue: bias + exact gelu.
  def xla_epilogue(a, b, bias):
    return jax.nn.gelu((a @ b).astype(jnp.float32) + bias.astype(jnp.float32),
                       approximate=False).astype(BF16)
  fns = {"xla": xla_epilogue}
  for impl in impls:
    fns[impl] = lambda a, b, bias, impl=impl: jk.matmul(a, b, bias=bias, activation="gelu",
                                                        implementation=impl)
    if session.smoke:  # the two ways without the fused epilogue are a timing question
      continue
    fns[f"{impl} plain (no epilogue)"] = lambda a, b, bias, impl=impl: jk.matmul(
        a, b, implementation=impl)
    fns[f"{impl} then xla bias+gelu"] = lambda a, b, bias, impl=impl: jax.nn.gelu(
        jk.matmul(a, b, implementation=impl).astype(jnp.float32) + bias.astype(jnp.float32),
        approximate=False).astype(BF16)
  specs = {name: {} if "plain" in name else dict(activation="gelu") for name in fns}
  interleaved(session, "bias+gelu", s, fns, bias=True, specs=specs)
  # Forward + backward of y = gelu(a @ b + bias): 3 products.
  s = mid
  def train(impl):
    def loss(a, b, bias):
      y = jk.matmul(a, b, bias=bias, activation="gelu", implementation=impl)
      return jnp.sum(y.astype(jnp.float32) * 0.001)
    return lambda a, b, bias: jax.grad(loss, argnums=(0, 1, 2))(a, b, bias)
  xla = _row(session, "bias+gelu fwd+bwd", "xla", s, s, s, BF16, train("xla"), bias=True,
                  check=False, flops=3 * _flops(s, s, s))
  rows = [_row(session, "bias+gelu fwd+bwd", impl, s, s, s, BF16, train(impl), bias=True,
                    check=False, flops=3 * _flops(s, s, s)) for impl in impls]
  _ratios(xla, rows)


def interleaved(session, name, s, fns, *, torch=False, dtype=BF16, bias=False, specs=None,
                flops=None, rounds=None, calls=None, n_sets=None):
  """Checks each implementation, then times them round-robin: one round of each in turn (in
  a fresh random order every round), the median per implementation over the rounds. A GPU at
  its power limit clocks down as a run goes on; timed one after another, whichever ran first
  (on a cool chip) looked up to ~10% faster (run matmul-3, notes/matmul.md). Round-robin gives
  every implementation the same mix. ``n_sets`` distinct input sets (default: up to 4) make
  one timed program; cuBLAS rotates through as many."""
  rows, programs, rules = {}, {}, {}
  args = _inputs(s, s, s, dtype, 0, bias=bias)
  for impl, fn in fns.items():
    row = harness.Row("matmul", name, impl, f"{s}x{s}x{s}", jnp.dtype(dtype).name)
    try:
      jitted = jax.jit(fn)
      spec = (specs or {}).get(impl, {})
      key = tuple(sorted(spec.items()))
      if key not in rules:  # one oracle per spec, not one per implementation
        # A bias the spec does not use (the plain product's rows) is not the product's.
        rules[key] = _rule(args[:2] + (args[2:] if spec else ()), dtype, reduction=s,
                           bias=bias and bool(spec), **spec)
      row.error, row.tolerance = rules[key].verdict("fwd", jitted(*args))
      if not row.error <= row.tolerance:
        row.note = f"WRONG: error {row.error:.2e} > {row.tolerance:.2e}; not timed"
      else:
        programs[impl] = jitted
    except Exception as e:  # noqa: BLE001
      row.note = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
    rows[impl] = row
  n_sets = harness.sets_for(session, (2 * s * s) * jnp.dtype(dtype).itemsize, most=n_sets or 4)
  sets = [_inputs(s, s, s, dtype, seed, bias=bias) for seed in range(n_sets)]
  batched = {impl: harness.over_sets(fn) for impl, fn in programs.items()}
  for fn in batched.values():
    harness.block(fn(sets))
  samples = {impl: [] for impl in batched}
  if torch:
    samples["cublas(torch)"] = []
    rows["cublas(torch)"] = harness.Row("matmul", name, "cublas(torch)", f"{s}x{s}x{s}",
                                        jnp.dtype(dtype).name)
  calls = calls or session.calls

  def timed(fn):
    def run(n):
      for _ in range(n):
        out = fn(sets)
      return out
    steady, _ = harness.time_rounds(run, rounds=1, calls=calls, warmup=0)
    return steady / len(sets)

  timers = [(impl, functools.partial(timed, fn)) for impl, fn in batched.items()]
  if torch:
    timers.append(("cublas(torch)", lambda: _torch_seconds(session, s, s, s, rounds=1,
                                                           n_sets=n_sets)))
  order = random.Random(0)
  for _ in range(rounds or session.rounds):
    # A fresh order every round: with a fixed one, the same place ran ~2% slow whatever sat
    # there (matmul-9..11); rotating kept each one's neighbours, and two identical configs
    # still differed by 2% (matmul-13, notes/matmul.md).
    for impl, timer in order.sample(timers, len(timers)):
      samples[impl].append(timer())
  flops = flops or _flops(s, s, s)
  for impl, times in samples.items():
    row = rows[impl]
    if times:
      seconds = statistics.median(times)
      row.ms = seconds * 1e3
      row.tflops = flops / seconds / 1e12
      row.note = (row.note + f" spread {min(times) * 1e3:.3f}-{max(times) * 1e3:.3f} ms").strip()
  # No CUPTI kernel time here: taken after compiling (an idle, cool card) it ran 8192^3 18%
  # faster than the round-robin, which holds the card at its power limit as training does
  # (run 18, notes/rows.md). Products are long enough for the host clock.
  _ratios(rows["xla"], list(rows.values()))
  for row in rows.values():
    session.add(row)
  return rows


def _ratios(xla, rows):
  for row in rows:
    if row.ms and xla.ms:
      row.vs_xla = xla.ms / row.ms


def tune(session, impl, s=8192):
  """Autotunes ``impl`` for bf16 s^3 on this device; prints every trial."""
  p = Problem(m=s, n=s, k=s, dtype=jnp.dtype(BF16), out_dtype=jnp.dtype(BF16))
  if impl == "mosaic_gpu":
    tiles = ((128, 128, "n", 4, 1), (128, 192, "m", 3, 2), (64, 256, "m", 4, 1),
             (128, 128, "n", 3, 2))
    orders = (("n", 16), ("m", 8), ("n", 8), ("m", 16)) if s % 1024 == 0 else (("n", 16),)
    candidates = [mosaic_gpu.Config(tile_m=tm, tile_n=tn, tile_k=64, stages=st, split=sp,
                                    grid_minor=gm, grid_tile_width=w, epi_slots=slots)
                  for tm, tn, sp, st, slots in tiles for gm, w in orders]
  else:
    candidates = [triton.Config(block_m=bm, block_n=bn, block_k=bk, group_m=8, num_warps=8,
                                num_stages=st)
                  for bm, bn, bk in ((128, 256, 64), (256, 128, 64), (128, 128, 64))
                  for st in (3, 4)]
  rule = _rule(_inputs(s, s, s, BF16, 0), BF16, reduction=s)  # autotune checks seed 0's set
  best, trials = tuning.autotune(
      backend.kernels("matmul")[impl], p, candidates, chip=session.chip,
      make_inputs=lambda seed: _inputs(s, s, s, BF16, seed),
      run=lambda config, a, b: jk.matmul(a, b, implementation=impl, config=config),
      check=lambda out, args: operator.le(*rule.verdict("fwd", out)),
      rounds=3)
  for t in sorted(trials, key=lambda t: t.seconds or 1e9):
    tf = _flops(s, s, s) / t.seconds / 1e12 if t.seconds else None
    print(f"  tune {impl} {t.config}: {'' if tf is None else f'{tf:.0f} TFLOP/s'} {t.error}")
  return best, trials


# A timed program (headline and sweep) holds at least this much work (at ~650 TFLOP/s), in up
# to MOST_SETS distinct input sets. At 2048^3, programs of four products (~0.1 ms) read XLA at
# 12.7 us and ours at 28.0, against 19.3-19.4 and 22.1-23.0 with 12 or 24 sets, which agreed.
# Below SWEEP_HOST_CLOCK_FROM even 24 sets (80 us at 1024^3) are less than the host takes to
# dispatch a program: the steady clock read noise (1024^3 at 1.7-10 us), so ours and XLA also
# get the device time of their kernels (CUPTI), which the plot takes there; cuBLAS (torch, one
# launch a product) is launch-bound there and is not plotted (notes/matmul.md, matmul-30).
PROGRAM_SECONDS = 0.5e-3
MOST_SETS = 24
SWEEP_HOST_CLOCK_FROM = 2048
# Rounds and programs a timing of the sweep. With 3 x 3 (to 9ce3759) one timing was the
# difference of 3 and 6 programs, ~1.5 and 3 ms, and read 4096^3 from 0.115 to 0.172 ms (XLA,
# 3 rounds): rows above the H200's peak (notes/tiles.md, matmul-37). Compiling and checking
# take ~10 s a size; 5 x 10 adds well under a second.
SWEEP_ROUNDS = 5
SWEEP_CALLS = 10


def program_sets(s: int) -> int:
  return int(min(MOST_SETS, max(4, round(PROGRAM_SECONDS / (_flops(s, s, s) / 650e12)))))


def sweep_sizes(session, impls, step, sweep_range):
  lo, hi = sweep_range
  sizes = []
  for s in range(lo, hi + 1, step):
    sizes += [s, s + 1]
  for s in sizes:
    fns = {"xla": lambda a, b: a @ b}
    fns.update({impl: _ours(impl) for impl in impls})
    rows = interleaved(session, "sweep bf16", s, fns, torch=session.platform == "gpu",
                       rounds=SWEEP_ROUNDS, calls=SWEEP_CALLS, n_sets=program_sets(s))
    if s < SWEEP_HOST_CLOCK_FROM and session.profiles:
      sets = [_inputs(s, s, s, BF16, seed) for seed in range(program_sets(s))]
      for impl, fn in fns.items():
        if rows[impl].ms is None:
          continue  # failed its check: not timed
        seconds, kernels = harness.kernel_seconds(jax.jit(fn), sets)
        if seconds:
          rows[impl].kernel_ms = seconds * 1e3
          rows[impl].kernels = kernels
          print(f"  matmul sweep bf16 {impl} kernels: {seconds * 1e3:.4f} ms", flush=True)


def run(session: harness.Session, sweep: bool = False, step: int = 128, tune_first=False,
        only=None, sweep_range=(1024, 8192)) -> None:
  if session.platform == "gpu":
    impls = ["mosaic_gpu", "triton"] if session.chip and session.chip.compute_capability == (9, 0) \
        else ["triton"]
  elif session.platform == "tpu":
    impls = ["mosaic_tpu"]
  else:
    impls = ["triton", "mosaic_tpu"]
  if os.environ.get("JAXKERNELS_BENCH_IMPLS"):  # e.g. a quick re-check of one backend
    impls = os.environ["JAXKERNELS_BENCH_IMPLS"].split(",")
  if session.interpret:  # on a CPU: the kernels interpreted, at the smoke sizes
    with jk.interpret_mode():
      return _run(session, impls, sweep, step, only, sweep_range=(128, 384))
  return _run(session, impls, sweep, step, only, tune_first, sweep_range)


def gated(session, sizes=shapes.MATMUL_GLU):
  """matmul(glu=True) against the two ways to get the same y without it: our product, then
  our glu pass over [gate | up] (what the model ran before), and XLA's product then its fused
  silu * up. Forward (y alone) and forward+backward (y, and dA, dB for a cotangent), timed
  round-robin; each output checked against XLA's before it is timed."""
  f32 = jnp.float32
  ways = {
      "fused": lambda a, b: jk.matmul(a, b, activation="silu", glu=True),
      "composed": lambda a, b: jk.glu(jk.matmul(a, b), activation="silu"),
      "xla": lambda a, b: jk.matmul(a, b, activation="silu", glu=True, implementation="xla"),
  }
  for m, k, n in (sizes if not session.smoke else ((256, 128, 128),)):
    key = jax.random.split(jax.random.PRNGKey(0), 3)
    a = (jax.random.normal(key[0], (m, k), f32) * k ** -0.25).astype(BF16)
    b = (jax.random.normal(key[1], (k, 2 * n), f32) * k ** -0.25).astype(BF16)
    ct = jax.random.normal(key[2], (m, n), f32).astype(BF16)
    # The float64 oracle and the plain bf16 computation's error, y and dA, dB, once.
    rule = _rule((a, b), BF16, reduction=max(m, k, 2 * n), cotangent=ct, grads=(0, 1),
                 activation="silu", glu=True)
    for mode in ("fwd+bwd",) if session.interpret else ("fwd", "fwd+bwd"):
      if mode == "fwd":
        fns = {name: jax.jit(f) for name, f in ways.items()}
      else:  # y and its vjp, as a training step uses them (y feeds the next product)
        def step(a, b, f):
          y, vjp = jax.vjp(f, a, b)
          return y, vjp(ct)
        fns = {name: jax.jit(functools.partial(step, f=f)) for name, f in ways.items()}
      rows, samples = {}, {}
      for name, fn in fns.items():
        row = rows[name] = harness.Row("matmul", f"glu silu {mode}", name, f"{m}x{2 * n}x{k}",
                                       "bfloat16")
        try:
          row.error, row.tolerance = rule.verdict(mode, fn(a, b))
          if row.error <= row.tolerance:
            samples[name] = []
          else:
            row.note = f"WRONG: error {row.error:.2e} > {row.tolerance:.2e}; not timed"
        except Exception as e:  # noqa: BLE001
          row.note = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
      for name, seconds in _round_robin(session, {n: (fns[n], (a, b)) for n in samples}).items():
        rows[name].ms = seconds * 1e3
        rows[name].tflops = _flops(m, 2 * n, k) * (1 if mode == "fwd" else 3) / (
            rows[name].ms * 1e-3) / 1e12
      _ratios(rows["xla"], list(rows.values()))
      for row in rows.values():
        session.add(row)


def _round_robin(session, fns) -> dict:
  """Median seconds of each program of ``fns`` ({key: (fn, args)}), timed round-robin: one
  round of each in a fresh order every round (``interleaved`` says why)."""
  samples = {key: [] for key in fns}
  keys = list(fns)
  order = random.Random(0)
  for _ in range(session.rounds):
    for i in order.sample(range(len(keys)), len(keys)):
      fn, args = fns[keys[i]]
      samples[keys[i]].append(harness.time_sets(fn, [args], rounds=1, calls=session.calls))
  return {key: statistics.median(times) for key, times in samples.items()}


# name: (A's scale block (rows, K), B's (K, N), power-of-two scales); None: per tensor.
BLOCK_SCHEMES = {
    "fp8 per tensor": (None, None, False),
    "fp8 1x128 / 128x128 (DeepSeek-V3)": ((1, 128), (128, 128), False),
    "fp8 1x32 / 32x1 (MXFP8)": ((1, 32), (32, 1), True),
}


def _quantized(x, block, power_of_two):
  return jk.quantize(x, block=block, power_of_two=power_of_two)


def block_scaled(session):
  """Block-scaled fp8 on Hopper (issue 37): our Mosaic GPU kernel under DeepSeek-V3's and MXFP8's
  scales against per-tensor fp8 and bf16 (ours, XLA, cuBLAS by torch) in the same rounds, each
  output checked first; and each scaling's error on activations with outlier rows against the
  float64 product of the unquantized values."""
  import numpy as np

  f32 = jnp.float32
  sizes = shapes.MATMUL_BLOCK_SCALED if not session.smoke else ((256, 512, 384),)
  # The Mosaic GPU interpreter hangs on fp8 (jax 0.10.2): on a CPU the checks and the accuracy
  # run on XLA, and nothing is timed.
  ours = ("mosaic_gpu",) if session.platform == "gpu" else ()
  # Checks on ragged M with an epilogue, against the float64 product of the dequantized operands.
  gen = np.random.default_rng(0)
  m, k, n = (1000, 1024, 768) if not session.smoke else (100, 256, 128)
  x = jnp.asarray(gen.standard_normal((m, k)), f32)
  w = jnp.asarray(gen.standard_normal((k, n)) * k ** -0.5, f32)
  bias = jnp.asarray(gen.standard_normal(n), f32)
  for scheme, (a_block, b_block, pow2) in BLOCK_SCHEMES.items():
    (a8, sa), (b8, sb) = _quantized(x, a_block, pow2), _quantized(w, b_block, pow2)
    rule = _rule((a8, b8, bias), F8, reduction=k, bias=True, activation="silu", a_scale=sa,
                 b_scale=sb)
    for impl in (*ours, "xla"):
      if not jk.supports("matmul", impl, a8, b8, a_scale=sa, b_scale=sb):
        continue
      row = harness.Row("matmul", f"check {scheme} +bias+silu", impl, f"{m}x{n}x{k}",
                        "float8_e4m3fn")
      _check_row(session, row, rule, lambda: jk.matmul(
          a8, b8, a_scale=sa, b_scale=sb, bias=bias, activation="silu", implementation=impl))
  for m, k, n in sizes if ours else ():  # speed
    keys = jax.random.split(jax.random.key(1), 2)
    x = jax.random.normal(keys[0], (m, k), f32)
    w = jax.random.normal(keys[1], (k, n), f32) * k ** -0.5
    ways = {}
    xb, wb = x.astype(BF16), w.astype(BF16)
    ways["bf16", "mosaic_gpu"] = (lambda a, b: jk.matmul(a, b, implementation="mosaic_gpu"),
                                  (xb, wb))
    ways["bf16", "xla"] = (lambda a, b: a @ b, (xb, wb))
    for scheme, (a_block, b_block, pow2) in BLOCK_SCHEMES.items():
      (a8, sa), (b8, sb) = _quantized(x, a_block, pow2), _quantized(w, b_block, pow2)
      impls = ("mosaic_gpu", "xla") if a_block is None else ("mosaic_gpu",)
      for impl in impls:
        ways[scheme, impl] = (functools.partial(
            lambda a, b, sa, sb, impl: jk.matmul(a, b, a_scale=sa, b_scale=sb,
                                                 implementation=impl), impl=impl),
            (a8, b8, sa, sb))
      if a_block is not None and (m, k, n) == sizes[0] and not session.smoke:
        for stages in (3,):  # the heuristic takes 4 (6 ran 7% slower at 8192^3 on an H100)
          p = Problem(m=m, n=n, k=k, dtype=jnp.dtype(F8), out_dtype=jnp.dtype(BF16),
                      block_k=a_block[1], block_n=b_block[1])
          config = dataclasses.replace(mosaic_gpu.heuristic(p, session.chip), stages=stages)
          ways[scheme, f"mosaic_gpu stages={stages}"] = (functools.partial(
              lambda a, b, sa, sb, config: jk.matmul(a, b, a_scale=sa, b_scale=sb,
                                                     implementation="mosaic_gpu",
                                                     config=config), config=config),
              (a8, b8, sa, sb))
    fns, rows, rules = {}, {}, {}
    built = time.perf_counter()
    for (scheme, impl), (fn, args) in ways.items():
      row = rows[scheme, impl] = harness.Row("matmul", f"scaled {scheme}", impl, f"{m}x{n}x{k}",
                                             "bfloat16" if scheme == "bf16" else "float8_e4m3fn")
      try:
        jitted = jax.jit(fn)
        got = jitted(*args)
        # The rule on the product of what was multiplied (the dequantized operands).
        if scheme not in rules:
          scales = dict(zip(("a_scale", "b_scale"), args[2:]))
          rules[scheme] = _rule(args[:2], args[0].dtype, reduction=k, **scales)
        row.error, row.tolerance = rules[scheme].verdict("fwd", got)
        if row.error <= row.tolerance:
          fns[scheme, impl] = (jitted, args)
        else:
          row.note = f"WRONG: error {row.error:.2e} > {row.tolerance:.2e}; not timed"
      except Exception as e:  # noqa: BLE001
        row.note = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
    began = time.perf_counter()
    timed = _round_robin(session, fns)  # every way in the same rounds
    print(f"  fp8 blocks {m}x{n}x{k}: {len(fns)} ways timed in {time.perf_counter() - began:.0f} s "
          f"after {began - built:.0f} s compiling and checking", flush=True)
    bf16 = timed.get(("bf16", "xla"))
    for key, row in rows.items():
      if key in timed:
        row.ms = timed[key] * 1e3
        row.tflops = _flops(m, n, k) / timed[key] / 1e12
        if bf16:
          row.vs_xla = bf16 / timed[key]  # against XLA's bf16 product (cuBLAS)
      session.add(row)
  # Accuracy: activations with outlier rows (1e3: common; 1e5: past e4m3's range of normals).
  m, k, n = (1024, 4096, 1024) if not session.smoke else (128, 512, 128)
  for outlier in (1e3, 1e5):
    keys = jax.random.split(jax.random.key(2), 2)
    x = jax.random.normal(keys[0], (m, k), f32).at[::16].multiply(outlier)
    w = jax.random.normal(keys[1], (k, n), f32) * k ** -0.5
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    for scheme, (a_block, b_block, pow2) in [("bf16", (None, None, False)),
                                             *BLOCK_SCHEMES.items()]:
      if scheme == "bf16":
        y = jk.matmul(x.astype(BF16), w.astype(BF16), out_dtype=f32,
                      implementation=None if ours else "xla")
      else:
        (a8, sa), (b8, sb) = _quantized(x, a_block, pow2), _quantized(w, b_block, pow2)
        y = jk.matmul(a8, b8, a_scale=sa, b_scale=sb, out_dtype=f32,
                      implementation=None if ours else "xla")
      d = np.asarray(y, np.float64) - want
      per_row = np.linalg.norm(d, axis=1) / np.linalg.norm(want, axis=1)
      row = harness.Row("matmul", f"accuracy {scheme}, rows x{outlier:.0e}", "jaxkernels",
                        f"{m}x{n}x{k}", "bfloat16" if scheme == "bf16" else "float8_e4m3fn")
      row.error = float(np.median(per_row))
      row.note = (f"median row error {np.median(per_row):.2e}, worst row {per_row.max():.2e}, "
                  f"whole {np.linalg.norm(d) / np.linalg.norm(want):.2e}")
      session.add(row)


def _run(session, impls, sweep, step, only, tune_first=False, sweep_range=(1024, 8192)):
  """The parts named in ``only`` (default: checks, headline, and the sweep with --sweep; glu
  only when named)."""
  only = set(only or ("checks", "headline", "sweep"))
  if "glu" in only:
    gated(session)
  if "fp8_blocks" in only:
    block_scaled(session)
  if "checks" in only:
    checks(session, impls)
  if tune_first and session.platform == "gpu":
    for s in (8192, 8193, 2049, 4096):
      tune(session, impls[0], s)
  if "headline" in only:
    headline(session, impls)
  if sweep and "sweep" in only:
    sweep_sizes(session, impls[:1], step if not session.smoke else 128, sweep_range)


def checks(session, impls):
  """Kernel vs the float64 spec by the numerics rule on odd shapes, every epilogue, gradients:
  rows with an error and a tolerance, untimed. (On the CPU the tests do this; here it is the GPU's word.)"""
  import numpy as np

  # 2 x 1700 x 1800 x 333 takes 128 x 256 tiles on the kernel's own ring, every epilogue,
  # with ragged edges in M, N and K.
  sizes = shapes.MATMUL_CHECKS
  if session.smoke:  # ragged edges, every epilogue in bfloat16 (the whole list took 3 minutes;
    sizes = sizes[1:2]  # two shapes 79 s with the headline on an H200)
  gen = np.random.default_rng(0)
  def draw(shape, dtype):
    return jnp.asarray(gen.standard_normal(shape), jnp.float32).astype(dtype)

  epilogues = ((None, False, False), ("gelu", True, True), ("silu", True, False),
               ("relu", False, True))
  # Interpreted on a CPU (make bench there): the richest epilogue in bfloat16, a check that it
  # runs and matches; the tests run the whole grid, and the GPU this list compiled.
  dtypes = (BF16,) if session.interpret else (BF16, jnp.float16, jnp.float32)
  for (m, n, k) in sizes:
    for dtype in dtypes:
      for act, use_bias, use_res in (epilogues[1:2] if session.interpret else
                                     epilogues if dtype == BF16 else
                                     epilogues[:1] if session.smoke else epilogues[:2]):
        a, b = draw((2, m, k), dtype), draw((k, n), dtype)
        bias = draw((n,), dtype) if use_bias else None
        res = draw((2, m, n), dtype) if use_res else None
        dy = draw((2, m, n), dtype)
        kw = dict(bias=bias, activation=act, residual=res)
        args = tuple(x for x in (a, b, bias, res) if x is not None)
        names = [name for name, x in (("bias", bias), ("residual", res)) if x is not None]
        rule = _rule(args, dtype, reduction=max(2 * m, k, n), cotangent=dy,
                     grads=range(len(args)), activation=act, bias=use_bias, residual=use_res)
        for impl in impls:
          label = f"check {act or 'plain'}{'+bias' if use_bias else ''}{'+res' if use_res else ''}"
          row = harness.Row("matmul", label, impl, f"2x{m}x{n}x{k}", jnp.dtype(dtype).name)
          if not jk.supports("matmul", impl, a, b, **kw):
            continue
          def value_and_grads(*args, impl=impl):
            fn = lambda a, b, *rest: jk.matmul(a, b, activation=act, implementation=impl,
                                               **dict(zip(names, rest)))
            out, vjp = jax.vjp(fn, *args)
            return out, vjp(dy.astype(out.dtype))
          try:
            row.error, row.tolerance = rule.verdict("fwd+bwd", jax.jit(value_and_grads)(*args))
            if not row.error <= row.tolerance:
              row.note = f"WRONG: error {row.error:.2e} > {row.tolerance:.2e}"
          except Exception as e:  # noqa: BLE001
            row.note = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
          if row.note or (m, n, k) == sizes[0]:
            session.add(row)
          else:
            session.rows.append(row)
  # fp8 with per-row and per-column scales, odd shapes.
  for (m, n, k) in sizes[:3]:
    for f8 in (jnp.float8_e4m3fn, jnp.float8_e5m2):
      a, b = draw((m, k), f8), draw((k, n), f8)
      sa = jnp.asarray(gen.uniform(0.5, 2, m), jnp.float32)
      sb = jnp.asarray(gen.uniform(0.5, 2, n), jnp.float32)
      rule = _rule((a, b), f8, reduction=k, a_scale=sa, b_scale=sb)
      for impl in impls:
        if not jk.supports("matmul", impl, a, b, a_scale=sa, b_scale=sb):
          continue
        row = harness.Row("matmul", "check fp8 scaled", impl, f"{m}x{n}x{k}",
                          jnp.dtype(f8).name)
        _check_row(session, row, rule, lambda: jax.jit(
            lambda a, b: jk.matmul(a, b, a_scale=sa, b_scale=sb, implementation=impl))(a, b))
