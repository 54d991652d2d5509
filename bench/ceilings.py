"""What the memory system gives at our sizes: the ceilings kernels are judged against.

- device-to-device copy (torch where installed, else XLA) at 2 GiB, and at the
  size of one headline activation (128 MiB in, 128 MiB out);
- Pallas Triton streaming kernels with the norms' tiling: read k (rows, cols)
  arrays and write k, no arithmetic. The gap between these and the copy is the
  cost of the tiling itself; the gap between these and an op is the op's own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from bench import harness, shapes
from jaxkernels._tiling import cdiv
from jaxkernels._triton import Tile, params


def _stream_kernel(*refs, k, block_rows, block_cols, n_rows, n_cols, programs, iters, hint):
  ins, outs = refs[:k], refs[k:]
  pid = pl.program_id(0)

  def step(block):
    t = Tile.at(block * block_rows, block_rows, 0, block_cols, n_rows=n_rows, n_cols=n_cols,
                mask_rows=iters > 0, mask_cols=False)
    for src, dst in zip(ins, outs):
      hint_kw = {"eviction_policy": "evict_first"} if hint else {}
      t.store(dst, pltriton.load(src.at[t.index], mask=t.mask, **hint_kw))

  if iters:
    @pl.loop(0, iters)
    def _(i):
      step(pid + i * programs)
  else:
    step(pid)


def stream(arrays, block_rows, num_warps, programs=0, hint=False):
  n_rows, n_cols = arrays[0].shape
  n_blocks = cdiv(n_rows, block_rows)
  grid = min(programs, n_blocks) if programs else n_blocks
  iters = cdiv(n_blocks, grid) if programs else 0
  kernel = functools.partial(_stream_kernel, k=len(arrays), block_rows=block_rows,
                             block_cols=n_cols, n_rows=n_rows, n_cols=n_cols, programs=grid,
                             iters=iters, hint=hint)
  return pl.pallas_call(kernel, out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays],
                        grid=(grid,), compiler_params=params(num_warps),
                        name="jk_stream")(*arrays)


def run(session: harness.Session) -> None:
  if session.platform != "gpu":
    print("ceilings: GPU only; skipped")
    return
  rows, cols = shapes.HEADLINE_ROWS
  n = rows * cols
  try:
    seconds = harness.torch_copy_seconds(session, n)
    session.add(harness.Row("ceilings", "copy 128MiB", "torch", f"({n},)", "bfloat16",
                            ms=seconds * 1e3, gbps=4 * n / seconds / 1e9))
  except ImportError:
    pass
  keys = jax.random.split(jax.random.key(1), 8 * 3)
  arrays = [jax.random.normal(k, (rows, cols), jnp.bfloat16) for k in keys]
  sets = [arrays[3 * i:3 * i + 3] for i in range(8)]
  seconds = harness.time_sets(lambda a: -a, [s[:1] for s in sets], rounds=session.rounds,
                              calls=session.calls)
  session.add(harness.Row("ceilings", "negate 128MiB", "xla", f"{rows}x{cols}", "bfloat16",
                          ms=seconds * 1e3, gbps=4 * n / seconds / 1e9))
  # The same op timed one dispatch per call: the gap is host dispatch, not device work.
  seconds = harness.time_call(jax.jit(lambda a: -a), (arrays[0],), rounds=session.rounds,
                              calls=session.calls)
  session.add(harness.Row("ceilings", "negate 128MiB", "xla", f"{rows}x{cols}", "bfloat16",
                          ms=seconds * 1e3, gbps=4 * n / seconds / 1e9,
                          note="timed one host dispatch per call"))
  for k in (1, 2, 3):
    for block_rows, warps, programs, hint in ((1, 4, 0, False), (1, 4, 0, True),
                                              (2, 8, 0, False), (2, 8, 0, True)):
      fn = jax.jit(functools.partial(stream, block_rows=block_rows, num_warps=warps,
                                     programs=programs, hint=hint))
      try:
        out = fn(arrays[:k])
        ok = all(bool(jnp.array_equal(o, a)) for o, a in zip(out, arrays[:k]))
        seconds = harness.time_sets(fn, [(s[:k],) for s in sets], rounds=session.rounds,
                                    calls=session.calls)
      except Exception as e:  # noqa: BLE001 - a failed variant is a row
        session.add(harness.Row("ceilings", f"stream {k}->{k}", "triton", f"{rows}x{cols}",
                                "bfloat16", note=f"FAILED: {type(e).__name__}: {str(e)[:200]}"))
        continue
      session.add(harness.Row(
          "ceilings", f"stream {k}->{k}", "triton", f"{rows}x{cols}", "bfloat16",
          ms=seconds * 1e3, gbps=2 * k * n * 2 / seconds / 1e9,
          config=f"rows={block_rows} warps={warps} programs={programs} evict_first={hint}",
          note="" if ok else "WRONG: output differs from input"))
