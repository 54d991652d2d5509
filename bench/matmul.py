"""matmul: ours (Mosaic GPU, Triton) against cuBLAS (torch), XLA and JAX's Pallas Hopper example.

Headline cases are the issue's: bf16 8192^3 and 4096^3, the wave-quantization
cliffs 8193^3 and 2049^3 (with their aligned neighbours), fp8 e4m3 8192^3,
the fused bias+gelu epilogue against the plain product and against our product
followed by XLA's fused bias+gelu, and a forward+backward with the epilogue.
``--sweep`` adds square sizes (``--sweep-range``, step ``--step``, each with its odd
neighbour) for ours, XLA and cuBLAS; ``bench/plot_sweep.py`` plots them. ``--tune``
autotunes ours at 8192, 8193, 2049 and 4096 first (into the user's tuning cache). Parts run
only when named in ``--only``: ``epilogue`` (each epilogue's cost over the plain product),
``configs`` (Mosaic GPU configs where the heuristic trails), ``clusters`` (JAX's example
with a 2-CTA multicast cluster), ``schedules`` (the kernel's own ring, cooperative or
ping-pong, against JAX's pipeline), ``waves`` (the heuristic's CTA tiles against the
previous rule's), ``tiles`` (CTA tiles beyond the heuristic's, against its pick) and
``streamk`` (the last wave's tiles cut along K over all SMs, against the heuristic).

Every output is checked against an f32 product on the device before it is timed
(tolerance: twice the error of XLA's own product in the same dtype).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import statistics

import jax
import jax.numpy as jnp
from jax import lax

import jaxkernels as jk
from bench import harness
from jaxkernels import tuning
from jaxkernels.ops.matmul import mosaic_gpu, triton
from jaxkernels.ops.matmul.common import Problem

BF16 = jnp.bfloat16
F8 = jnp.float8_e4m3fn
# The ping-pong schedule as the `schedules` part checks it (and the experiments time it):
# 128x128 warpgroup tiles, 5 stages (the most the ring and one epilogue buffer fit).
PINGPONG = mosaic_gpu.Config(schedule="pingpong", tile_m=128, tile_n=128, tile_k=64, stages=5,
                             epi_slots=1, grid_minor="m", grid_tile_width=16)


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


@functools.cache
def _f32_product():
  return jax.jit(lambda a, b: lax.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                                      precision=lax.Precision.HIGHEST))


def _time(session, fn, m, n, k, dtype, *, bias=False):
  n_sets = harness.sets_for((m * k + k * n) * jnp.dtype(dtype).itemsize, most=4)
  sets = [_inputs(m, n, k, dtype, seed, bias=bias) for seed in range(n_sets)]
  return harness.time_sets(fn, sets, rounds=session.rounds, calls=session.calls)


def _torch_seconds(session, m, n, k, dtype="bfloat16", rounds=None, n_sets=None):
  import torch

  if not torch.cuda.is_available():
    raise ImportError("torch sees no CUDA device")
  tdtype = {"bfloat16": torch.bfloat16}[dtype]
  sets = [(torch.randn(m, k, device="cuda", dtype=tdtype), torch.randn(k, n, device="cuda",
                                                                       dtype=tdtype))
          for _ in range(n_sets or harness.sets_for((m * k + k * n) * 2, most=4))]
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


def _jax_example(a, b, cluster=None):
  """JAX's Pallas Hopper matmul; ``cluster`` "m" or "n" pairs CTAs in a 2-CTA cluster that
  shares (TMA-multicasts) its B or A blocks."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as example
  dims = {"m": example.MatmulDimension.M, "n": example.MatmulDimension.N}
  config = example.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                                grid_minor_dim=example.MatmulDimension.N, grid_tile_width=8,
                                wg_dimension=example.MatmulDimension.N,
                                cluster_dimension=dims.get(cluster))
  return example.matmul(a, b, None, config)


def clusters(session, impls):
  """Does a 2-CTA cluster with TMA multicast (which ours lacks) pay on this card? JAX's example
  with and without one, round-robin beside ours, XLA and cuBLAS."""
  if impls[0] != "mosaic_gpu":
    return
  for s in (8192, 4096) if not session.smoke else (256,):
    fns = {"xla": lambda a, b: a @ b, "mosaic_gpu": _ours("mosaic_gpu"),
           "jax_example": _jax_example,
           "jax_example cluster m": functools.partial(_jax_example, cluster="m"),
           "jax_example cluster n": functools.partial(_jax_example, cluster="n")}
    interleaved(session, "clusters bf16", s, fns, torch=session.platform == "gpu",
                rounds=2 * session.rounds)


