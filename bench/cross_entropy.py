"""Softmax cross-entropy: the row kernels on logits against XLA; and the loss fused with the
output projection against the optax path (logits = x @ w, then optax's loss on them), in time
and in the compiled program's memory."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

import jaxkernels as jk
from bench import harness, shapes
from jaxkernels import roofline, timing
from jaxkernels.ops.cross_entropy import reference



def _rows_case(session):
  rows, vocab = shapes.SMOKE_CROSS_ENTROPY_ROWS if session.smoke else shapes.CROSS_ENTROPY_ROWS
  labels = jax.random.randint(jax.random.key(1), (rows,), 0, vocab)  # the same for every set

  def draw(seed):
    k = jax.random.split(jax.random.key(seed), 2)
    return (3 * jax.random.normal(k[0], (rows, vocab), jnp.bfloat16),), \
        jax.random.normal(k[1], (rows,), jnp.float32)

  (logits,), _ = draw(0)
  return harness.Case(
      suite="cross_entropy", name="cross_entropy rows", inputs=draw,
      op=lambda impl, cfg: (lambda z: jk.softmax_cross_entropy(
          z, labels, reduction="none", z_loss=1e-4, implementation=impl, config=cfg)),
      reference=lambda cd: (lambda z: reference.softmax_cross_entropy(
          z, labels, z_loss=1e-4, compute_dtype=cd)[0].astype(jnp.promote_types(cd, jnp.float32))),
      fwd_cost=roofline.cross_entropy_fwd(logits),
      bwd_cost=roofline.cross_entropy_bwd(logits, logits.dtype), grads=(0,),
      dtype=jnp.bfloat16, reduction=vocab,
      registered="softmax_cross_entropy")  # both GPU kernels side by side


def _optax_loss(x, w, labels):
  import optax
  logits = jnp.dot(x, w)
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                         labels).mean()


def _linear(session):
  """Loss and both gradients at shapes.LINEAR_CROSS_ENTROPY: time, the compiled program's temporaries and outputs,
  and the loss against the float32 reference."""
  tokens, dim, vocab = (shapes.SMOKE_LINEAR_CROSS_ENTROPY if session.smoke else
                       shapes.LINEAR_CROSS_ENTROPY)
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (tokens, dim), jnp.bfloat16)
  w = (jax.random.normal(k[1], (dim, vocab), jnp.float32) / dim ** 0.5).astype(jnp.bfloat16)
  labels = jax.random.randint(k[2], (tokens,), 0, vocab)
  want = float(jnp.mean(reference.linear_softmax_cross_entropy(x, w, labels)[0]))
  impls = {"optax": _optax_loss}
  chunk = tokens // 4  # a larger chunk than the default's: dW's accumulator passed fewer times
  kernels = session.kernels("linear_softmax_cross_entropy")  # on a GPU, each side by side
  for impl in ("xla", *kernels):
    impls[impl] = lambda x, w, y, impl=impl: jk.linear_softmax_cross_entropy(
        x, w, y, implementation=impl)
  for impl in kernels:
    impls[f"{impl}, {chunk} a chunk"] = lambda x, w, y, impl=impl: (
        jk.linear_softmax_cross_entropy(x, w, y, implementation=impl, chunk_size=chunk))
  context = jk.interpret_mode if session.interpret else contextlib.nullcontext
  shape = f"{tokens}x{dim}x{vocab}"
  for impl, fn in impls.items():
    row = harness.Row("cross_entropy", "linear cross_entropy fwd+bwd", impl, shape, "bfloat16")
    try:
      with context():
        step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
        compiled = step.lower(x, w, labels).compile()
        memory = compiled.memory_analysis()
        held = memory.temp_size_in_bytes + memory.output_size_in_bytes
        loss = float(step(x, w, labels)[0])
        seconds = timing.time_sets(step, [(x, w, labels)], rounds=session.rounds,
                                   calls=session.calls)
    except Exception as e:  # noqa: BLE001 - one that fails (out of memory) is a row
      row.note = f"FAILED: {type(e).__name__}: {str(e)[:200]}"
      session.add(row)
      continue
    row.ms = seconds * 1e3
    row.tflops = 6 * tokens * dim * vocab / seconds / 1e12
    row.error = abs(loss - want) / abs(want)
    row.note = f"memory {held / 2**20:.0f} MiB (temporaries + outputs)"
    session.add(row)


def run(session: harness.Session, sweep: bool = False) -> None:
  harness.run_case(session, _rows_case(session), sweep=sweep)
  _linear(session)
