"""python -m bench lessons [--smoke] [--tpu]: the accelerator lecture's lessons, measured.

Each lesson states what the lecture predicts (``LESSONS``) and times the cases that test it on
the device JAX sees, in the same run: fusion, tiling, coalescing, masking, low precision and
host overhead. ``--tpu`` instead compiles the TPU side of fusion and tiling for v5e, v5p and
v6e from this host (libtpu, no TPU): the bytes the compiler's cost analysis says each program
moves, and the VMEM each tile needs. Wave quantization and recomputation are measured by the
matmul sweep and the model's remat runs; the report (``python -m bench report``) plots them
beside these. On a CPU (``--smoke``) every case runs small, kernels interpreted: a check that
the suite builds, not a measurement.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

import jaxkernels as jk
from bench import harness
from jaxkernels import hardware

F32, BF16 = jnp.float32, jnp.bfloat16

# What the lecture predicts, by lesson (the report prints it above the lesson's rows).
LESSONS = {
    "fusion": (
        "sin(x)^2 + cos(x)^2 as five operations, each through HBM, reads and writes 11 words an "
        "element (sin: 2, cos: 2, two squares: 2 each, the sum: 3); fused into one pass, 2. A "
        "memory-bound computation should then run ~5.5x faster fused, whoever fuses it (XLA's "
        "fusion or a Pallas kernel)."),
    "tiling": (
        "A tile of bm x bn outputs reads (bm + bn) x bk operand elements per 2 bm bn bk FLOPs: "
        "intensity 2 bm bn / (bm + bn) FLOP per element read. Small tiles are bandwidth-bound "
        "(from L2 or HBM), large ones compute-bound until they exhaust registers or shared "
        "memory (GPU) or VMEM (TPU). TPU's MXU is 128 x 128 (v5e, v5p) or 256 x 256 (v6e): a "
        "tile edge below it wastes the array."),
    "waves": (
        "A persistent grid runs ceil(tiles / SMs) waves; a size whose tiles just exceed a whole "
        "wave pays a near-empty last wave (the matmul sweep's sawtooth; the wave model in "
        "jaxkernels/ops/matmul/mosaic_gpu/config.py). TPUs have one or two TensorCores a chip: "
        "no waves, but the same quantization at the MXU's 128/256 edge."),
    "coalescing": (
        "A warp's 32 loads of consecutive addresses become one transaction; 32 loads a row "
        "apart become 32. A copy in blocks along the contiguous axis should run near the copy "
        "bandwidth, one down the columns an order of magnitude slower. A matmul operand stored "
        "transposed costs nothing where the kernel reads it transposed in place (cuBLAS's "
        "TN/NT, our kernels' transposed shared-memory views)."),
    "masking": (
        "Causal attention needs half the score blocks. A kernel that skips the masked blocks "
        "should take ~half the time of the full product; one that walks every block and masks "
        "(a dense -inf bias) takes the full time, and reads the bias besides."),
    "low precision": (
        "Halving the bytes halves a memory-bound op's time (f32 -> bf16 -> fp8 storage). On "
        "the tensor cores a compute-bound product runs at each precision's peak: H100 dense "
        "tf32 ~495, bf16 ~990, fp8 ~1980 TFLOP/s (f32 without tensor cores ~67): ~2x a step."),
    "recomputation": (
        "Saving fewer activations for the backward trades FLOPs for memory: 'full' remat "
        "recomputes the forward (~1.33x the step's FLOPs) and lets the batch grow; 'dots' saves "
        "the products' outputs only. The remat table (python -m bench model --remat) measures "
        "each policy's step time and largest batch."),
    "host overhead": (
        "A kernel launch and a jitted dispatch cost microseconds on the host whatever the "
        "kernel does: below some size the host clock stops falling with the work and the "
        "device's own kernel time (CUPTI) is a small part of it."),
}


def _row(session, lesson, case, impl, shape, dtype, seconds, *, nbytes=None, flops=None,
         note=""):
  row = harness.Row("lessons", f"{lesson}: {case}", impl, shape, jnp.dtype(dtype).name,
                    note=note)
  if seconds is not None:
    row.ms = seconds * 1e3
    if nbytes is not None:
      row.gbps = nbytes / seconds / 1e9
    if flops is not None:
      row.tflops = flops / seconds / 1e12
  return session.add(row)


def _timed(session, fn, *args):
  """Seconds per call of the jitted ``fn`` on ``args``, checked to run first."""
  harness.block(fn(*args))
  return harness.time_sets(fn, [args], rounds=session.rounds, calls=session.calls)


def _measure(session, lesson, case, impl, shape, dtype, fn, *args, want=None, nbytes=None,
             flops=None, note="", error_in_note=False):
  """The row of the jitted ``fn`` on ``args``: its error against ``want`` where given, and its
  time; a row saying why where it fails to build or run. ``error_in_note``: the error is the
  format's (fp8 against float32), not one a tolerance bounds: the note says it instead."""
  try:
    error = None if want is None else harness.relative_error(fn(*args), want)
    seconds = _timed(session, fn, *args)
  except Exception as e:  # noqa: BLE001 - a case that fails is a row; the others go on
    return _failed(session, lesson, case, impl, shape, dtype, e)
  if error_in_note:
    note, error = f"error {error:.1e} against the float32 product", None
  row = _row(session, lesson, case, impl, shape, dtype, seconds, nbytes=nbytes, flops=flops,
             note=note)
  row.error = error
  return row