def _row(session, name, impl, m, n, k, dtype, fn, *, check=True, bias=False, flops=None,
         ref=None):
  """Checks ``fn`` against ``ref`` (default: the f32 product), times it alone, adds the row."""
  row = harness.Row("matmul", name, impl, f"{m}x{n}x{k}", jnp.dtype(dtype).name)
  try:
    jitted = jax.jit(fn)
    if check:
      args = _inputs(m, n, k, dtype, 0, bias=bias)
      want = (ref or _f32_product())(*args)
      got = jitted(*args)
      naive = jax.jit(lambda a, b: (a @ b) if jnp.dtype(dtype) != F8 else
                      lax.dot(a, b, preferred_element_type=BF16))(*args[:2])
      if ref is None:
        row.tolerance = max(2 * harness.relative_error(naive, want), 8e-3)
      else:
        row.tolerance = 8e-3  # bf16 output rounding, twice over
      row.error = harness.relative_error(got, want)
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


def _ours(impl, config=None, **kw):
  return lambda a, b, *rest: jk.matmul(a, b, *rest, implementation=impl, config=config, **kw)


def headline(session, impls):
  big = 8192 if not session.smoke else 512
  mid = 4096 if not session.smoke else 256
  sizes = [big, mid] if session.smoke else [8192, 4096, 8193, 2048, 2049, 6144, 6145]
  for s in sizes:
    fns = {"xla": lambda a, b: a @ b}
    fns.update({impl: _ours(impl) for impl in impls})
    if session.platform == "gpu" and s in (8192, 4096):
      fns["jax_pallas_mgpu_example"] = _jax_example
    interleaved(session, "bf16", s, fns, torch=session.platform == "gpu",
                n_sets=program_sets(s))
  # fp8 e4m3, per-tensor scales, bf16 out.
  s = big
  f8_ref = jax.jit(lambda a, b: 0.75 * lax.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                                               precision=lax.Precision.HIGHEST))
  xla = _row(session, "fp8 e4m3 (bf16 out)", "xla", s, s, s, F8,
                  lambda a, b: jk.matmul(a, b, a_scale=jnp.float32(1.5), b_scale=jnp.float32(0.5),
                                         implementation="xla"), ref=f8_ref)
  rows = [_row(session, "fp8 e4m3 (bf16 out)", impl, s, s, s, F8,
                    _ours(impl, a_scale=jnp.float32(1.5), b_scale=jnp.float32(0.5)), ref=f8_ref)
          for impl in impls]
  _ratios(xla, rows)
  # The fused epilogue: bias + exact gelu.
  def xla_epilogue(a, b, bias):
    return jax.nn.gelu((a @ b).astype(jnp.float32) + bias.astype(jnp.float32),
                       approximate=False).astype(BF16)
  epi_ref = jax.jit(lambda a, b, bias: jax.nn.gelu(
      _f32_product()(a, b) + bias.astype(jnp.float32), approximate=False))
  fns = {"xla": xla_epilogue}
  for impl in impls:
    fns[impl] = lambda a, b, bias, impl=impl: jk.matmul(a, b, bias=bias, activation="gelu",
                                                        implementation=impl)
    fns[f"{impl} plain (no epilogue)"] = lambda a, b, bias, impl=impl: jk.matmul(
        a, b, implementation=impl)
    fns[f"{impl} then xla bias+gelu"] = lambda a, b, bias, impl=impl: jax.nn.gelu(
        jk.matmul(a, b, implementation=impl).astype(jnp.float32) + bias.astype(jnp.float32),
        approximate=False).astype(BF16)
  plain_ref = jax.jit(lambda a, b, bias: _f32_product()(a, b))
  refs = {name: plain_ref if "plain" in name else epi_ref for name in fns}
  interleaved(session, "bias+gelu", s, fns, bias=True, refs=refs)
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


