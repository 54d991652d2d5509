"""python -m bench.tpu_predicted [--chips v5e,v5p,v6e] [--out DIR]: TPU times, predicted.

No TPU has run our kernels. This compiles each op at the GPU suites' headline shapes for one
chip of each TPU generation (AOT from this host, through libtpu: the real TPU compiler), ours
(mosaic_tpu) and XLA's, and predicts each program's time from what the compiled program says
it does: max(FLOPs / the chip's dense bf16 peak, bytes / its HBM bandwidth), the FLOPs and
bytes from the compiler's cost analysis (a Mosaic kernel's are the ``pl.CostEstimate`` our
kernels state, roofline.py; XLA's fusions' its own count of what each fusion reads and writes).
A roofline prediction: it cannot see a kernel's pipeline bubbles, its grid's imbalance or the
MXU's tile quantization, so it is a lower bound on the time, and the ratio of two predictions
is the ratio of the bytes (or FLOPs) they move. Each row also records the compiled program's
HBM (arguments, outputs, temporaries). Rows are the standard result rows, ``ms`` the predicted
time and the note saying so; the file goes under results/tpu_compiled/, where
``python -m bench report`` shows it as "TPU v5e (predicted)" and so on.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import datetime
import json
import pathlib
import re
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxkernels as jk
from bench import harness, shapes
from jaxkernels import hardware, roofline

ROOT = pathlib.Path(__file__).resolve().parent
BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Case:
  suite: str
  name: str
  shape: str  # as the GPU suites write it, so that the report lines up the devices
  arrays: tuple[tuple[tuple[int, ...], object], ...]  # (shape, dtype) of each argument
  op: Callable[..., object]  # op(implementation, *args) -> output
  grad: bool  # fwd+bwd: the sum of the output's gradient with respect to the float arguments


def _norm(layer, residual):
  def op(impl, x, w, r):
    f = jk.layer_norm if layer else jk.rms_norm
    out = f(x, w, residual=r if residual else None, implementation=impl)
    return out[0] if residual else out
  return op


def _cases() -> list[Case]:
  """The GPU suites' headline shapes (bench/shapes.py), so that the report lines them up."""
  r, w = shapes.HEADLINE_ROWS
  rows, vector, name_rows = ((r, w), BF16), ((w,), BF16), f"{r}x{w}"
  logits = shapes.CROSS_ENTROPY_ROWS
  # The GPU suite's attention shapes with anchors: plain and causal, GQA 32/8 at head dims
  # 64, 128 and 256 (the mask features and the long row are the GPU suite's own).
  attention = [a for a in shapes.attention(smoke=False) if a.anchors and a.check]
  cases = []
  for passes, grad in (("fwd", False), ("fwd+bwd", True)):
    for layer in (False, True):
      for residual in (False, True):
        name = f"{'layer' if layer else 'rms'}_norm{'+residual' if residual else ''} {passes}"
        cases.append(Case("norms", name, name_rows, (rows, vector, rows),
                          _norm(layer, residual), grad))
    cases += [
        Case("softmax", f"softmax one-pass {passes}", name_rows, (rows,),
             lambda impl, x: jk.softmax(x, implementation=impl), grad),
        Case("elementwise", f"bias+gelu {passes}", name_rows, (rows, vector),
             lambda impl, x, b: jk.bias_activation(x, b, activation="gelu",
                                                   implementation=impl), grad),
        Case("elementwise", f"glu silu {passes}", name_rows, (rows, rows),
             lambda impl, g, u: jk.glu(g, u, activation="silu", implementation=impl), grad),
        Case("cross_entropy", f"cross_entropy rows {passes}", "x".join(map(str, logits)),
             ((logits, BF16), ((logits[0],), jnp.int32)),
             lambda impl, z, y: jk.softmax_cross_entropy(z, y, reduction="sum",
                                                         implementation=impl), grad),
    ]
    cases += [Case("attention", f"{a.name} {passes}", str(a),
                   (((a.batch, a.length, a.heads, a.head_dim), BF16),
                    *[((a.batch, a.length, a.kv_heads, a.head_dim), BF16)] * 2),
                   functools.partial(_attention, causal=a.causal), grad) for a in attention]
  big, mid = shapes.MATMUL_SQUARE[:2]  # 8192 and 4096
  square = lambda s: (((s, s), BF16),) * 2
  cases += [
      Case("matmul", "bf16", f"{big}x{big}x{big}", square(big),
           lambda impl, a, b: jk.matmul(a, b, implementation=impl), False),
      Case("matmul", "bf16", f"{mid}x{mid}x{mid}", square(mid),
           lambda impl, a, b: jk.matmul(a, b, implementation=impl), False),
      Case("matmul", "bias+gelu fwd+bwd", f"{mid}x{mid}x{mid}", (*square(mid), ((mid,), BF16)),
           lambda impl, a, b, c: jk.matmul(a, b, bias=c, activation="gelu",
                                           implementation=impl), True),
  ]
  return cases