def _failed(session, lesson, case, impl, shape, dtype, error):
  row = harness.Row("lessons", f"{lesson}: {case}", impl, shape, jnp.dtype(dtype).name,
                    note=f"FAILED: {type(error).__name__}: {str(error)[:200]}")
  return session.add(row)


# --------------------------------------------------------------------------- #
# fusion
# --------------------------------------------------------------------------- #

def separate(x):
  """sin(x)^2 + cos(x)^2 with every intermediate materialized: an optimization barrier after
  each operation keeps XLA from fusing across it."""
  s = lax.optimization_barrier(jnp.sin(x))
  c = lax.optimization_barrier(jnp.cos(x))
  s2 = lax.optimization_barrier(s * s)
  c2 = lax.optimization_barrier(c * c)
  return s2 + c2


def fused(x):
  s, c = jnp.sin(x), jnp.cos(x)
  return s * s + c * c


def _fused_kernel(x_ref, o_ref):
  o_ref[...] = fused(x_ref[...])


def pallas_fused(x, *, block_rows=8, interpret=False):
  """The fused computation as a Pallas kernel over (block_rows, 1024) blocks of x (rows, 1024).
  (x is 2-D already: on a TPU, reshaping a 1-D array to rows is a copy through HBM, its tiled
  layout being (8, 128) tiles; the compiled program counted 4 words an element with it.)"""
  spec = pl.BlockSpec((block_rows, x.shape[1]), lambda i: (i, 0))
  # What the kernel reads, writes and computes, for compilers that cannot look inside it (the
  # TPU compiler's cost analysis counts a Mosaic kernel by this alone).
  cost = pl.CostEstimate(flops=3 * x.size, transcendentals=2 * x.size,
                         bytes_accessed=2 * x.size * x.dtype.itemsize)
  return pl.pallas_call(_fused_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(x.shape[0] // block_rows,), in_specs=[spec], out_specs=spec,
                        cost_estimate=cost, interpret=interpret)(x)


def fusion(session):
  n = (1 << 26) if not session.smoke else (1 << 14)
  x = jax.random.uniform(jax.random.key(0), (n // 1024, 1024), F32, -3, 3)
  word = 4
  ways = {"5 ops, each through HBM (xla)": (jax.jit(separate), 11),
          "one XLA fusion": (jax.jit(fused), 2)}
  if session.platform == "gpu" or session.interpret:
    # Two block heights: 8 rows of 1024 (64 elements a thread of 4 warps) ran at 463 GB/s on
    # an H100, against XLA's fusion at 2986: whether it is the block's registers that cost.
    for rows in (8, 1):
      ways[f"one Pallas kernel, {rows}x1024 blocks"] = (jax.jit(functools.partial(
          pallas_fused, interpret=session.interpret, block_rows=rows)), 2)
  want = fused(x)
  for case, (fn, words) in ways.items():
    _measure(session, "fusion", case, "pallas" if "Pallas" in case else "xla",
             f"{n // 1024}x1024", F32, fn, x, want=want, nbytes=words * n * word,
             note=f"{words} words an element (the model's count)")


# --------------------------------------------------------------------------- #
# tiling
# --------------------------------------------------------------------------- #

TILES = ((32, 32, 32), (64, 64, 32), (128, 64, 32), (128, 128, 32), (128, 128, 64),
         (128, 256, 64), (256, 128, 64))


def tiling(session):
  if session.platform != "gpu" and not session.interpret:
    return
  from jaxkernels.ops.matmul import triton
  s = 4096 if not session.smoke else 128
  keys = jax.random.split(jax.random.key(1), 2)
  a = (jax.random.normal(keys[0], (s, s), F32) * s ** -0.25).astype(BF16)
  b = (jax.random.normal(keys[1], (s, s), F32) * s ** -0.25).astype(BF16)
  want = jnp.dot(a, b, preferred_element_type=F32)
  for bm, bn, bk in TILES if not session.smoke else TILES[:2]:
    config = triton.Config(block_m=bm, block_n=bn, block_k=bk, num_warps=4 if bm * bn <= 4096
                           else 8, num_stages=3)
    fn = jax.jit(functools.partial(jk.matmul, implementation="triton", config=config))
    intensity = 2 * bm * bn / (bm + bn)
    _measure(session, "tiling", f"matmul bf16, Triton tile {bm}x{bn}x{bk}", "triton",
             f"{s}x{s}x{s}", BF16, fn, a, b, want=want, flops=2.0 * s ** 3,
             note=f"tile intensity {intensity:.0f} FLOP per element read")


# --------------------------------------------------------------------------- #
# coalescing
# --------------------------------------------------------------------------- #

def _copy_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...]


def blocked_copy(x, block, *, interpret=False):
  """x copied by a Pallas kernel in ``block``-shaped pieces: (1, W) walks rows along the
  contiguous axis, (H, 1) walks down columns."""
  rows, cols = x.shape
  grid = (rows // block[0], cols // block[1])
  spec = pl.BlockSpec(block, lambda i, j: (i, j))
  return pl.pallas_call(_copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=grid, in_specs=[spec], out_specs=spec, interpret=interpret)(x)


def coalescing(session):
  side = 8192 if not session.smoke else 256
  x = jax.random.normal(jax.random.key(2), (side, side), F32)
  if session.platform == "gpu" or session.interpret:
    for block, case in (((1, 1024), "copy in 1 x 1024 blocks (along rows)"),
                        ((1024, 1), "copy in 1024 x 1 blocks (down columns)")):
      block = tuple(min(b, side) for b in block)
      fn = jax.jit(functools.partial(blocked_copy, block=block, interpret=session.interpret))
      _measure(session, "coalescing", case, "pallas", f"{side}x{side}", F32, fn, x, want=x,
               nbytes=2 * x.size * 4)
  # A matmul operand stored transposed: (N, K) read as B^T.
  s = 8192 if not session.smoke else 128
  keys = jax.random.split(jax.random.key(3), 2)
  a = (jax.random.normal(keys[0], (s, s), F32) * s ** -0.25).astype(BF16)
  b = (jax.random.normal(keys[1], (s, s), F32) * s ** -0.25).astype(BF16)
  bt = jnp.asarray(b.T)
  nt = lambda a, bt: lax.dot_general(a, bt, (((1,), (1,)), ((), ())))
  ways = {"matmul, B stored (K, N) (xla)": (jax.jit(lambda a, b: a @ b), b, "xla"),
          "matmul, B stored (N, K) (xla)": (jax.jit(nt), bt, "xla")}
  if session.platform == "gpu":
    ways["matmul, B stored (K, N) (ours)"] = (jax.jit(jk.matmul), b, "mosaic_gpu")
    ways["matmul, B stored (N, K), read transposed (ours)"] = (
        jax.jit(lambda a, bt: jk.matmul(a, bt.T)), bt, "mosaic_gpu")
  for case, (fn, operand, impl) in ways.items():
    _measure(session, "coalescing", case, impl, f"{s}x{s}x{s}", BF16, fn, a, operand,
             flops=2.0 * s ** 3)


# --------------------------------------------------------------------------- #
# masking
# --------------------------------------------------------------------------- #

def masking(session):
  if session.platform != "gpu" and not session.interpret:
    return
  b, t, n, h = (2, 4096, 16, 128) if not session.smoke else (1, 256, 2, 64)
  keys = jax.random.split(jax.random.key(4), 3)
  q, k, v = (jax.random.normal(key, (b, t, n, h), F32).astype(BF16) for key in keys)
  upper = jnp.triu(jnp.ones((t, t), bool), 1)
  mask_bias = jnp.where(upper, -jnp.inf, 0.0).astype(BF16)[None, None]
  full = 4.0 * b * n * t * t * h
  ways = {
      "causal, masked blocks skipped": (lambda q, k, v: jk.flash_attention(q, k, v, causal=True),
                                        full / 2),
      "causal as a dense -inf bias, every block walked": (
          lambda q, k, v: jk.flash_attention(q, k, v, bias=mask_bias), full / 2),
      "no mask (all blocks, the full product)": (lambda q, k, v: jk.flash_attention(q, k, v),
                                                 full),
  }
  wants = {causal: jk.flash_attention(q, k, v, causal=causal, implementation="xla")
           for causal in (True, False)}
  for case, (fn, flops) in ways.items():
    _measure(session, "masking", case, "jaxkernels", f"{b}x{t}x{n}x{h}", BF16, jax.jit(fn),
             q, k, v, want=wants["causal" in case], flops=flops,
             note="TFLOP/s counts the causal half's work for the causal rows")


# --------------------------------------------------------------------------- #
# low precision
# --------------------------------------------------------------------------- #

def low_precision(session):
  # Memory-bound: y = 2x + 1 stored in each dtype (XLA's fusion: one read, one write).
  n = (1 << 27) if not session.smoke else (1 << 14)
  x32 = jax.random.normal(jax.random.key(5), (n,), F32)
  axpy = jax.jit(lambda x: (x.astype(F32) * 2 + 1).astype(x.dtype))
  for dtype in (F32, BF16, jnp.float8_e4m3fn):
    x = x32.astype(dtype)
    seconds = _timed(session, axpy, x)
    _row(session, "low precision", "y = 2x + 1, stored", "xla", str(n), dtype, seconds,
         nbytes=2 * n * jnp.dtype(dtype).itemsize)
  # Compute-bound: the product at each precision.
  s = 8192 if session.platform == "gpu" else 256
  keys = jax.random.split(jax.random.key(6), 2)
  a = jax.random.normal(keys[0], (s, s), F32) * s ** -0.25
  b = jax.random.normal(keys[1], (s, s), F32) * s ** -0.25
  want = jnp.dot(a, b, precision=lax.Precision.HIGHEST)
  dot = lambda precision: jax.jit(lambda a, b: jnp.dot(a, b, precision=precision))
  ways = {"float32 (no tensor cores: HIGHEST)": (dot(lax.Precision.HIGHEST), a, b, F32),
          "tf32 (float32 operands, DEFAULT)": (dot(lax.Precision.DEFAULT), a, b, F32),
          "bfloat16": (jax.jit(lambda a, b: a @ b), a.astype(BF16), b.astype(BF16), BF16)}
  a8, sa = jk.quantize(a)
  b8, sb = jk.quantize(b)
  ways["fp8 e4m3, per-tensor scales (xla)"] = (
      jax.jit(lambda a, b: jk.matmul(a, b, a_scale=sa, b_scale=sb, implementation="xla")),
      a8, b8, jnp.float8_e4m3fn)
  if session.platform == "gpu":
    ways["fp8 e4m3, per-tensor scales (ours)"] = (
        jax.jit(lambda a, b: jk.matmul(a, b, a_scale=sa, b_scale=sb)), a8, b8,
        jnp.float8_e4m3fn)
  for case, (fn, x, y, dtype) in ways.items():
    _measure(session, "low precision", f"matmul {case}", "jaxkernels" if "ours" in case else "xla",
             f"{s}x{s}x{s}", dtype, fn, x, y, want=want, flops=2.0 * s ** 3, error_in_note=True)


# --------------------------------------------------------------------------- #
# host overhead
# --------------------------------------------------------------------------- #

def host_overhead(session):
  width = 1024
  scale = jnp.ones((width,), BF16)
  for rows in (1, 16, 256, 4096, 65536) if not session.smoke else (1, 16):
    x = jax.random.normal(jax.random.key(7), (rows, width), F32).astype(BF16)
    fn = jax.jit(lambda x: jk.rms_norm(x, scale))
    shape = f"{rows}x{width}"
    try:
      harness.block(fn(x))
      # One program a call (no batching over sets): what a training loop's small op pays.
      seconds = harness.time_call(fn, (x,), rounds=session.rounds, calls=max(session.calls, 20))
      kernel, kernels = harness.kernel_seconds(fn, [(x,)]) if session.profiles else (None, None)
    except Exception as e:  # noqa: BLE001
      _failed(session, "host overhead", "rms_norm, one call a program", "jaxkernels", shape,
              BF16, e)
      continue
    row = _row(session, "host overhead", "rms_norm, one call a program", "jaxkernels", shape,
               BF16, seconds, nbytes=2 * x.size * 2)
    if kernel:
      row.kernel_ms, row.kernels = kernel * 1e3, kernels
      row.note = f"kernel {kernel * 1e6:.1f} us of {seconds * 1e6:.1f} us on the host clock"


SUITE = (fusion, tiling, coalescing, masking, low_precision, host_overhead)


def run(session, **unused) -> None:
  import contextlib
  context = jk.interpret_mode if session.interpret else contextlib.nullcontext
  for lesson in SUITE:
    with context():
      lesson(session)


# --------------------------------------------------------------------------- #
# the TPU side, compiled (no TPU)
# --------------------------------------------------------------------------- #

def tpu_compiled(session, chips=("v5e", "v5p", "v6e")) -> None:
  """Fusion's bytes and tiling's VMEM and predicted time for each TPU generation, from
  programs AOT-compiled on this host (libtpu)."""
  import numpy as np
  from jax.experimental import topologies
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

  from jaxkernels.ops.matmul import mosaic_tpu

  for generation in chips:
    topology = topologies.get_topology_desc(platform="tpu",
                                            topology_name=hardware.TPU_TOPOLOGIES[generation])
    device = topology.devices[0]
    chip = hardware.chip_for(device.device_kind)
    mesh = jax.sharding.Mesh(np.array([device]), ("chip",), axis_types=(AxisType.Explicit,))

    def compiled(fn, *shapes):
      args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P())) for s, d in shapes]
      with jax.set_mesh(mesh):
        program = jax.jit(fn).lower(*args).compile()
      cost = program.cost_analysis()
      return program, (cost[0] if isinstance(cost, list) else cost) or {}

    n = 1 << 26
    for case, fn in (("5 ops, each through HBM (xla)", separate), ("one XLA fusion", fused),
                     ("one Pallas kernel", functools.partial(pallas_fused, block_rows=8))):
      by_kernel = "; the Mosaic kernel's own CostEstimate" if "Pallas" in case else ""
      try:
        _, cost = compiled(fn, ((n // 1024, 1024), F32))
      except Exception as e:  # noqa: BLE001
        _failed(session, "fusion", case, chip.name, f"{n // 1024}x1024", F32, e)
        continue
      moved = float(cost.get("bytes accessed", 0.0))
      if not moved:
        _failed(session, "fusion", case, chip.name, f"{n // 1024}x1024", F32,
                ValueError("the cost analysis counted no bytes"))
        continue
      seconds = moved / chip.hbm_bandwidth
      _row(session, "fusion", case, f"{chip.name} (predicted)", f"{n // 1024}x1024", F32, seconds,
           nbytes=moved,
           note=f"predicted: {moved / 1e6:.0f} MB by the compiler's cost analysis "
                f"({moved / (n * 4):.1f} words an element{by_kernel}) at {chip.name}'s HBM "
                "bandwidth")
    s = 8192
    for bm, bn, bk in ((128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 512),
                       (2048, 2048, 512)):
      config = mosaic_tpu.Config(block_m=bm, block_n=bn, block_k=bk)
      vmem = 2 * (bm * bk + bk * bn) * 2 + 2 * bm * bn * 2 + bm * bn * 4
      case = f"matmul bf16, Mosaic TPU tile {bm}x{bn}x{bk}"
      try:
        compiled(lambda a, b: jk.matmul(a, b, implementation="mosaic_tpu", config=config),
                 ((s, s), BF16), ((s, s), BF16))
        fits = "compiles"
      except Exception as e:  # noqa: BLE001
        fits = f"does not compile ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
      # HBM traffic of the tiled product: A read N / bn times, B read M / bm times, C once.
      traffic = 2 * s * s * (s / bn + s / bm) + 2 * s * s
      flops = 2.0 * s ** 3
      seconds = max(flops / chip.flops("bfloat16"), traffic / chip.hbm_bandwidth)
      _row(session, "tiling", case, f"{chip.name} (predicted)", f"{s}x{s}x{s}", BF16, seconds,
           flops=flops,
           note=(f"predicted: max(FLOPs / peak, the tiling's HBM traffic {traffic / 1e9:.1f} GB "
                 f"/ bandwidth); VMEM {vmem / 2**20:.1f} MiB (double-buffered A, B and C "
                 f"blocks, float32 accumulator) of {chip.onchip_bytes / 2**20:.0f}; {fits}; "
                 f"intensity {2 * bm * bn / (bm + bn):.0f} FLOP per element read from HBM "
                 f"against the chip's {2 * chip.flops('bfloat16') / chip.hbm_bandwidth:.0f} "
                 "(bf16: 2 bytes an element)"))