def epilogue_costs(session, impls):
  """What each epilogue costs over the plain product at 8192^3, round-robin: bias alone, bias
  with each activation, and bias+gelu under other epilogue piece sizes and on JAX's pipeline
  (each distinct config once; the bar: <= 3%)."""
  s = 8192 if not session.smoke else 512
  impl = impls[0]
  f32_act = lambda act: jax.jit(lambda a, b, bias: jk.matmul(
      a.astype(jnp.float32), b.astype(jnp.float32), bias=bias.astype(jnp.float32),
      activation=act, precision=lax.Precision.HIGHEST, implementation="xla"))
  fns = {"xla": lambda a, b, bias: a @ b, f"{impl} plain": lambda a, b, bias: jk.matmul(
      a, b, implementation=impl)}
  refs = {"xla": jax.jit(lambda a, b, bias: _f32_product()(a, b)),
          f"{impl} plain": jax.jit(lambda a, b, bias: _f32_product()(a, b))}
  for act in (None, "relu", "gelu_tanh", "silu", "gelu"):
    label = f"{impl} bias+{act or 'nothing'}"
    fns[label] = lambda a, b, bias, act=act: jk.matmul(a, b, bias=bias, activation=act,
                                                       implementation=impl)
    refs[label] = f32_act(act)
  if impl == "mosaic_gpu":
    problem = Problem(m=s, n=s, k=s, dtype=jnp.dtype(BF16), out_dtype=jnp.dtype(BF16),
                      activation="gelu", has_bias=True)
    base = mosaic_gpu.heuristic(problem, session.chip)
    variants = {f"epi {epi_m}x{epi_n}x{slots} stages {stages}": dataclasses.replace(
        base, epi_tile_m=epi_m, epi_tile_n=epi_n, epi_slots=slots, stages=stages)
        for epi_m, epi_n, slots, stages in ((64, 64, 1, 4), (128, 128, 1, 3), (64, 64, 2, 3))}
    # The shipped tile on JAX's pipeline, which drains the ring at each tile's end (the
    # shipped 128 x 256 bias+gelu runs on into the next tile's loads on the kernel's own ring).
    variants["pipeline"] = _pipeline(problem, session.chip)
    for name, config in variants.items():
      if config == base:  # "bias+gelu" times the shipped config
        continue
      label = f"{impl} bias+gelu {name}"
      fns[label] = lambda a, b, bias, config=config: jk.matmul(
          a, b, bias=bias, activation="gelu", implementation=impl, config=config)
      refs[label] = f32_act("gelu")
  interleaved(session, "epilogue costs", s, fns, bias=True, refs=refs,
              rounds=2 * session.rounds)


def config_candidates(session, impls):
  """Mosaic GPU configs beside the shipped one, round-robin against XLA and cuBLAS: whole-tile
  epilogue pieces (one tile_m x tile_n piece in one buffer, so its store is awaited only at the
  next tile's epilogue; 3 stages fit beside it) at the sizes where each SM runs few tiles and
  the exposed epilogue weighs most, and the heuristic's own config where a shipped entry
  replaces it (4096^3)."""
  if impls[0] != "mosaic_gpu":
    return
  whole = lambda c: dict(epi_tile_m=c.tile_m, epi_tile_n=c.tile_n, epi_slots=1, stages=3)
  heuristic = lambda c: {}
  variants = {8192: [whole], 6144: [whole], 4096: [whole, heuristic], 2048: [whole]}
  for s, changes in variants.items() if not session.smoke else ((256, [whole]),):
    base = mosaic_gpu.heuristic(Problem(m=s, n=s, k=s, dtype=jnp.dtype(BF16),
                                        out_dtype=jnp.dtype(BF16)), session.chip)
    fns = {"xla": lambda a, b: a @ b, "mosaic_gpu": _ours("mosaic_gpu")}
    for change in changes:
      v = change(base)
      config = dataclasses.replace(base, **v)
      label = " ".join(f"{k}={x}" for k, x in v.items()) or "heuristic"
      fns[f"mosaic_gpu {label}"] = _ours("mosaic_gpu", config)
    interleaved(session, "configs bf16", s, fns, torch=session.platform == "gpu",
                rounds=2 * session.rounds)


# The sizes where the heuristic's tile moved when CTA_SHAPES gained 256 x 192 and 128 x 384
# (its first six are the rule from 743871a; the comparison before that one, against the rule
# before the wave model, is bench/NOTES.md matmul-35).
WAVE_SIZES = (2049, 2176, 2304, 3328, 4224, 4352, 5504, 6528, 7552, 8193)
PREVIOUS_SHAPES = mosaic_gpu.CTA_SHAPES[:6]


def waves(session, impls, sizes=None):
  """The heuristic's CTA tiles against those of the previous rule (``PREVIOUS_SHAPES``),
  round-robin with XLA and cuBLAS, at sizes where its tile moved (or at ``sizes``)."""
  if impls[0] != "mosaic_gpu":
    return
  bf = jnp.dtype(BF16)
  for s in (512,) if session.smoke else sizes or WAVE_SIZES:
    p = Problem(m=s, n=s, k=s, dtype=bf, out_dtype=bf)
    new = mosaic_gpu.heuristic(p, session.chip)
    old = mosaic_gpu.heuristic(p, session.chip, shapes=PREVIOUS_SHAPES)
    fns = {"xla": lambda a, b: a @ b, "mosaic_gpu": _ours("mosaic_gpu", new),
           "mosaic_gpu previous": _ours("mosaic_gpu", old)}
    interleaved(session, f"waves {new.cta_m}x{new.cta_n} vs {old.cta_m}x{old.cta_n}", s, fns,
                torch=session.platform == "gpu", rounds=2 * session.rounds,
                n_sets=program_sets(s))


