"""How jaxkernels times code on a device: the one timer that the autotuner (``tuning``) and the
benchmarks (``bench/``) both use, so that a config is chosen by the measure it is judged by.

The method: warm up (compile, autotune, first touch), then rounds of back-to-back
asynchronous calls with one sync per round, and the median over rounds.
A round's fixed cost (the device idles while the host dispatches its first program, and again
at the closing sync) is taken out by timing each round twice over, at ``calls`` and
``2 * calls`` programs (:func:`time_rounds`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax


def over_sets(fn: Callable[..., Any]) -> Callable[[Sequence[tuple]], list[Any]]:
  """One jitted program that runs ``fn(*args)`` for every ``args`` in its list of input sets."""
  return jax.jit(lambda sets: [fn(*args) for args in sets])


def block(tree):
  return jax.block_until_ready(tree)


def time_call(fn: Callable, args: Sequence[Any], *, rounds: int, calls: int,
              warmup: int = 3) -> float:
  """Median seconds per call of ``fn(*args)`` (jitted by the caller)."""
  for _ in range(warmup):
    block(fn(*args))
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    block(out)
    times.append((time.perf_counter() - start) / calls)
  return statistics.median(times)


def time_rounds(run: Callable[[int], Any], *, rounds: int, calls: int,
                warmup: int = 3) -> tuple[float, float]:
  """(steady, whole-round) median host-clock seconds per program.

  ``run(n)`` dispatches ``n`` programs back to back and returns the last one's outputs. Each
  round, after a sync, times ``calls`` programs and then ``2 * calls``, each closed by a sync.
  A round pays once for what passes before its first kernel starts (the host dispatching the
  first program, the device idle: 0.4-0.8 ms for a program over 16 input sets) and for the
  closing sync; spread over the round's programs that was 3-10 us a set of a ~0.1-0.3 ms op,
  while the device ran the programs back to back (notes/rows.md, run 32). The difference of
  the two timings cancels that fixed cost: what ``calls`` more programs take on a device that
  is kept busy, as in a training loop. The whole-round figure keeps the fixed cost.
  """
  for _ in range(warmup):
    block(run(1))
  steady, whole = [], []
  for _ in range(rounds):
    start = time.perf_counter()
    block(run(calls))
    middle = time.perf_counter()
    block(run(2 * calls))
    end = time.perf_counter()
    whole.append((middle - start) / calls)
    steady.append(((end - middle) - (middle - start)) / calls)
  steady, whole = statistics.median(steady), statistics.median(whole)
  # The difference is a time only where the doubled round took longer than the single one:
  # where noise outweighs the programs (a CPU, a round of one call), it came out negative
  # (-0.29 ms for an interpreted softmax backward); the whole round is then the figure.
  return (steady if steady > 0 else whole), whole


def time_sets_rounds(fn: Callable, arg_sets: Sequence[Sequence[Any]], *, rounds: int,
                     calls: int, warmup: int = 3) -> tuple[float, float]:
  """(steady, whole-round) median host-clock seconds per execution of ``fn`` over several
  distinct argument sets (:func:`time_rounds`).

  One jitted program runs ``fn`` on every set back to back, so what a program costs beyond
  its kernels is shared by ``len(arg_sets)`` executions (:func:`kernel_seconds` gives the
  kernels alone). Distinct inputs keep XLA from merging the calls and the L2 from serving a
  repeat read.
  """
  batched = over_sets(fn)
  sets = [tuple(args) for args in arg_sets]

  def run(n):
    for _ in range(n):
      out = batched(sets)
    return out

  steady, whole = time_rounds(run, rounds=rounds, calls=calls, warmup=warmup)
  return steady / len(sets), whole / len(sets)


def time_sets(fn: Callable, arg_sets: Sequence[Sequence[Any]], *, rounds: int,
              calls: int) -> float:
  """Steady-state seconds per execution of ``fn`` over several argument sets
  (:func:`time_sets_rounds`)."""
  return time_sets_rounds(fn, arg_sets, rounds=rounds, calls=calls)[0]