def _attention(impl, q, k, v, *, causal: bool):
  return jk.flash_attention(q, k, v, causal=causal, implementation=impl)


def _causal(case: Case) -> bool:
  return "causal" in case.name.split()


def _heads_major(case: Case) -> tuple:
  """``case``'s (B, T, N, H) arrays' shapes as (B, N, T, H): the Pallas TPU anchors' layout."""
  return tuple(((b, n, t, h), dtype) for (b, t, n, h), dtype in case.arrays)


def _jax_pallas_tpu(case: Case):
  """JAX's own Pallas TPU flash attention (jax.experimental.pallas.ops.tpu), the anchor among
  TPU kernels, in its native (B, N, T, H) layout (no transposes charged to it), default
  blocks."""
  from jax.experimental.pallas.ops.tpu import flash_attention as example
  causal = _causal(case)

  def op(impl, q, k, v):
    del impl
    scale = q.shape[-1] ** -0.5
    return example.flash_attention(q, k, v, causal=causal, sm_scale=scale)
  return dataclasses.replace(case, arrays=_heads_major(case), op=op)


# Splash attention's blocks as MaxText's base.yml sets them (sa_block_q, sa_block_kv and their
# _compute, _dkv and _dq companions all 512; the dq kernel unfused): what the attention TPU
# users run in production is configured so, not with the kernel's own 128 defaults.
SPLASH_BLOCK = 512


