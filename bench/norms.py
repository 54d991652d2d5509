"""rms_norm / layer_norm, with and without the fused residual, forward and forward+backward."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

import jaxkernels as jk
from bench import harness, shapes
from jaxkernels import roofline
from jaxkernels.ops.norms import reference as norms_reference
from jaxkernels.ops.norms import triton as norms_triton

CASES = (  # (op name, layer norm?, fused residual?)
    ("rms_norm+residual", False, True),
    ("rms_norm", False, False),
    ("layer_norm+residual", True, True),
    ("layer_norm", True, False),
)


def _inputs(rows, cols, dtype, layer, residual, seed=0):
  keys = jax.random.split(jax.random.key(seed), 6)
  x = jax.random.normal(keys[0], (rows, cols), dtype)
  r = jax.random.normal(keys[1], (rows, cols), dtype) if residual else None
  s = (1 + 0.1 * jax.random.normal(keys[2], (cols,))).astype(jnp.float32)
  b = (0.1 * jax.random.normal(keys[3], (cols,))).astype(jnp.float32) if layer else None
  dy = jax.random.normal(keys[4], (rows, cols), dtype)
  dh = jax.random.normal(keys[5], (rows, cols), dtype) if residual else None
  return x, r, s, b, dy, dh


def _op(layer, impl, config=None):
  def op(x, r, s, b):
    if layer:
      return jk.layer_norm(x, s, b, residual=r, implementation=impl, config=config)
    return jk.rms_norm(x, s, residual=r, implementation=impl, config=config)
  return op


def _reference(layer, compute_dtype):
  def op(x, r, s, b):
    if layer:
      return norms_reference.layer_norm(x, s, b, eps=1e-6, residual=r, compute_dtype=compute_dtype)
    return norms_reference.rms_norm(x, s, eps=1e-6, residual=r, compute_dtype=compute_dtype)
  return op


def _fwd(op):
  return jax.jit(op)


def _fwd_bwd(op, residual):
  @jax.jit
  def step(x, r, s, b, dy, dh):
    out, vjp = jax.vjp(op, x, r, s, b)
    grads = vjp((dy, dh) if residual else dy)
    # y (and h) are returned so XLA cannot skip the forward's writes; dr is dx's array.
    return out, grads[0], grads[2], grads[3]
  return step


def _jax_pallas_example(layer):
  """JAX's own Pallas Triton norm (jax.experimental.pallas.ops.gpu), forward, if importable."""
  try:
    if layer:
      from jax.experimental.pallas.ops.gpu import layer_norm as mod
      fn = mod.layer_norm
    else:
      from jax.experimental.pallas.ops.gpu import rms_norm as mod
      fn = mod.rms_norm
  except ImportError:
    return None
  return jax.jit(lambda x, r, s, b: fn(x[None], s, b if b is not None else jnp.zeros_like(s))[0])


def run(session: harness.Session, sweep: bool = False) -> None:
  rows, cols = shapes.SMOKE_ROWS if session.smoke else shapes.HEADLINE_ROWS
  dtype = jnp.bfloat16
  kernel = session.kernel
  context = jk.interpret_mode if session.interpret else contextlib.nullcontext
  for name, layer, residual in CASES:
    args = _inputs(rows, cols, dtype, layer, residual)
    x, r, s, b, dy, dh = args
    n_sets = 1 if session.interpret else harness.sets_for(roofline.nbytes(*args))
    sets = [args] + [_inputs(rows, cols, dtype, layer, residual, seed) for seed in range(1, n_sets)]
    fwd_cost = roofline.norm_fwd(x, s, b, r, layer=layer)
    bwd_cost = roofline.norm_bwd(x, s, b, r, layer=layer)
    for label, builder, cost in (
        ("fwd", lambda op: _fwd(op), fwd_cost),
        ("fwd+bwd", lambda op: _fwd_bwd(op, residual), fwd_cost + bwd_cost),
    ):
      bench_sets = [a[:4] if label == "fwd" else a for a in sets]
      bench_args = bench_sets[0]
      # The oracle: the float32 spec on the same values, upcast (no output rounding).
      oracle = builder(_op(layer, "xla"))(*[a.astype(jnp.float32) if a is not None else None
                                            for a in bench_args])
      # Tolerance: twice the error of the naive bf16 computation (DESIGN.md, Numerics).
      baseline = builder(_reference(layer, dtype))(*bench_args)
      tolerance = 2 * harness.relative_error(baseline, oracle)
      xla_ms = _time(session, name, label, "xla", builder(_op(layer, "xla")), bench_sets, cost,
                     oracle, tolerance, None)
      configs = [None]
      if sweep and residual and kernel == "triton" and not session.interpret:
        configs += _triton_sweep(rows, cols, label)
      for config in configs:
        with context():
          fn = builder(_op(layer, kernel, config))
          _time(session, name, label, kernel, fn, bench_sets, cost, oracle, tolerance, xla_ms,
                config)
      if label == "fwd" and session.platform == "gpu" and not residual:
        example = _jax_pallas_example(layer)
        if example is not None:
          _time(session, name, label, "jax_pallas_triton", example, bench_sets, cost, None,
                None, xla_ms)


def _triton_sweep(rows, cols, label):
  """Candidate Triton configs around the heuristic, for calibrating it on a new GPU."""
  base = norms_triton.heuristic(jax.ShapeDtypeStruct((rows, cols), jnp.bfloat16), None, None,
                                None, harness.hardware.chip("H100"))
  fields = dict(base.__dict__)
  if label == "fwd":
    grid = [(r, w, p, f) for r, w in ((1, 4), (2, 8), (4, 8)) for p, f in ((0, False),)]
    grid += [(r, w, p, f) for r, w in ((1, 4), (2, 8), (4, 8)) for p in (264, 528)
             for f in (False, True)]
    return [norms_triton.Config(**{**fields, "block_rows": r, "num_warps": w, "programs": p,
                                   "prefetch": f}) for r, w, p, f in grid]
  return [norms_triton.Config(**{**fields, "block_rows": 2, "num_warps": 8, "bwd_block_rows": r,
                                 "bwd_num_warps": w, "bwd_programs": p, "prefetch": f})
          for r, w in ((1, 4), (1, 8), (2, 8)) for p in (264, 528) for f in (False, True)]


def _time(session, name, label, impl, fn, sets, cost, oracle, tolerance, xla_ms, config=None):
  args = sets[0]
  row = harness.Row("norms", f"{name} {label}", impl, "x".join(map(str, args[0].shape)),
                    str(args[0].dtype), config=repr(config) if config else None)
  try:
    out = fn(*args)
    if oracle is not None:
      row.error, row.tolerance = harness.relative_error(out, oracle), tolerance
      if not row.error <= tolerance:
        row.note = f"WRONG: error {row.error:.2e} > tolerance {tolerance:.2e}; not timed"
        session.add(row)
        return None
    seconds = harness.time_sets(fn, sets, rounds=session.rounds, calls=session.calls)
  except Exception as e:  # a kernel that fails to build is a row, not a crash of the suite
    row.note = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
    session.add(row)
    return None
  row.ms = seconds * 1e3
  row.gbps = cost.bytes / seconds / 1e9
  if session.chip is not None:
    row.pct_roofline = cost.percent_of_roofline(seconds, session.chip)
  if xla_ms is not None:
    row.vs_xla = xla_ms / row.ms
  session.add(row)
  return row.ms
