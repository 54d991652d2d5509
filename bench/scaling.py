"""The train step on 1, 2, 4 and 8 devices (as many as this host has), and ring attention.

``python -m bench scaling``. For each layout of ``models.train``'s mesh (data parallel, fsdp,
fsdp x tensor) at the same batch a device (the model suite's: 4 x 2048 for the 1b), on our
kernels and on plain JAX (kernels="xla": XLA's ops, cuDNN attention) on the same mesh: tokens/s,
MFU (PaLM's count over the devices' dense bf16 peak), the scaling efficiency against the same
kernels on one device (tokens/s over n times one device's), and each device's memory, measured
(the allocator's peak, the largest over the devices) beside the compiled program's. Each
measurement runs in a process of its own (its peak its own, an out-of-memory its own). On a GPU
each layout's steps are then traced (``jax.profiler``) and its streams' kernels read back: a
step's compute time, its collectives' (NCCL's kernels) and how much of that ran while compute
did (``overlap``).

Ring attention (``flash_attention`` with the sequence split, causal, zig-zag) at T = 64K and
128K on n devices against one device's flash attention, and against cuDNN on a
sequence-gathered layout (the heads split instead: q, k and v moved from a sequence split to a
heads split and back, all-to-alls, with cuDNN on each device's heads), forward and backward.
"""

from __future__ import annotations

import math
import pathlib
import re
import tempfile
import time

import jax

from bench import harness

