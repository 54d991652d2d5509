"""attention: flash_attention forward and forward+backward, against cuDNN, XLA, JAX's own Pallas
attention example and torch SDPA, measured in the same run.

TFLOP/s count 4 B N T S H for the forward and 3.5 times that for forward+backward, halved when
causal (the issue's convention); rows with a window or segments count the same FLOPs as their
shape without them (an effective rate: their point is the time against the plain row). Each
kernel row is checked before it is timed by the numerics rule (jaxkernels.testing: error against
the float64 reference <= twice the bfloat16 reference's), except at 32K, where the reference does
not fit.

The bias rows give every implementation the same (1, N, T, S) bias. cuDNN's backward computes
the bias's gradient in the same call whether or not it is asked for; ours computes it in its
own kernel, which XLA drops where it is not ("bias": the gradients of q, k and v, as where a
mask is given as a bias; "bias with d(bias)": the bias's as well).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import jaxkernels as jk
from bench import harness, shapes
from jaxkernels.ops.attention import reference
from jaxkernels.ops.attention.common import Window


Shape = shapes.Attention


def _inputs(shape: Shape, seed: int):
  key = jax.random.split(jax.random.key(seed), 4)
  b, t, n, kv, h = shape.batch, shape.length, shape.heads, shape.kv_heads, shape.head_dim
  q = jax.random.normal(key[0], (b, t, n, h), jnp.bfloat16)
  k = jax.random.normal(key[1], (b, t, kv, h), jnp.bfloat16)
  v = jax.random.normal(key[2], (b, t, kv, h), jnp.bfloat16)
  do = jax.random.normal(key[3], (b, t, n, h), jnp.bfloat16)
  if shape.bias:
    bias = jax.random.normal(jax.random.fold_in(key[3], 1), (1, n, t, t), jnp.bfloat16)
    return (q, k, v, bias), do
  return (q, k, v), do


def _segment_ids(shape: Shape):
  if not shape.segments:
    return None
  ids = np.repeat(np.arange(shape.segments), -(-shape.length // shape.segments))[:shape.length]
  return jnp.asarray(np.broadcast_to(ids, (shape.batch, shape.length)), jnp.int32)


def _ours(shape: Shape, implementation: str, config=None):
  seg = _segment_ids(shape)
  return lambda q, k, v, bias=None: jk.flash_attention(
      q, k, v, bias=bias, causal=shape.causal, local_window_size=shape.window, segment_ids=seg,
      logits_soft_cap=shape.soft_cap, implementation=implementation, config=config)


def _unserved(shape: Shape, implementation: str, inputs) -> str:
  """Why ``implementation`` cannot serve ``shape`` ("" where it can)."""
  q, k, v, *bias = inputs[0]
  support = jk.supports("flash_attention", implementation, q, k, v, bias=(bias or [None])[0],
                        causal=shape.causal, local_window_size=shape.window,
                        segment_ids=_segment_ids(shape), logits_soft_cap=shape.soft_cap)
  return "" if support else support.reason


def _reference(shape: Shape, compute_dtype):
  seg = _segment_ids(shape)
  h = shape.head_dim

  def fn(q, k, v, bias=None):
    return reference.attention(q, k, v, bias=bias, q_segments=seg, kv_segments=seg,
                               window=Window.of(shape.causal, shape.window), scale=h**-0.5,
                               soft_cap=shape.soft_cap, compute_dtype=compute_dtype)
  return fn


def _jax_nn(shape: Shape, implementation: str):
  return lambda q, k, v, bias=None: jax.nn.dot_product_attention(
      q, k, v, bias=bias, is_causal=shape.causal, local_window_size=shape.window,
      implementation=implementation)


def _jax_pallas_example(shape: Shape):
  from jax.experimental.pallas.ops.gpu import attention as example
  if shape.kv_heads != shape.heads:
    raise NotImplementedError("JAX's Pallas example has no grouped-query attention")
  return lambda q, k, v: example.mha(q, k, v, segment_ids=None, causal=shape.causal)


def _jax_pallas_mgpu(shape: Shape):
  """JAX's own Mosaic GPU attention (FlashAttention-3's schedule), its example's blocks."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu as example
  config = example.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2,
                                causal=shape.causal, block_q_dkv=64, block_kv_dkv=64,
                                block_q_dq=64, block_kv_dq=64)
  return lambda q, k, v: example.attention(q, k, v, config)