# CTA tiles checked and timed by ``tiles``, as (tile_m, tile_n, split): the two that joined
# mosaic_gpu.CTA_SHAPES in bench/NOTES.md matmul-37, and sizes where the wave model predicted
# them faster than the rule before (6144: as many tile-products in whole waves as 128 x 256,
# a probe of their rate).
EXTRA_TILES = ((128, 192, "m"), (128, 192, "n"))
TILE_SIZES = (2176, 2304, 4224, 5504, 6144, 6528, 7552, 8192)


def tiles(session, impls, sizes=None):
  """EXTRA_TILES checked on odd shapes (every epilogue, transposed operands, fp8), then timed
  round-robin against the heuristic's pick, with XLA and cuBLAS, at TILE_SIZES (or
  ``sizes``)."""
  if impls[0] != "mosaic_gpu":
    return
  chip = session.chip
  config_for = lambda shape: lambda p: mosaic_gpu.fitted(p, mosaic_gpu.tile_config(p, shape),
                                                         chip)
  for shape in EXTRA_TILES:
    _check_configs(session, "x".join(map(str, shape)), config_for(shape), fp8=True)
  bf = jnp.dtype(BF16)
  for s in (512,) if session.smoke else sizes or TILE_SIZES:
    p = Problem(m=s, n=s, k=s, dtype=bf, out_dtype=bf)
    picked = mosaic_gpu.heuristic(p, chip)
    fns = {"xla": lambda a, b: a @ b,
           f"mosaic_gpu {picked.cta_m}x{picked.cta_n}": _ours("mosaic_gpu", picked)}
    for shape in EXTRA_TILES:
      config = config_for(shape)(p)
      if config != picked:  # the heuristic's pick is timed once
        fns[f"mosaic_gpu {config.cta_m}x{config.cta_n} s{config.stages}"] = _ours("mosaic_gpu",
                                                                                 config)
    interleaved(session, "tiles", s, fns, torch=session.platform == "gpu",
                rounds=2 * session.rounds, n_sets=program_sets(s))


# Sizes where the heuristic takes stream-K (3.3, 3.4, 5.3 and 6.06 waves of 128 x 256 tiles),
# and where it does not though the last wave is part-empty (4096: 3.9 waves, 4864: 5.5, 6272:
# 9.3, 6912: 11.05, 8192: 15.5).
STREAM_K_SIZES = (3712, 3840, 4736, 5120, 4096, 4864, 6272, 6912, 8192)


def stream_k(session, impls, sizes=None):
  """Stream-K (``Config.stream_k``): checked on odd shapes (runs that end and begin tiles,
  tiles cut into as many runs as K steps: every epilogue, transposed operands, fp8), then
  timed round-robin at STREAM_K_SIZES (or ``sizes``): the heuristic's config, its tile walked
  whole on JAX's pipeline and on the kernel's own ring, and cut by stream-K with a wave more
  than the leftover tiles and with only those (``stream_k_wave``), with XLA and cuBLAS. The
  leftover-only cut is also checked past whole waves."""
  if impls[0] != "mosaic_gpu":
    return
  chip = session.chip
  variant = lambda p, **kw: mosaic_gpu.fitted(
      p, dataclasses.replace(mosaic_gpu.heuristic(p, chip), epi_tile_m=64, epi_tile_n=64,
                             epi_slots=1, stages=4, **kw), chip)
  _check_configs(session, "stream-k", lambda p: variant(p, stream_k=True), fp8=True)
  # Cutting only the leftover tiles, past whole waves: 2.2 waves of 128 x 256 tiles (3000 x
  # 3001), 4.6 of 256 x 192 (4097 x 2049); a tile's K steps cut into several runs.
  _check_configs(session, "stream-k leftover",
                 lambda p: variant(p, stream_k=True, stream_k_wave=False), fp8=True,
                 shapes=[(3000, 3001, 1000), (4097, 2049, 520)])
  bf = jnp.dtype(BF16)
  for s in (512,) if session.smoke else sizes or STREAM_K_SIZES:
    p = Problem(m=s, n=s, k=s, dtype=bf, out_dtype=bf)
    picked = mosaic_gpu.heuristic(p, chip)
    configs = {"pipeline": _pipeline(p, chip),
               "ring 64x64": variant(p, ring=True, stream_k=False),
               "stream-k 64x64": variant(p, ring=False, stream_k=True),
               "stream-k leftover 64x64": variant(p, ring=False, stream_k=True,
                                                  stream_k_wave=False)}
    fns = {"xla": lambda a, b: a @ b,
           f"mosaic_gpu {picked.cta_m}x{picked.cta_n}{' stream-k' * picked.stream_k}":
               _ours("mosaic_gpu", picked)}
    for label, config in configs.items():
      if config != picked:  # the heuristic's pick is timed once
        fns[f"{label} s{config.stages}"] = _ours("mosaic_gpu", config)
    interleaved(session, "stream-k", s, fns, torch=session.platform == "gpu",
                rounds=2 * session.rounds, n_sets=program_sets(s))


