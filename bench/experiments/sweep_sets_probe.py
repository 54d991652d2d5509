"""Is the steady clock dispatch-bound at small sweep sizes? Times 1024-2048 with 4, 12, 24 sets
(bench/NOTES.md, matmul-30).

  python -m bench.experiments.sweep_sets_probe
"""
from __future__ import annotations

import time


def main():
  from bench import harness
  from bench import matmul as M

  s = harness.Session(smoke=False, rounds=6, calls=3)
  for size in (1024, 1536, 2048):
    for n in (4, 12, 24):
      t = time.time()
      M.interleaved(s, f"sets{n}", size, {"xla": lambda a, b: a @ b,
                                          "mosaic_gpu": M._ours("mosaic_gpu")},
                    torch=True, rounds=6, calls=3, n_sets=n)
      print(f"== {size} sets {n}: wall {time.time() - t:.1f} s", flush=True)


if __name__ == "__main__":
  main()