def _jax_anchors(shape: Shape) -> dict:
  if not shape.anchors or shape.segments or shape.soft_cap:
    return {}
  out = {"xla": _jax_nn(shape, "xla"), "cudnn": _jax_nn(shape, "cudnn")}
  if shape.window is None and shape.bias is None:  # neither example takes a bias
    for name, make in (("jax_pallas_triton", _jax_pallas_example),
                       ("jax_pallas_mgpu", _jax_pallas_mgpu)):
      try:
        out[name] = make(shape)
      except (ImportError, NotImplementedError, AttributeError, TypeError):
        pass
  return out


def _torch_seconds(shape: Shape, label: str, session) -> float:
  """torch SDPA (its best backend: FlashAttention-2 on sm80+), CUDA events, median of rounds."""
  import torch
  import torch.nn.functional as F

  if not torch.cuda.is_available():
    raise ImportError("torch sees no CUDA device")
  b, t, n, kv, h = shape.batch, shape.length, shape.heads, shape.kv_heads, shape.head_dim
  make = lambda heads: torch.randn(b, heads, t, h, dtype=torch.bfloat16, device="cuda",
                                   requires_grad=label == "fwd+bwd")
  q, k, v = make(n), make(kv), make(kv)
  do = torch.randn(b, n, t, h, dtype=torch.bfloat16, device="cuda")
  kw = {"enable_gqa": True} if kv != n else {}

  def step():
    out = F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, **kw)
    if label == "fwd+bwd":
      torch.autograd.grad(out, (q, k, v), do)

  for _ in range(3):
    step()
  torch.cuda.synchronize()
  times = []
  for _ in range(session.rounds):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(session.calls):
      step()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / 1e3 / session.calls)
  return statistics.median(times)


def _sweep_configs(shape: Shape, label: str):
  """Candidate Triton configs around the heuristic's: forward blocks for "fwd", backward
  blocks for "fwd+bwd"."""
  from jaxkernels.ops.attention import triton
  from jaxkernels.ops.attention.api import Problem
  problem = Problem(shape.batch, shape.length, shape.length, shape.heads, shape.kv_heads,
                    shape.head_dim, jnp.dtype(jnp.bfloat16), Window.of(shape.causal, shape.window),
                    shape.soft_cap is not None, None, bool(shape.segments))
  base = triton.heuristic(problem, None)
  if shape.head_dim > 128:
    if label == "fwd":
      grid = [(64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2), (128, 64, 8, 1), (64, 64, 4, 1)]
      return [dataclasses.replace(base, block_q=a, block_k=b, num_warps=w, num_stages=st)
              for a, b, w, st in grid]
    grid = [(32, 32, 4, 2), (32, 32, 8, 1), (64, 32, 4, 2), (32, 64, 8, 2), (16, 64, 4, 2)]
    return [dataclasses.replace(base, bwd_block_q=a, bwd_block_k=b, bwd_num_warps=w,
                                bwd_num_stages=st) for a, b, w, st in grid]
  if label == "fwd":
    grid = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 4),
            (64, 128, 4, 2)]
    return [dataclasses.replace(base, block_q=a, block_k=b, num_warps=w, num_stages=st)
            for a, b, w, st in grid]
  grid = [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 2), (64, 128, 4, 2), (32, 128, 4, 2),
          (128, 64, 4, 2), (64, 32, 4, 2)]
  return [dataclasses.replace(base, bwd_block_q=a, bwd_block_k=b, bwd_num_warps=w,
                              bwd_num_stages=st) for a, b, w, st in grid]