def _check_row(session, row, want, run):
  """``row`` with ``run()``'s relative error against ``want`` (or why it failed), added."""
  try:
    row.error = harness.relative_error(run(), want)
    if not row.error <= row.tolerance:
      row.note = "WRONG"
  except Exception as e:  # noqa: BLE001
    row.note = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
  session.add(row)


def _ring(problem: Problem, chip, **changes) -> mosaic_gpu.Config:
  """The heuristic's config for ``problem`` on the kernel's own ring (``ring=True``)."""
  return dataclasses.replace(mosaic_gpu.heuristic(problem, chip), ring=True, **changes)


def _pipeline(problem: Problem, chip) -> mosaic_gpu.Config:
  """The heuristic's CTA tile for ``problem`` walked whole on JAX's pipeline, with the
  epilogue pieces and stages ``fitted`` gives it there."""
  tile = dataclasses.replace(mosaic_gpu.heuristic(problem, chip), ring=False, stream_k=False)
  return mosaic_gpu.fitted(problem, tile, chip)


def _check_configs(session, name, config_for, fp8=False, shapes=None):
  """Mosaic GPU with ``config_for(problem)`` against the f32 spec on odd shapes (several
  tiles a CTA, ragged edges, K not a multiple of the step), with A and/or B stored transposed
  (the backward's products) and with gelu+bias+residual and silu+bias epilogues; with
  ``fp8``, also e4m3 operands with per-row and per-column scales."""
  import numpy as np

  from jaxkernels.ops.matmul import reference

  gen = np.random.default_rng(1)
  draw = lambda shape: jnp.asarray(gen.standard_normal(shape), jnp.float32).astype(BF16)
  shapes = shapes or [(100, 130, 70), (257, 383, 129), (3, 2, 1027), (1024, 1024, 1024),
                      (2049, 2049, 2049)]
  for (m, n, k) in shapes[:2] if session.smoke else shapes:
    for trans_a, trans_b in ((False, False), (True, False), (False, True), (True, True)):
      for act, use_bias, use_res in ((None, False, False), ("gelu", True, True),
                                     ("silu", True, False)):
        if (trans_a or trans_b) and act:
          continue  # the backward's transposed products carry no epilogue
        a = draw((k, m) if trans_a else (m, k))
        b = draw((n, k) if trans_b else (k, n))
        bias = draw((n,)) if use_bias else None
        res = draw((m, n)) if use_res else None
        p = Problem(m=m, n=n, k=k, dtype=jnp.dtype(BF16), out_dtype=jnp.dtype(BF16),
                    trans_a=trans_a, trans_b=trans_b, activation=act, has_bias=use_bias,
                    has_residual=use_res)
        config = config_for(p)
        a32 = a.astype(jnp.float32).T if trans_a else a.astype(jnp.float32)
        b32 = b.astype(jnp.float32).T if trans_b else b.astype(jnp.float32)
        f32 = lambda x: None if x is None else x.astype(jnp.float32)
        want = reference.matmul(a32, b32, bias=f32(bias), residual=f32(res), activation=act,
                                out_dtype=jnp.float32, precision=lax.Precision.HIGHEST)
        label = (f"check {name} {act or 'plain'}{'+bias' if use_bias else ''}"
                 f"{'+res' if use_res else ''}{' Aᵀ' if trans_a else ''}"
                 f"{' Bᵀ' if trans_b else ''}")
        row = harness.Row("matmul", label, "mosaic_gpu", f"{m}x{n}x{k}", "bfloat16",
                          tolerance=8e-3)
        _check_row(session, row, want, lambda: jax.jit(
            lambda a, b, bias, res, p=p, config=config: mosaic_gpu.matmul(
                a, b, bias=bias, residual=res, problem=p, config=config))(a, b, bias, res))
    if not fp8:
      continue
    # B is stored (N, K) by the kernel's wrapper; K steps are 128 deep.
    a8, b8 = draw((m, k)).astype(F8), draw((k, n)).astype(F8)
    sa = jnp.asarray(gen.uniform(0.5, 2, m), jnp.float32)
    sb = jnp.asarray(gen.uniform(0.5, 2, n), jnp.float32)
    want = reference.matmul(a8, b8, a_scale=sa, b_scale=sb, out_dtype=jnp.float32,
                            precision=lax.Precision.HIGHEST)
    p = Problem(m=m, n=n, k=k, dtype=jnp.dtype(F8), out_dtype=jnp.dtype(BF16), has_scales=True)
    config = config_for(p)
    row = harness.Row("matmul", f"check {name} fp8 scaled", "mosaic_gpu", f"{m}x{n}x{k}",
                      "float8_e4m3fn", tolerance=8e-3)
    _check_row(session, row, want, lambda: jax.jit(
        lambda a, b, p=p, config=config: mosaic_gpu.matmul(
            a, b, a_scale=sa, b_scale=sb, problem=p, config=config))(a8, b8))