def _splash(case: Case):
  """JAX's splash attention (jax.experimental.pallas.ops.tpu.splash_attention), the production
  TPU attention: its block-sparse mask (full, or causal: the blocks above the diagonal never
  visited), MaxText's blocks (SPLASH_BLOCK), its native (B, N, T, H) layout (no transposes
  charged to it), the batch vmapped and q scaled before the kernel, as MaxText calls it."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as splash, splash_attention_mask as masks)
  causal = _causal(case)
  (b, t, n, h), _ = case.arrays[0]
  block = SPLASH_BLOCK
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                            block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                            block_q_dq=block, block_kv_dq=block)
  mask = masks.MultiHeadMask([masks.CausalMask((t, t)) if causal else masks.FullMask((t, t))]
                             * n)
  kernel = splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes)

  def op(impl, q, k, v):
    del impl
    return jax.vmap(kernel)(q * (q.shape[-1] ** -0.5), k, v)
  return dataclasses.replace(case, arrays=_heads_major(case), op=op)


def _splash_maxtext(case: Case):
  """Splash attention as MaxText calls it on (B, T, N, H) activations (its attention_op's
  tpu_flash_attention): q, k and v transposed to (B, N, T, H), splash, the output transposed
  back. The layout ours takes, so the transposes are what a (B, T, N, H) user pays either way."""
  native = _splash(case)

  def op(impl, q, k, v):
    heads_major = lambda a: jnp.swapaxes(a, 1, 2)
    return heads_major(native.op(impl, heads_major(q), heads_major(k), heads_major(v)))
  return dataclasses.replace(case, op=op)


def _program(case: Case, impl: str):
  """The forward, or the forward and backward as the GPU suites time them (bench/harness.py
  ``Timed``): the output written, and the float arguments' gradients for a cotangent given,
  with an optimization barrier between the halves. The forward's outputs and residuals reach
  HBM before the backward starts, as in a training step, where the rest of the network runs in
  between; without the barrier XLA fuses the forward into the backward and reads the inputs
  once for both (a glu or bias+gelu then 0.75-0.8x "XLA" on v5e, notes/attn.md tpu-inplace-1),
  which no step allows."""
  if not case.grad:
    return lambda *args: case.op(impl, *args)
  floats = [i for i, (_, dtype) in enumerate(case.arrays)
            if jnp.issubdtype(dtype, jnp.floating)]

  def fwd_bwd(ct, *args):
    def f(*wrt):
      full = list(args)
      for i, a in zip(floats, wrt):
        full[i] = a
      return case.op(impl, *full)
    out, vjp = jax.vjp(f, *(args[i] for i in floats))
    out, vjp = jax.lax.optimization_barrier((out, vjp))
    return out, vjp(ct)
  return fwd_bwd


def _compiled(case: Case, impl: str, mesh):
  """``case``'s program (:func:`_program`) compiled for ``mesh``'s chip."""
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))
          for shape, dtype in case.arrays]
  if case.grad:  # the cotangent: shaped and typed as the output
    out = jax.eval_shape(lambda *a: case.op("xla", *a), *args)
    args.insert(0, jax.ShapeDtypeStruct(out.shape, out.dtype,
                                        sharding=NamedSharding(mesh, P())))
  with jax.set_mesh(mesh):
    return jax.jit(_program(case, impl)).lower(*args).compile()


def _cost(compiled) -> tuple[float, float]:
  """(FLOPs, bytes accessed) of a compiled program, by its cost analysis."""
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, list) else cost) or {}
  return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


SPLASH = ("jax_splash_tpu", "jax_splash_maxtext")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
                "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*?)\)")


def _type_bytes(text: str) -> int:
  """Bytes of an HLO type (an array or a tuple of them)."""
  total = 0
  for dtype, dims in _ARRAY.findall(text):
    total += _DTYPE_BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
  return total


def _passes_around_kernels(compiled) -> float:
  """HBM bytes of the XLA passes in a compiled program's entry computation (its fusions,
  copies and transposes: each reads its operands and writes its output once), the kernels'
  custom calls left out: what a program moves around its kernels (layout transposes, q's
  scale, the backward's delta). The kernels' own traffic is the block model's."""
  text = compiled.as_text()
  entry = text[text.index("ENTRY"):]
  # The computation ends after its ROOT line; a kernel's backend config may hold newlines and
  # braces of its own, so the first "}" line is not the end.
  root = entry.index("\n  ROOT ")
  entry = entry[:entry.index("\n}", entry.index("\n", root + 1) - 1)]
  sizes, moved = {}, 0
  for line in entry.splitlines()[1:]:
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    name, result, opcode, operands = m.groups()
    sizes[name] = _type_bytes(result)
    if opcode in ("fusion", "copy", "transpose"):
      moved += sizes[name] + sum(sizes.get(o, 0) for o in re.findall(r"%([\w.\-]+)", operands))
  return float(moved)


def _our_config(case: Case, chip: hardware.Chip):
  """Our Mosaic TPU attention's config for the case on ``chip``: its heuristic's (no TPU has
  tuned a table)."""
  from jaxkernels.ops.attention import api, mosaic_tpu
  from jaxkernels.ops.attention.common import Window
  (b, t, n, h), (_, s, kv_heads, _) = case.arrays[0][0], case.arrays[1][0]
  problem = api.Problem(batch=b, q_len=t, kv_len=s, heads=n, kv_heads=kv_heads, head_dim=h,
                        dtype=jnp.dtype(jnp.bfloat16), window=Window.of(_causal(case), None),
                        soft_cap=False, bias=None, segments=False)
  return mosaic_tpu.heuristic(problem, chip)


def predict(case: Case, impl: str, mesh, chip: hardware.Chip) -> dict:
  """One compiled program's standard result row, its time predicted."""
  row = dict(suite=case.suite, name=case.name, impl=impl, shape=case.shape, dtype="bfloat16",
             ms=None, gbps=None, tflops=None, pct_roofline=None, error=None, tolerance=None,
             config=None, note="")
  try:
    compiled = _compiled(case, impl, mesh)
    flops, moved = _cost(compiled)
  except Exception as e:  # noqa: BLE001 - a row says what failed; the others go on
    row["note"] = f"FAILED to compile: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return row
  counted = "the compiled program's cost analysis"
  if case.suite == "attention" and impl != "xla":
    # Every attention kernel, ours and the anchors alike, by one model. FLOPs: one count of
    # its products (roofline.attention_flops), the mask's skipped blocks left out (JAX's
    # example states the unmasked count for a causal call whose masked blocks it skips; splash
    # states none). Bytes: the kernels' block traffic (roofline.attention_traffic at each
    # kernel's blocks: k and v re-read for every query block they meet, causal blocks
    # skipped), which the compiler cannot see inside a custom call, plus every XLA pass around
    # the kernels in the compiled program (layout transposes, q's scale, the backward's
    # delta), each one read of its operands and one write of its output
    # (:func:`_passes_around_kernels`). The compiler's own totals count those passes
    # inconsistently from one program to another (ours' transposes at twice MaxText's same
    # transposes), so neither total is used.
    (b, t, n, h), (_, _, kv_heads, _) = case.arrays[0][0], case.arrays[1][0]
    if impl in ("jax_pallas_tpu", "jax_splash_tpu"):
      (b, n, t, h), (_, kv_heads, _, _) = case.arrays[0][0], case.arrays[1][0]
    causal = _causal(case)
    flops = roofline.attention_flops(b, t, t, n, h, causal=causal, backward=case.grad)
    shared_kv = False
    if impl == "jax_pallas_tpu":
      blocks = (128,) * 4
    elif impl in SPLASH:
      blocks = (SPLASH_BLOCK,) * 4
    else:
      config = _our_config(case, chip)
      blocks = config.block_q, config.block_k, config.bwd_block_q, config.bwd_block_k
      shared_kv = config.in_place  # a step takes every head: k and v read once a GQA group
    fwd_q, fwd_k, bwd_q, bwd_k = blocks
    visits = roofline.attention_block_visits(t, t, fwd_q, fwd_k, causal=causal)
    moved = roofline.attention_traffic(b, t, t, n, kv_heads, h, visits=visits, block_q=fwd_q,
                                       block_k=fwd_k, shared_kv=shared_kv)["fwd"]
    if case.grad:
      visits = roofline.attention_block_visits(t, t, bwd_q, bwd_k, causal=causal)
      by = roofline.attention_traffic(b, t, t, n, kv_heads, h, visits=visits, block_q=bwd_q,
                                      block_k=bwd_k, shared_kv=shared_kv)
      moved += by["dkdv"] + by["dq"]
    around = _passes_around_kernels(compiled)
    moved += around
    whose = {"jax_pallas_tpu": "the example's", "mosaic_tpu": "our"}.get(impl, "MaxText's")
    counted = (f"our FLOP count (roofline.attention_flops), the block-traffic model at {whose} "
               f"blocks ({fwd_q} x {fwd_k} forward, {bwd_q} x {bwd_k} backward) and "
               f"{around / 1e6:.0f} MB of XLA passes around the kernels")
  compute_s, memory_s = flops / chip.flops("bfloat16"), moved / chip.hbm_bandwidth
  seconds = max(compute_s, memory_s)
  memory = compiled.memory_analysis()
  hbm = (memory.argument_size_in_bytes + memory.output_size_in_bytes
         + memory.temp_size_in_bytes)
  bound = "compute" if compute_s >= memory_s else "memory"
  row.update(ms=seconds * 1e3, pct_roofline=None,
             note=(f"predicted, not measured: {flops / 1e9:.1f} GFLOP and {moved / 1e6:.0f} MB "
                   f"from {counted}, {bound}-bound at the "
                   f"datasheet peaks; HBM {hbm / 2**20:.0f} MiB (arguments, outputs, "
                   "temporaries)"))
  if case.suite in ("matmul", "attention"):
    row["tflops"] = flops / seconds / 1e12
  else:
    row["gbps"] = moved / seconds / 1e9
  return row


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m bench.tpu_predicted", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--chips", default=",".join(hardware.TPU_TOPOLOGIES),
                      help="TPU generations (default: %(default)s)")
  parser.add_argument("--only", default=None,
                      help="cases whose name contains one of these (comma-separated)")
  parser.add_argument("--out", default=str(ROOT.parent / "results" / "tpu_compiled"))
  args = parser.parse_args(argv)
  from jax.experimental import topologies
  stamp = datetime.datetime.now(datetime.timezone.utc)
  only = args.only.split(",") if args.only else None
  cases = [c for c in _cases() if only is None or any(o in c.name for o in only)]
  for generation in args.chips.split(","):
    if generation not in hardware.TPU_TOPOLOGIES:
      parser.error(f"--chips: {generation!r} is not one of {', '.join(hardware.TPU_TOPOLOGIES)}")
    topology = topologies.get_topology_desc(platform="tpu",
                                            topology_name=hardware.TPU_TOPOLOGIES[generation])
    device = topology.devices[0]
    chip = hardware.chip_for(device.device_kind)
    mesh = jax.sharding.Mesh(np.array([device]), ("chip",), axis_types=(AxisType.Explicit,))
    rows = []
    for case in cases:
      anchors = (("xla", case), ("jax_pallas_tpu", None), ("jax_splash_tpu", None),
                 ("jax_splash_maxtext", None))
      for impl, anchor_case in (("mosaic_tpu", case), *anchors):
        if impl in ("jax_pallas_tpu", *SPLASH):
          if case.suite != "attention":
            continue
          if impl == "jax_pallas_tpu" and case.arrays[0][0][2] != case.arrays[1][0][2]:
            continue  # the example takes as many kv heads as query heads
          anchor_case = {"jax_pallas_tpu": _jax_pallas_tpu, "jax_splash_tpu": _splash,
                         "jax_splash_maxtext": _splash_maxtext}[impl](case)
        row = predict(anchor_case, impl, mesh, chip)
        rows.append(row)
        shown = "" if row["ms"] is None else f"{row['ms']:.3f} ms"
        print(f"{chip.name:8s} {case.name:32s} {impl:10s} {shown:>11s}  {row['note'][:70]}",
              flush=True)
    record = dict(date=stamp.isoformat(timespec="seconds"),
                  command="python -m bench.tpu_predicted " + " ".join(argv or sys.argv[1:]),
                  commit=harness.git_commit(), device=f"{chip.name} (predicted)", platform="tpu",
                  jax=jax.__version__,
                  jaxlib=getattr(jax.lib, "__version__", None) or jax.__version__, smoke=False, interpret_mode=False,
                  timing=("ms: predicted, not measured: max(FLOPs / dense bf16 peak, bytes / "
                          "HBM bandwidth) of the AOT-compiled program (cost analysis)"),
                  suites=sorted({c.suite for c in cases}), rows=rows)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stamp:%Y-%m-%dT%H%M%S}_ops_predicted_{generation}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"-> {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