def _decode(session, only, sweep) -> None:
  """decode_attention, B=8 S=32768 N=32 K=8 H=128 bf16, one query: GB/s over the cache bytes
  read (k and v up to each sequence's length), against XLA, cuDNN and JAX's Pallas decode
  example on the same call; full caches, and lengths drawn from [1, S]."""
  import contextlib
  context = jk.interpret_mode if session.interpret else contextlib.nullcontext
  b, s, n, kv, h = shapes.SMOKE_DECODE if session.smoke else shapes.DECODE
  for name, full in (("decode full cache", True), ("decode ragged lengths", False)):
    if only and name not in only:
      continue
    key = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(key[0], (b, 1, n, h), jnp.bfloat16)
    k = jax.random.normal(key[1], (b, s, kv, h), jnp.bfloat16)
    v = jax.random.normal(key[2], (b, s, kv, h), jnp.bfloat16)
    lengths = (jnp.full((b,), s, jnp.int32) if full else
               jax.random.randint(key[3], (b,), 1, s + 1, jnp.int32))
    cache_bytes = 2 * int(jnp.sum(lengths)) * kv * h * 2
    rule = harness.Rule(lambda cd: functools.partial(reference.decode, scale=h ** -0.5,
                                                     compute_dtype=cd),
                        (q, k, v, lengths), dtype=jnp.bfloat16, reduction=s)
    impls = {impl: lambda q, k, v, n_, impl=impl: jk.decode_attention(
        q, k, v, lengths=n_, implementation=impl)
        for impl in session.kernels("decode_attention")}  # on a GPU, each side by side
    if sweep and session.platform == "gpu":
      from jaxkernels.ops.attention import triton_decode
      for bk, splits, warps, stages in ((64, 8, 4, 3), (128, 8, 4, 4), (128, 4, 4, 3),
                                        (128, 16, 4, 3), (256, 8, 8, 3), (64, 16, 4, 4),
                                        (128, 8, 8, 2)):
        config = triton_decode.Config(block_k=bk, splits=splits, num_warps=warps,
                                      num_stages=stages)
        impls[f"{session.kernel} {config}"] = functools.partial(
            lambda q, k, v, n_, config: jk.decode_attention(
                q, k, v, lengths=n_, implementation=session.kernel, config=config),
            config=config)
    if session.platform == "gpu" and session.anchors:
      impls["xla"] = lambda q, k, v, n_: jax.nn.dot_product_attention(
          q, k, v, key_value_seq_lengths=n_, implementation="xla")
      impls["cudnn"] = lambda q, k, v, n_: jax.nn.dot_product_attention(
          q, k, v, key_value_seq_lengths=n_, implementation="cudnn")
      try:
        from jax.experimental.pallas.ops.gpu import decode_attention as example
        impls["jax_pallas_triton"] = lambda q, k, v, n_: example.gqa(
            q[:, 0], k, v, kv_seq_len=n_)[:, None]
      except ImportError:
        pass
    rows = {}
    for impl, fn in impls.items():
      row = harness.Row("attention", name, impl, f"{b}x{s}x{n}/{kv}x{h}", "bfloat16")
      try:
        with context():
          program = jax.jit(fn)
          row.error, row.tolerance = rule.verdict("fwd", program(q, k, v, lengths))
          if not row.error <= row.tolerance:
            row.note = (f"WRONG: error {row.error:.2e} > tolerance {row.tolerance:.2e}; "
                        "not timed")
            rows[impl] = session.add(row)
            continue
          seconds, whole = harness.time_sets_rounds(program, [(q, k, v, lengths)],
                                                    rounds=session.rounds, calls=session.calls,
                                                    warmup=session.warmup)
          row.round_ms = whole * 1e3
        row.ms, row.gbps = seconds * 1e3, cache_bytes / seconds / 1e9
      except Exception as e:  # noqa: BLE001
        row.note = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
      rows[impl] = session.add(row)
    xla = rows.get("xla")
    for row in rows.values():
      if xla is not None and row.ms and xla.ms:
        row.vs_xla = xla.ms / row.ms


def _kernels(session: harness.Session) -> list[str]:
  """Our kernels on this device: Mosaic GPU and Triton on Hopper."""
  hopper = session.chip is not None and session.chip.compute_capability == (9, 0)
  return ["mosaic_gpu", session.kernel] if hopper else [session.kernel]