def schedules(session, impls):
  """The cooperative schedule on the kernel's own ring (each warpgroup keeps one K step's
  wgmma in flight; the ring runs on across tiles) and ping-pong warpgroups (each owns whole
  tiles, one's epilogue under the other's product), against the shipped config (for plain
  128 x 256 tiles, the ring with 64 x 64 pieces over 4 stages) and the same tile on JAX's
  pipeline: first checked on odd shapes, with transposed operands (the backward's) and every
  epilogue, then timed round-robin, plain and with bias+gelu (each distinct config once)."""
  if impls[0] != "mosaic_gpu":
    return
  smoke = session.smoke
  _check_configs(session, "ring", lambda p: _ring(p, session.chip))
  _check_configs(session, "pingpong", lambda p: PINGPONG)
  for s in (512,) if smoke else (8192, 4096, 6144, 2048):
    gelu = s == 8192
    bf = jnp.dtype(BF16)
    plain_p = Problem(m=s, n=s, k=s, dtype=bf, out_dtype=bf)
    gelu_p = dataclasses.replace(plain_p, activation="gelu", has_bias=True)
    shipped = mosaic_gpu.heuristic(plain_p, session.chip)
    plain = {label: config for label, config in (
        ("pipeline", _pipeline(plain_p, session.chip)), ("ring", _ring(plain_p, session.chip)),
        ("pp s5", PINGPONG)) if config != shipped}  # "mosaic_gpu plain" times the shipped one
    fns = {"xla": lambda a, b, bias: a @ b,
           "mosaic_gpu plain": lambda a, b, bias: jk.matmul(a, b, implementation="mosaic_gpu")}
    plain_ref = jax.jit(lambda a, b, bias: _f32_product()(a, b))
    gelu_ref = jax.jit(lambda a, b, bias: jax.nn.gelu(
        _f32_product()(a, b) + bias.astype(jnp.float32), approximate=False))
    refs = {"xla": plain_ref, "mosaic_gpu plain": plain_ref}
    for label, cfg in plain.items():
      fns[f"{label} plain"] = lambda a, b, bias, cfg=cfg: jk.matmul(
          a, b, implementation="mosaic_gpu", config=cfg)
      refs[f"{label} plain"] = plain_ref
    if gelu:
      shipped = mosaic_gpu.heuristic(gelu_p, session.chip)
      others = {label: config for label, config in (
          ("pipeline", _pipeline(gelu_p, session.chip)), ("ring", _ring(gelu_p, session.chip)))
          if config != shipped}  # "mosaic_gpu bias+gelu" times the shipped one
      for label, cfg in {"mosaic_gpu": None, **others}.items():
        fns[f"{label} bias+gelu"] = lambda a, b, bias, cfg=cfg: jk.matmul(
            a, b, bias=bias, activation="gelu", implementation="mosaic_gpu", config=cfg)
        refs[f"{label} bias+gelu"] = gelu_ref
    interleaved(session, "schedules", s, fns, bias=True, refs=refs, rounds=2 * session.rounds,
                torch=session.platform == "gpu", n_sets=program_sets(s))


