"""sharding: what the partitioning costs where there is nothing to split.

The same op on plain arrays and on arrays placed on a one-device mesh of Explicit axes (the
ops then run their kernels under shard_map, jaxkernels.partitioning), timed round-robin, one
round of each in turn: rms_norm+residual forward+backward (16384x4096 bf16) and the bf16
matmul forward+backward at 4096^3. Both are checked against each other before timing.
"""

from __future__ import annotations

import contextlib
import random
import statistics

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxkernels as jk
from bench import harness, shapes


def _cases(session):
  rows, cols = shapes.SMOKE_ROWS if session.smoke else shapes.HEADLINE_ROWS
  s = 256 if session.smoke else 4096

  def norm(x, r, w, dy, dh):
    (y, h), vjp = jax.vjp(lambda x, r, w: jk.rms_norm(x, w, residual=r), x, r, w)
    return y, h, vjp((dy, dh))

  def product(a, b, dy):
    y, vjp = jax.vjp(jk.matmul, a, b)
    return y, vjp(dy)

  def norm_inputs(seed):
    k = jax.random.split(jax.random.key(seed), 5)
    big = lambda key: jax.random.normal(key, (rows, cols), jnp.bfloat16)
    return (big(k[0]), big(k[1]), 1 + 0.1 * jax.random.normal(k[2], (cols,), jnp.float32),
            big(k[3]), big(k[4]))

  def matmul_inputs(seed):
    k = jax.random.split(jax.random.key(seed), 3)
    draw = lambda key, shape: (jax.random.normal(key, shape, jnp.float32) / s**0.25).astype(
        jnp.bfloat16)
    return draw(k[0], (s, s)), draw(k[1], (s, s)), draw(k[2], (s, s))

  return [("rms_norm+residual fwd+bwd", f"{rows}x{cols}", norm, norm_inputs,
           [P("data", None), P("data", None), P(), P("data", None), P("data", None)]),
          ("matmul fwd+bwd", f"{s}x{s}x{s}", product, matmul_inputs,
           [P("data", None), P(), P("data", None)])]


def _all_devices(session: harness.Session) -> None:
  """Data parallel over every device (rows split): the same cases against one device's plain
  call; the compiled program must hold no all-gather (d(scale) and dB are all-reduced)."""
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Explicit,))
  for name, shape, fn, inputs, specs in _cases(session):
    sets = [inputs(seed) for seed in range(4)]
    split = [tuple(jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in zip(args, specs))
             for args in sets]
    plain, sharded = jax.jit(fn), jax.jit(fn)
    want = plain(*sets[0])
    with jax.set_mesh(mesh):
      got = sharded(*split[0])
      text = sharded.lower(*split[0]).compile().as_text()
    rows = {}
    for label, f, arg_sets, out in (("one device", plain, sets, want),
                                    (f"rows over {len(devices)} devices", sharded, split, got)):
      row = harness.Row("sharding", name, label, shape, "bfloat16", tolerance=0.0)
      row.error = max(harness.relative_error(g, w) for g, w in
                      zip(jax.tree.leaves(out), jax.tree.leaves(want)))
      if f is sharded:
        reduces = text.count("all-reduce(") + text.count("all-reduce-start(")
        row.note = ("all-gather IN the program; " if "all-gather" in text else
                    "no all-gather; ") + f"{reduces} all-reduce"
      # The one-device call runs outside the mesh's context: inside it, its arrays would be
      # placed on the mesh every call.
      context = jax.set_mesh(mesh) if f is sharded else contextlib.nullcontext()
      with context:
        seconds = statistics.median(harness.time_sets(f, arg_sets, rounds=1, calls=session.calls)
                                    for _ in range(session.rounds))
      row.ms = seconds * 1e3
      rows[label] = session.add(row)
    last = list(rows.values())
    last[1].vs_xla = last[0].ms / last[1].ms
    last[1].note += " (vs_xla: one device's time / this time)"


def run(session: harness.Session, sweep: bool = False) -> None:
  del sweep
  if len(jax.devices()) > 1:
    _all_devices(session)
  mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:1])
  for name, shape, fn, inputs, specs in _cases(session):
    sets = [inputs(seed) for seed in range(4)]
    on_mesh = [tuple(jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in zip(args, specs))
               for args in sets]
    variants = {"plain": (jax.jit(fn), sets), "one-device mesh": (jax.jit(fn), on_mesh)}
    rows = {}
    with jax.set_mesh(mesh):
      want = variants["plain"][0](*sets[0])
      for label, (f, arg_sets) in variants.items():
        row = harness.Row("sharding", name, label, shape, "bfloat16", tolerance=0.0)
        row.error = max(harness.relative_error(g, w) for g, w in
                        zip(jax.tree.leaves(f(*arg_sets[0])), jax.tree.leaves(want)))
        rows[label] = row
      samples = {label: [] for label in variants}
      order = random.Random(0)
      timers = list(variants.items())
      for _ in range(session.rounds):
        for label, (f, arg_sets) in order.sample(timers, len(timers)):
          samples[label].append(harness.time_sets(f, arg_sets, rounds=1, calls=session.calls))
    for label, row in rows.items():
      row.ms = statistics.median(samples[label]) * 1e3
      row.note = f"spread {min(samples[label]) * 1e3:.4f}-{max(samples[label]) * 1e3:.4f} ms"
    rows["one-device mesh"].vs_xla = rows["plain"].ms / rows["one-device mesh"].ms
    rows["one-device mesh"].note += " (vs_xla: plain time / this time)"
    for row in rows.values():
      if row.error:
        row.note = f"DIFFERS from plain: {row.error:.1e}; " + row.note
      session.add(row)