def run(session: harness.Session, sweep: bool = False, only=None) -> None:
  _decode(session, only, sweep)
  import contextlib
  context = jk.interpret_mode if session.interpret else contextlib.nullcontext
  every = shapes.attention(session.smoke)
  # Interpreted (make bench on a CPU): the shape with every mask feature, a check that the
  # kernels run and match; the tests hold the others, and a GPU times them all.
  for shape in every[-1:] if session.interpret else every:
    if only and shape.name not in only:
      continue
    first = _inputs(shape, 0)
    n_sets = harness.sets_for(
        session, 4 * sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(first)),
        budget=4 << 30, most=4)
    sets = [first] + [_inputs(shape, seed) for seed in range(1, n_sets)]
    # The float64 oracle and the bfloat16 reference's error, forward and backward, once.
    rule = harness.Rule(lambda cd: _reference(shape, cd), *first, dtype=jnp.bfloat16,
                        reduction=max(shape.length, shape.head_dim),
                        grads=shape.grads) if shape.check else None
    # Interpreted, a check: forward+backward checks the output and every gradient at once.
    for label in ("fwd+bwd",) if session.interpret else ("fwd", "fwd+bwd"):
      impls = {kernel: (_ours(shape, kernel), True) for kernel in _kernels(session)}
      unserved = ({kernel: _unserved(shape, kernel, first) for kernel in impls}
                  if session.platform == "gpu" else {})
      if sweep and session.platform == "gpu" and shape.name in ("plain", "causal", "gqa h256"):
        for config in _sweep_configs(shape, label):
          impls[f"{session.kernel} {config}"] = (_ours(shape, session.kernel, config), True)
      if session.anchors:
        impls.update({name: (fn, False) for name, fn in _jax_anchors(shape).items()})
      rows = {}
      # XLA's backward keeps the (B, N, T, S) float32 probabilities: past half the device's
      # memory it cannot run (at 32K it asked for 64 GiB and the run stalled on retries).
      probabilities = 4 * shape.batch * shape.heads * shape.length ** 2
      for impl, (fn, check) in impls.items():
        row = harness.Row("attention", f"{shape.name} {label}", impl, str(shape), "bfloat16")
        if unserved.get(impl):  # e.g. Mosaic GPU at a head dim TMA cannot tile: not a failure
          row.note = f"not served: {unserved[impl]}"
          rows[impl] = session.add(row)
          continue
        if (impl == "xla" and label == "fwd+bwd" and
            probabilities > harness.memory_bytes(session.device) // 2):
          row.note = (f"not run: its probabilities alone are {probabilities / 2**30:.0f} GiB, over "
                      "half the device's memory")
          rows[impl] = session.add(row)
          continue
        try:
          with context():
            timed = harness.Timed(fn, shape.grads)
            if check and rule is not None:
              row.error, row.tolerance = rule.verdict(label, timed.outputs(label, *first))
              if not row.error <= row.tolerance:
                row.note = (f"WRONG: error {row.error:.2e} > tolerance {row.tolerance:.2e}; "
                            "not timed")
                rows[impl] = session.add(row)
                continue
            inputs = sets
            if impl == "jax_pallas_mgpu":  # its kernels take float16 only (jax 0.11.2)
              inputs = jax.tree.map(lambda a: a.astype(jnp.float16), sets)
            program, arg_sets = timed.programs[label], timed.arg_sets(label, inputs)
            seconds, whole = harness.time_sets_rounds(program, arg_sets, rounds=session.rounds,
                                                      calls=session.calls,
                                                      warmup=session.warmup)
            row.round_ms = whole * 1e3
            if session.profiles:
              kernel, row.kernels = harness.kernel_seconds(program, arg_sets, iterations=5)
              row.kernel_ms = kernel * 1e3 if kernel else None
          row.ms = seconds * 1e3
          row.tflops = shape.flops(label) / seconds / 1e12
        except Exception as e:  # noqa: BLE001 - an anchor that cannot run is a row
          row.note = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows[impl] = session.add(row)
      if session.anchors and shape.anchors and not (shape.segments or shape.soft_cap
                                                              or shape.window or shape.bias):
        row = harness.Row("attention", f"{shape.name} {label}", "torch_sdpa", str(shape),
                          "bfloat16")
        try:
          seconds = _torch_seconds(shape, label, session)
          row.ms, row.kernel_ms = seconds * 1e3, seconds * 1e3
          row.tflops = shape.flops(label) / seconds / 1e12
        except Exception as e:  # noqa: BLE001
          row.note = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows["torch_sdpa"] = session.add(row)
      cudnn, xla = rows.get("cudnn"), rows.get("xla")
      for row in rows.values():
        if xla is not None and row.ms and xla.ms:
          row.vs_xla = xla.ms / row.ms
      torch_row = rows.get("torch_sdpa")
      for kernel in _kernels(session):
        ours = rows[kernel]
        if cudnn is not None and ours.ms and cudnn.ms:
          ours.note = (ours.note + f" {cudnn.ms / ours.ms:.2f}x cudnn").strip()
        if torch_row is not None and ours.ms and torch_row.ms:
          ours.note += f" {torch_row.ms / ours.ms:.2f}x torch_sdpa"