def interleaved(session, name, s, fns, *, torch=False, dtype=BF16, bias=False, refs=None,
                flops=None, rounds=None, calls=None, n_sets=None):
  """Checks each implementation, then times them round-robin: one round of each in turn (in
  a fresh random order every round), the median per implementation over the rounds. A GPU at
  its power limit clocks down as a run goes on; timed one after another, whichever ran first
  (on a cool chip) looked up to ~10% faster (run matmul-3, bench/NOTES.md). Round-robin gives
  every implementation the same mix. ``n_sets`` distinct input sets (default: up to 4) make
  one timed program; cuBLAS rotates through as many."""
  rows, programs, wants = {}, {}, {}
  args = _inputs(s, s, s, dtype, 0, bias=bias)
  for impl, fn in fns.items():
    row = harness.Row("matmul", name, impl, f"{s}x{s}x{s}", jnp.dtype(dtype).name)
    try:
      jitted = jax.jit(fn)
      ref = (refs or {}).get(impl) or _f32_product()
      if ref not in wants:  # one spec product per reference, not one per implementation
        wants[ref] = ref(*args)
      row.error = harness.relative_error(jitted(*args), wants[ref])
      row.tolerance = 8e-3
      if not row.error <= row.tolerance:
        row.note = f"WRONG: error {row.error:.2e}; not timed"
      else:
        programs[impl] = jitted
    except Exception as e:  # noqa: BLE001
      row.note = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
    rows[impl] = row
  n_sets = n_sets or harness.sets_for((2 * s * s) * jnp.dtype(dtype).itemsize, most=4)
  sets = [_inputs(s, s, s, dtype, seed, bias=bias) for seed in range(n_sets)]
  batched = {impl: tuning.over_sets(fn) for impl, fn in programs.items()}
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
    # still differed by 2% (matmul-13, bench/NOTES.md).
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
  # (run 18, bench/NOTES.md). Products are long enough for the host clock.
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
    shapes = ((128, 128, "n", 4, 1), (128, 192, "m", 3, 2), (64, 256, "m", 4, 1),
              (128, 128, "n", 3, 2))
    orders = (("n", 16), ("m", 8), ("n", 8), ("m", 16)) if s % 1024 == 0 else (("n", 16),)
    candidates = [mosaic_gpu.Config(tile_m=tm, tile_n=tn, tile_k=64, stages=st, split=sp,
                                    grid_minor=gm, grid_tile_width=w, epi_slots=slots)
                  for tm, tn, sp, st, slots in shapes for gm, w in orders]
  else:
    candidates = [triton.Config(block_m=bm, block_n=bn, block_k=bk, group_m=8, num_warps=8,
                                num_stages=st)
                  for bm, bn, bk in ((128, 256, 64), (256, 128, 64), (128, 128, 64))
                  for st in (3, 4)]
  best, trials = tuning.autotune(
      impl, p, candidates, chip=session.chip,
      make_inputs=lambda seed: _inputs(s, s, s, BF16, seed),
      run=lambda config, a, b: jk.matmul(a, b, implementation=impl, config=config),
      check=lambda out, args: harness.relative_error(out, _f32_product()(*args)) < 8e-3,
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
# launch a product) is launch-bound there and is not plotted (bench/NOTES.md, matmul-30).
PROGRAM_SECONDS = 0.5e-3
MOST_SETS = 24
SWEEP_HOST_CLOCK_FROM = 2048
# Rounds and programs a timing of the sweep. With 3 x 3 (to 9ce3759) one timing was the
# difference of 3 and 6 programs, ~1.5 and 3 ms, and read 4096^3 from 0.115 to 0.172 ms (XLA,
# 3 rounds): rows above the H200's peak (bench/NOTES.md, matmul-37). Compiling and checking
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
    if s < SWEEP_HOST_CLOCK_FROM and session.platform == "gpu":
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
        only=None, sweep_range=(1024, 8192), sizes=None) -> None:
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
  return _run(session, impls, sweep, step, only, tune_first, sweep_range, sizes)


def _run(session, impls, sweep, step, only, tune_first=False, sweep_range=(1024, 8192),
         sizes=None):
  """The parts named in ``only``; ``sizes`` replaces the sizes that waves, tiles and streamk
  time (not on a smoke run, which times 512)."""
  only = set(only or ("checks", "headline", "sweep"))
  if "checks" in only:
    checks(session, impls)
  if tune_first and session.platform == "gpu":
    for s in (8192, 8193, 2049, 4096):
      tune(session, impls[0], s)
  if "headline" in only:
    headline(session, impls)
  if "epilogue" in only:
    epilogue_costs(session, impls)
  if "configs" in only:
    config_candidates(session, impls)
  if "clusters" in only:
    clusters(session, impls)
  if "schedules" in only:
    schedules(session, impls)
  if "waves" in only:
    waves(session, impls, sizes)
  if "tiles" in only:
    tiles(session, impls, sizes)
  if "streamk" in only:
    stream_k(session, impls, sizes)
  if sweep and "sweep" in only:
    sweep_sizes(session, impls[:1], step if not session.smoke else 128, sweep_range)