PRESET, BATCH, SEQ = "1b", 4, 2048  # a device's batch: the model suite's 1b row
LAYOUTS = {  # name: mesh sizes on n devices
    "data": lambda n: {"data": n, "fsdp": 1},
    "fsdp": lambda n: {"fsdp": n},
    "fsdp x tensor": lambda n: {"fsdp": n // 2, "tensor": 2},
}
RING = {"heads": 16, "kv_heads": 4, "head_dim": 128}  # the 1b's attention
RING_LENGTHS = (64 * 1024, 128 * 1024)


def _timed(fn, *args, calls: int = 5, rounds: int = 3) -> float:
  """Median seconds a call over ``rounds`` rounds of ``calls``."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls)
  return sorted(times)[len(times) // 2]


def _peak(devices) -> int | None:
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
  return max(peaks) if all(p is not None for p in peaks) else None


# A collective's kernel: NCCL's (ncclDevKernel_AllReduce_..., ncclKernel_SendRecv...) and XLA's
# own collective kernels.
COLLECTIVE = re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|"
                        r"collective_?permute", re.IGNORECASE)


def _merged(spans) -> list[list[int]]:
  """``spans`` ((start, end), ...) as sorted disjoint spans."""
  out: list[list[int]] = []
  for start, end in sorted(spans):
    if out and start <= out[-1][1]:
      out[-1][1] = max(out[-1][1], end)
    else:
      out.append([start, end])
  return out


def _length(spans) -> int:
  return sum(end - start for start, end in spans)


def _common(a, b) -> int:
  """The time two lists of sorted disjoint spans share."""
  i = j = total = 0
  while i < len(a) and j < len(b):
    total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
    if a[i][1] < b[j][1]:
      i += 1
    else:
      j += 1
  return total


def overlap(planes, steps: int) -> dict:
  """What a step's kernels did on each GPU, from a profile's planes (``ProfileData.planes``):
  milliseconds a step of compute (the union of every other kernel's time), of collectives (the
  union of COLLECTIVE kernels' time) and of collective time that compute ran beside; each the
  mean over the devices that ran kernels (the profiler traces every GPU of the host), with the
  largest exposed (collective, not overlapped) time and the collectives' kernels by time. A
  collective kernel's time includes its wait for the slowest peer: it bounds the transfer's own
  time from above. Memory copies count as neither."""
  devices, by_name = [], {}
  for plane in planes:
    if not plane.name.startswith("/device:GPU:"):
      continue
    compute, collective = [], []
    for line in plane.lines:
      if not line.name.startswith("Stream"):  # the derived lines (XLA Ops, Steps...) repeat them
        continue
      for event in line.events:
        span = (event.start_ns, event.start_ns + event.duration_ns)
        if COLLECTIVE.search(event.name):
          collective.append(span)
          name = event.name.split("(")[0]
          by_name[name] = by_name.get(name, 0) + event.duration_ns
        elif not event.name.startswith(("Memcpy", "Memset")):
          compute.append(span)
    if not compute and not collective:
      continue  # a GPU of the host that the program does not use
    compute, collective = _merged(compute), _merged(collective)
    devices.append((_length(compute), _length(collective), _common(compute, collective)))
  if not devices or not any(c for c, _, _ in devices):
    raise ValueError("the profile holds no GPU stream's kernels (planes: "
                     f"{sorted({p.name for p in planes})[:8]})")
  per_step = lambda ns: ns / 1e6 / steps / len(devices)
  compute, collective, common = (per_step(sum(d[i] for d in devices)) for i in range(3))
  return {"compute_ms": compute, "collective_ms": collective, "overlapped_ms": common,
          "exposed_ms": collective - common,
          "exposed_ms_max": max(c - o for _, c, o in devices) / 1e6 / steps,
          "overlapped": common / collective if collective else None,
          "collectives": {name: per_step(ns) for name, ns in
                          sorted(by_name.items(), key=lambda kv: -kv[1])[:6]}}


def _profiled(compiled, state, tokens, steps: int = 2):
  """``overlap`` of ``steps`` steps, and the state after them."""
  with tempfile.TemporaryDirectory() as where:
    jax.block_until_ready(state)
    with jax.profiler.trace(where):
      for _ in range(steps):
        state, metrics = compiled(state, tokens)
      jax.block_until_ready(metrics)
    (path,) = pathlib.Path(where).glob("**/*.xplane.pb")
    data = jax.profiler.ProfileData.from_serialized_xspace(path.read_bytes())
    return overlap(list(data.planes), steps), state


def measure_step(preset: str, kernels: str, sizes: dict, batch: int, seq: int,
                 steps: int) -> dict:
  """The train step on the first prod(sizes) devices, laid out by ``sizes``; on a GPU, the
  profile of two more steps (``overlap``)."""
  from jaxkernels import remat
  from models import batches, hparams, llama, loop, placement, train_step
  n = math.prod(sizes.values())
  devices = jax.devices()[:n]
  where = placement.mesh(devices=devices, **{"data": 1, **sizes})
  cfg = llama.preset(preset, kernels=kernels)
  tc = hparams.TrainConfig(batch=batch * sizes.get("data", 1) * sizes.get("fsdp", 1), seq_len=seq,
                         steps=10_000, warmup=10)
  graphdef, state = train_step.init(cfg, tc, where)
  step = train_step.step_fn(graphdef)
  data, _ = batches.corpus()
  tokens = batches.shard_batch(batches.batch_at(data, 0, tc), where)
  with jax.set_mesh(where):
    start = time.perf_counter()
    compiled = step.lower(state, tokens).compile()
    compile_s = time.perf_counter() - start
    first = None
    for _ in range(3):
      state, metrics = compiled(state, tokens)
      first = float(metrics["loss"]) if first is None else first
    times = []
    for _ in range(3):
      start = time.perf_counter()
      for _ in range(steps):
        state, metrics = compiled(state, tokens)
      jax.block_until_ready(metrics)
      times.append((time.perf_counter() - start) / steps)
    peak = _peak(devices)
    profile = None
    if devices[0].platform == "gpu":
      try:
        profile, state = _profiled(compiled, state, tokens)
      except Exception as e:  # a profile missing is said, the step's numbers stand
        profile = {"error": f"{type(e).__name__}: {e}"[:300]}
  seconds = sorted(times)[1]
  rate = tc.batch * seq / seconds
  peak_flops = loop.peak_flops(devices)
  return {"profile": profile, "ms": seconds * 1e3, "tokens_per_s": rate, "first_loss": first,
          "mfu": llama.mfu(cfg, rate, seq, peak_flops) if peak_flops else None,
          "peak_bytes": peak, "compiled_bytes": remat.compiled_peak_bytes(compiled),
          "compile_s": compile_s, "devices": n, "batch": tc.batch}


def measure_ring(length: int, n: int, how: str) -> dict:
  """Causal attention fwd+bwd at ``length`` on n devices: ``how`` "ring" (ours, the sequence
  split, zig-zag), "one" (ours on one device), "cudnn heads" (cuDNN on a heads split, the
  sequence gathered by all-to-alls)."""
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

  import jaxkernels as jk
  from jaxkernels import remat
  h, heads, kv = RING["head_dim"], RING["heads"], RING["kv_heads"]
  devices = jax.devices()[:n]
  mesh = jax.make_mesh((n,), ("sequence",), axis_types=(AxisType.Explicit,), devices=devices)
  keys = jax.random.split(jax.random.key(0), 4)
  shapes = ((1, length, heads, h), (1, length, kv, h), (1, length, kv, h), (1, length, heads, h))
  split = NamedSharding(mesh, P(None, "sequence"))
  base = [np.asarray(jax.random.normal(key, s, jnp.bfloat16)) for key, s in zip(keys, shapes)]
  # The positions' order: the zig-zag's for the ring.
  order = jk.zigzag(length, n) if how == "ring" else np.arange(length)
  q, k, v, ct = (jax.device_put(x[:, order], split) for x in base)

  if how == "cudnn heads":
    def attend(q, k, v):
      by_heads = lambda x: jax.sharding.reshard(x, P(None, None, "sequence", None))
      out = jax.nn.dot_product_attention(by_heads(q), by_heads(k), by_heads(v), is_causal=True,
                                         implementation="cudnn")
      return jax.sharding.reshard(out, P(None, "sequence", None, None))
  else:
    layout = "zigzag" if how == "ring" else "contiguous"

    def attend(q, k, v):
      return jk.flash_attention(q, k, v, causal=True, sequence_layout=layout)

  def fwd_bwd(q, k, v, ct):
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(ct)

  with jax.set_mesh(mesh):
    step = jax.jit(fwd_bwd)
    compiled = step.lower(q, k, v, ct).compile()
    seconds = _timed(compiled, q, k, v, ct)
    got = jax.device_get(compiled(q, k, v, ct))
  flops = 4 * length * length * heads * h * 3.5 / 2  # fwd 2 products, bwd 5; causal half
  result = {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12,
            "peak_bytes": _peak(devices), "compiled_bytes": remat.compiled_peak_bytes(compiled)}
  if n > 1:  # against our one-device flash attention on the same positions' inputs
    undo = np.argsort(order)
    whole = [jax.device_put(x, devices[0]) for x in base]
    want = jax.device_get(jax.jit(lambda q, k, v, ct: jax.vjp(
        lambda q, k, v: jk.flash_attention(q, k, v, causal=True), q, k, v)[1](ct) + (
        jk.flash_attention(q, k, v, causal=True),))(*whole))
    got = (*got[1], got[0])
    errors = [float(np.max(np.abs(np.asarray(g, np.float32)[:, undo] -
                                  np.asarray(w, np.float32))) /
                    float(np.max(np.abs(np.asarray(w, np.float32)))))
              for g, w in zip(got, want)]
    result["max_error"] = max(errors)
  return result


def _child(function: str, args: dict, timeout: float = 300) -> dict:
  """``function(**args)`` of this module in a process of its own."""
  return harness.child("scaling", function, args, timeout)


def _gib(n) -> str:
  return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def _profile_note(profile: dict | None) -> str:
  if not profile:
    return ""
  if "error" in profile:
    return f"; no profile: {profile['error']}"
  note = (f"; profile, a step a device: compute {profile['compute_ms']:.1f} ms, collectives "
          f"{profile['collective_ms']:.1f} ms")
  if profile["collective_ms"]:
    note += (f", {100 * profile['overlapped']:.0f}% of it beside compute (exposed "
             f"{profile['exposed_ms']:.1f} ms, {profile['exposed_ms_max']:.1f} on the worst "
             "device); by kernel: " + ", ".join(
                 f"{name} {ms:.1f}" for name, ms in list(profile["collectives"].items())[:3]))
  return note


def run(session: harness.Session, only=None) -> None:
  """``only``: "steps" (the train step's layouts), "ring" (ring attention), either or both
  (None: both), and device counts ("1", "4": only those; default every count up to the
  host's)."""
  available = len(jax.devices())
  picked = {int(x) for x in only or () if x.isdigit()}
  only = [x for x in only or () if not x.isdigit()] or None
  counts = [n for n in (1, 2, 4, 8) if n <= available and (not picked or n in picked)]
  preset, batch, seq, steps = (("tiny", 2, 128, 2) if session.smoke else (PRESET, BATCH, SEQ, 5))
  one: dict[str, float] = {}
  for n in counts if only is None or "steps" in only else ():
    for name, sizes_of in LAYOUTS.items():
      if n == 1 and name != "fsdp" or (name == "fsdp x tensor" and n < 2):
        continue  # one device: one layout
      for kernels in ("jaxkernels", "xla"):  # side by side: the same machine's minute
        sizes = sizes_of(n)
        got = _child("measure_step", {"preset": preset, "kernels": kernels, "sizes": sizes,
                                      "batch": batch, "seq": seq, "steps": steps})
        layout = " x ".join(f"{a} {s}" for a, s in sizes.items() if s > 1) or "one device"
        row = harness.Row("scaling", f"{preset} train step on {n} devices", f"{kernels}, "
                          f"{layout}", f"batch {batch} x {seq} a device", "bfloat16")
        if "error" in got:
          row.note = f"FAILED: {got['error']}"
          session.add(row)
          continue
        row.ms, row.pct_roofline = got["ms"], got["mfu"]
        if n == 1:
          one[kernels] = got["tokens_per_s"]
        efficiency = (got["tokens_per_s"] / (n * one[kernels]) if kernels in one else None)
        row.note = (f"{got['tokens_per_s']:.0f} tokens/s"
                    + (f", scaling {efficiency:.3f} of linear" if efficiency else "")
                    + f"; memory a device {_gib(got['peak_bytes'])} measured, "
                    f"{_gib(got['compiled_bytes'])} compiled; first step's loss "
                    f"{got['first_loss']:.4f}; compile {got['compile_s']:.0f} s"
                    + _profile_note(got.get("profile")))
        session.add(row)
  lengths = (4096,) if session.smoke else RING_LENGTHS
  for length in lengths if only is None or "ring" in only else ():
    cases = [(1, "one")] + [(n, how) for n in counts if n > 1 for how in ("ring", "cudnn heads")]
    for n, how in cases:
      got = _child("measure_ring", {"length": length, "n": n, "how": how})
      row = harness.Row("scaling", f"causal attention fwd+bwd, T {length // 1024}K",
                        {"one": "jaxkernels, one device", "ring": f"jaxkernels ring, {n} devices",
                         "cudnn heads": f"cudnn, heads split, {n} devices"}[how],
                        f"1 x {length} x {RING['heads']}/{RING['kv_heads']} x "
                        f"{RING['head_dim']}", "bfloat16")
      if "error" in got:
        row.note = f"FAILED: {got['error']}"
      else:
        row.ms, row.tflops, row.error = got["ms"], got["tflops"], got.get("max_error")
        row.note = (f"memory a device {_gib(got['peak_bytes'])} measured, "
                    f"{_gib(got['compiled_bytes'])} compiled" + (
                        "; error: the largest of out's, dq's, dk's and dv's max |difference| "
                        "over max |one device's flash attention| on the same inputs"
                        if "max_error" in got else ""))
      session.add(row)
