"""Which kernel cuBLAS (torch.matmul) runs for bf16 n^3, and how long it takes: tile shape,
cluster, schedule, as its kernel name spells them (bench/NOTES.md, matmul-16)."""
import json
import os

import torch
from torch.profiler import ProfilerActivity, profile


def main():
  rows = []
  for n in (2048, 4096, 8192, 8193):
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
      torch.matmul(a, b)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
      for _ in range(5):
        torch.matmul(a, b)
      torch.cuda.synchronize()
    for e in prof.key_averages():
      if e.device_type.name == "CUDA" or getattr(e, "device_time_total", 0):
        rows.append(dict(n=n, kernel=e.key, calls=e.count,
                         us_each=getattr(e, "device_time_total", 0) / max(e.count, 1)))
        print(n, e.count, round(rows[-1]["us_each"], 1), e.key[:200], flush=True)
  json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "cublas_kernels.json"), "w"),
            indent=1)


if __name__ == "__main__":
  main()