def checks(session, impls):
  """Kernel vs the float64-free f32 spec on odd shapes, every epilogue, gradients: rows with an
  error and a tolerance, untimed. (On the CPU the tests do this; here it is the GPU's word.)"""
  import numpy as np

  from jaxkernels.ops.matmul import reference

  # 2 x 1700 x 1800 x 333 takes 128 x 256 tiles on the kernel's own ring, every epilogue,
  # with ragged edges in M, N and K.
  shapes = [(100, 130, 70), (257, 383, 129), (3, 2, 1027), (1024, 1024, 1024), (1700, 1800, 333)]
  gen = np.random.default_rng(0)
  def draw(shape, dtype):
    return jnp.asarray(gen.standard_normal(shape), jnp.float32).astype(dtype)

  epilogues = ((None, False, False), ("gelu", True, True), ("silu", True, False),
               ("relu", False, True))
  for (m, n, k) in shapes:
    for dtype in (BF16, jnp.float16, jnp.float32):
      for act, use_bias, use_res in epilogues if dtype == BF16 else epilogues[:2]:
        a, b = draw((2, m, k), dtype), draw((k, n), dtype)
        bias = draw((n,), dtype) if use_bias else None
        res = draw((2, m, n), dtype) if use_res else None
        dy = draw((2, m, n), dtype)
        kw = dict(bias=bias, activation=act, residual=res)
        def value_and_grads(fn, *args):
          out, vjp = jax.vjp(fn, *args)
          return out, vjp(dy.astype(out.dtype))
        f32 = lambda x: None if x is None else x.astype(jnp.float32)
        spec = jax.jit(lambda a, b, bias, res: value_and_grads(
            lambda a, b, bias, res: reference.matmul(
                a, b, bias=bias, residual=res, activation=act, out_dtype=jnp.float32,
                precision=lax.Precision.HIGHEST), a, b, bias, res))
        want = spec(f32(a), f32(b), f32(bias), f32(res))
        naive = jax.jit(lambda a, b, bias, res: value_and_grads(
            lambda a, b, bias, res: jk.matmul(a, b, bias=bias, residual=res, activation=act,
                                              implementation="xla"), a, b, bias, res))(
            a, b, bias, res)
        tolerance = max(2 * harness.relative_error(naive, want), 1e-5)
        for impl in impls:
          label = f"check {act or 'plain'}{'+bias' if use_bias else ''}{'+res' if use_res else ''}"
          row = harness.Row("matmul", label, impl, f"2x{m}x{n}x{k}", jnp.dtype(dtype).name,
                            tolerance=tolerance)
          if not jk.supports("matmul", impl, a, b, **kw):
            continue
          try:
            got = jax.jit(lambda a, b, bias, res: value_and_grads(
                lambda a, b, bias, res: jk.matmul(a, b, bias=bias, residual=res, activation=act,
                                                  implementation=impl), a, b, bias, res))(
                a, b, bias, res)
            errors = [harness.relative_error(g, w) for g, w in
                      zip(jax.tree.leaves(got), jax.tree.leaves(want))]
            row.error = max(errors)
            if not row.error <= tolerance:
              row.note = "WRONG: per output " + " ".join(f"{e:.1e}" for e in errors)
          except Exception as e:  # noqa: BLE001
            row.note = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
          if row.note or (m, n, k) == shapes[0]:
            session.add(row)
          else:
            session.rows.append(row)
  # fp8 with per-row and per-column scales, odd shapes.
  for (m, n, k) in shapes[:3]:
    for f8 in (jnp.float8_e4m3fn, jnp.float8_e5m2):
      a, b = draw((m, k), f8), draw((k, n), f8)
      sa = jnp.asarray(gen.uniform(0.5, 2, m), jnp.float32)
      sb = jnp.asarray(gen.uniform(0.5, 2, n), jnp.float32)
      want = reference.matmul(a, b, a_scale=sa, b_scale=sb, out_dtype=jnp.float32,
                              precision=lax.Precision.HIGHEST)
      for impl in impls:
        if not jk.supports("matmul", impl, a, b, a_scale=sa, b_scale=sb):
          continue
        row = harness.Row("matmul", "check fp8 scaled", impl, f"{m}x{n}x{k}",
                          jnp.dtype(f8).name, tolerance=8e-3)
        _check_row(session, row, want, lambda: jax.jit(
            lambda a, b: jk.matmul(a, b, a_scale=sa, b_scale=sb, implementation=impl))(a, b))
