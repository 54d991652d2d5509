"""python -m bench.show RESULT.json [filter]: a results file as a compact table."""

import json
import re
import sys


def main(path, pattern=""):
  record = json.load(open(path))
  print(record["device"], "jax", record["jax"], record["commit"], record["date"])
  for r in record["rows"]:
    if pattern and pattern not in f"{r['name']} {r['impl']}":
      continue
    config = re.sub(r"block_cols=\d+, |Config\(|\)", "", r["config"] or "")
    ms = "" if r["ms"] is None else f"{r['ms']:.4f}"
    rate = r["gbps"] if r["gbps"] is not None else r.get("tflops")
    gbps = "" if rate is None else f"{rate:.0f}"
    vs = "" if r["vs_xla"] is None else f"{r['vs_xla']:.2f}"
    kernel = ""
    if r.get("kernel_ms") is not None:  # results from before run 17 have no kernel columns
      kvs = "" if r.get("kernel_vs_xla") is None else f"{r['kernel_vs_xla']:.2f}"
      rate = r.get("kernel_gbps") or r.get("kernel_tflops") or 0
      kernel = f" | kernel {r['kernel_ms']:.4f} {rate:6.0f} {kvs:>5s}"
    if r.get("round_ms") is not None:  # results from run 32 on: the whole-round host clock
      kernel += f" | round {r['round_ms']:.4f}"
    print(f"{r['name']:28s} {r['impl']:18s} {ms:>8s} {gbps:>6s} {vs:>5s}{kernel} {config} "
          f"{r['note'][:90]}")


if __name__ == "__main__":
  main(*sys.argv[1:])
