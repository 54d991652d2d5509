"""python -m bench report [--results DIR] [--out FILE]: the report from the committed results.

Reads every result file under results/<device>/ (no device needed) and writes
results/REPORT.md: per device and op family, each shape's kernels beside every anchor timed in the
same run (XLA, cuBLAS, cuDNN, torch, JAX's Pallas examples), as time, rate and % of the
device's roofline, each number naming its file. For each (device, suite, op, shape, dtype) the
newest full-size run (not a smoke run, not a config sweep) that timed one of our kernels and an
anchor at it serves; experiments' variant rows (an impl with a config or a note in its name)
are left out. Then the lessons (``python -m bench lessons``: each lecture prediction and what
each device showed, the TPU's compiled), block-scaled fp8, and the plots (results/plots/: a
roofline per GPU, the matmul sweep with the wave model) where matplotlib is installed.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import pathlib
import re
import sys

from bench.records import FAMILIES, Line, Run, impl_of, lines, load

ROOT = pathlib.Path(__file__).resolve().parent


def _rate(row) -> str:
  if row.get("tflops") is not None:
    return f"{row['tflops']:.0f} TF/s"
  if row.get("gbps") is not None:
    return f"{row['gbps']:.0f} GB/s"
  return ""


def _roofline(row) -> str:
  pct = row.get("pct_roofline")
  return "" if pct is None else f"{pct:.0f}%"


def _cell(row) -> str:
  """The row's host-clock time and rate, and its kernels' own time (CUPTI) where measured: the
  host clock also counts what passes between programs (launch and dispatch)."""
  kernel = f" (kernels {row['kernel_ms']:.3f} ms by CUPTI)" if row.get("kernel_ms") else ""
  return (f"{row['impl']} {row['ms']:.3f} ms" + (f", {_rate(row)}" if _rate(row) else "")
          + kernel)


def _mosaic_beside_triton(by_device: dict[str, list[Line]]) -> list[str]:
  """Each op a run timed on both of our GPU kernels: the Mosaic GPU kernel (what Hopper runs)
  beside the Triton one it replaces (deprecated in JAX 0.11; kept for sm80/sm89)."""
  out = []
  for device, device_lines in by_device.items():
    pairs = []
    for line in device_lines:
      best = {}
      for r in line.others:
        if impl_of(r) in ("mosaic_gpu", "triton") and r.get("config") is None:
          best[impl_of(r)] = r
      if len(best) == 2:
        pairs.append((line, best["mosaic_gpu"], best["triton"]))
    if not pairs:
      continue
    out += [f"## Mosaic GPU beside Triton: {device}", "",
            "Both of our GPU kernels in the same run, at their default configs; time is the "
            "host clock's. Triton's / Mosaic GPU's > 1: the Mosaic GPU kernel is faster.", "",
            "| op | shape | dtype | mosaic_gpu | triton | triton / mosaic_gpu | run |",
            "| --- | --- | --- | --- | --- | ---: | --- |"]
    for line, mosaic, triton in pairs:
      out.append(f"| {line.name} | {line.shape} | {line.dtype} | {_cell(mosaic)} | "
                 f"{_cell(triton)} | {triton['ms'] / mosaic['ms']:.2f}x | "
                 f"{line.run.path.name} ({line.run.short_commit}) |")
    out.append("")
  return out


def _side_by_side(by_device: dict[str, list[Line]]) -> list[str]:
  """Each shape timed (or predicted) on more than one device: ours there, and its speedup
  over that device's best anchor."""
  devices = list(by_device)
  cells: dict[tuple, dict[str, Line]] = collections.defaultdict(dict)
  for device, device_lines in by_device.items():
    for line in device_lines:
      if not line.stale:
        cells[line.suite, line.name, line.shape, line.dtype][device] = line
  shared = [(key, cells[key]) for key in sorted(cells) if len(cells[key]) > 1]
  if not shared:
    return []
  out = ["## Side by side", "",
         "Shapes on more than one device: our time there (the speedup over that device's best "
         "anchor).", "",
         "| op | shape | " + " | ".join(devices) + " |",
         "| --- | --- | " + " | ".join("---:" for _ in devices) + " |"]
  for (_, name, shape, _), on in shared:
    row = [f"{on[d].ours['ms']:.3f} ms ({on[d].speedup:.2f}x)" if d in on else ""
           for d in devices]
    out.append(f"| {name} | {shape} | " + " | ".join(row) + " |")
  return out + [""]


def _summary(device: str, family: str, family_lines: list[Line]) -> str:
  speedups = sorted(line.speedup for line in family_lines)
  geomean = math.exp(sum(map(math.log, speedups)) / len(speedups))
  roofs = sorted(line.ours["pct_roofline"] for line in family_lines
                 if line.ours.get("pct_roofline") is not None)
  median = f"{roofs[len(roofs) // 2]:.0f}%" if roofs else ""
  faster = sum(x >= 1 for x in speedups)
  return (f"| {device} | {family} | {len(speedups)} | {faster} | {geomean:.2f}x | "
          f"{speedups[0]:.2f}-{speedups[-1]:.2f}x | {median} |")


def render(by_device: dict[str, list[Line]], results: pathlib.Path) -> str:
  out = ["# Kernels against their anchors, by device",
         "",
         "Written by `python -m bench report` from the committed results (results/); "
         "regenerate it, do not edit it. Each line: our best kernel and the best anchor timed in "
         "the same run at that shape (host clock, steady state; see each file's `timing`), "
         "% of the device's roofline where the suite computes one, and the file. "
         "Speedup = the anchor's time / ours (> 1: ours is faster). A device marked "
         "**(predicted)** is a TPU no one has run these on: its times are predicted from the "
         "program the TPU compiler built (AOT from a CPU host, `python -m bench.tpu_predicted`): "
         "max(FLOPs / peak, bytes / HBM bandwidth), a lower bound that sees no pipeline "
         "bubble, nor the VPU work inside a kernel, for ours and the anchors alike; forward+"
         "backward with an optimization barrier between the halves, as the GPU suites time it. "
         "The anchors there: XLA, and for attention JAX's splash attention (bare, in its own "
         "(B, N, T, H) layout, and as MaxText calls it on (B, T, N, H)) and its older Pallas "
         "TPU flash example (tokamax is not an anchor yet). Every attention kernel is "
         "predicted by one model: its products' FLOPs, and its block traffic at its own blocks "
         "(roofline.attention_traffic: k and v re-read for every query block they meet) plus "
         "every XLA pass around it in the compiled program.",
         "",
         "| device | family | shapes | ours faster | geomean speedup | range "
         "| median roofline, ours |",
         "| --- | --- | ---: | ---: | ---: | --- | ---: |"]
  for device, device_lines in by_device.items():
    for family, suites in FAMILIES:
      family_lines = [line for line in device_lines if line.suite in suites and not line.stale]
      if family_lines:
        out.append(_summary(device, family, family_lines))
  stale = sum(bool(line.stale) for ls in by_device.values() for line in ls)
  if stale:
    out += ["", f"Left out of this summary: {stale} stale lines, each measured before one of "
            "our kernels that a later run of its suite on that device timed (marked "
            "**stale** in the tables below, with the kernel it predates)."]
  out.append("")
  out += _side_by_side(by_device)
  for device, device_lines in by_device.items():
    current = [line for line in device_lines if not line.stale]
    device_lines = current + [line for line in device_lines if line.stale]
    faster = sum(line.speedup >= 1 for line in current)
    dates = sorted(line.run.date[:10] for line in device_lines)
    stale = len(device_lines) - len(current)
    out += [f"## {device}", "",
            f"{len(current)} shapes; ours at least as fast as the best anchor at "
            f"{faster}, slower at {len(current) - faster}"
            + (f"; {stale} more marked stale (last)" if stale else "")
            + f". Runs dated {dates[0]} to "
            f"{dates[-1]}: a line is as new as the last run that timed that shape, and a "
            "kernel added since (or a faster version of it) shows only once a run measures "
            "it.", ""]
    for family, suites in FAMILIES:
      family_lines = [line for line in device_lines if line.suite in suites]
      if not family_lines:
        continue
      out += [f"### {family}", "",
              "| op | shape | dtype | ours | roofline | best anchor | roofline | speedup | run |",
              "| --- | --- | --- | --- | ---: | --- | ---: | ---: | --- |"]
      for line in family_lines:
        run = line.run
        where = run.path.relative_to(results).as_posix()
        mark = f" **stale**: before {', '.join(line.stale)}" if line.stale else ""
        out.append(f"| {line.name}{mark} | {line.shape} | {line.dtype} | {_cell(line.ours)} | "
                   f"{_roofline(line.ours)} | {_cell(line.anchor)} | "
                   f"{_roofline(line.anchor)} | {line.speedup:.2f}x | "
                   f"[{run.path.name}]({where}) ({run.short_commit}, jax {run.jax}) |")
      out.append("")
  out += _mosaic_beside_triton(by_device)
  measured = {line.run.path.parent for ls in by_device.values() for line in ls}
  missing = [device.name for device in sorted(results.iterdir())  # (the plots are no device)
             if device.is_dir() and device.name != "plots" and device not in measured]
  if missing:
    out += ["## Not measured here", "",
            "No full-size run with our kernels beside an anchor under: "
            + ", ".join(f"`{name}`" for name in missing)
            + " (the model step's compiled memory for TPUs: notes/report.md).", ""]
  return "\n".join(out)


def _newest_with(runs: list[Run], results: pathlib.Path, suite: str, prefix: str = "",
                 also_smoke_under: str = "tpu_compiled", keep=None) -> dict[str, Run]:
  """Per device folder, the newest run with rows of ``suite`` (named from ``prefix``, and
  where given that ``keep(row)`` takes); the TPU's compiled runs count though made on a CPU
  host."""
  newest: dict[str, Run] = {}
  candidates = list(runs) + _folder_runs(results, also_smoke_under, suite)
  for run in sorted(candidates, key=lambda run: run.date):
    if any(r["suite"] == suite and r["name"].startswith(prefix) and (keep is None or keep(r))
           for r in run.rows):
      newest[run.path.parent.name] = run
  return newest


def _folder_runs(results: pathlib.Path, folder: str, suite: str) -> list[Run]:
  """Every run in ``results / folder`` with ``suite`` in its file name, smoke or not (the
  TPU's compiled runs are made on a CPU host), oldest first."""
  runs = []
  for path in sorted((results / folder).glob(f"*{suite}*.json")):
    record = json.loads(path.read_text())
    runs.append(Run(path, path.parent.name, record.get("date", ""), record.get("commit", "?"),
                    record.get("jax", "?"), tuple(record.get("rows", ()))))
  return sorted(runs, key=lambda run: run.date)


def _newest_rows(results: pathlib.Path, suite: str, keep, since, folder: str = "tpu_compiled"
                 ) -> tuple[list[dict], list[Run]]:
  """The rows of ``suite`` that ``keep(row)`` takes from the runs in ``folder`` since the
  first that has a row ``since(row)`` takes (older ones ran other code), one per (name, impl,
  shape): the newest run's where several compiled it (a run of some variants does not hide
  the others'); and the runs they come from, oldest first."""
  newest: dict[tuple, tuple[dict, Run]] = {}
  runs = _folder_runs(results, folder, suite)
  first = next((n for n, run in enumerate(runs) if any(since(r) for r in run.rows)), len(runs))
  for run in runs[first:]:
    for r in run.rows:
      if r["suite"] == suite and keep(r):
        newest[(r["name"], r["impl"], r.get("shape"))] = (r, run)
  rows = [r for r, _ in newest.values()]
  used = list({run.path: run for _, run in sorted(newest.values(),
                                                  key=lambda pair: pair[1].date)}.values())
  return rows, used


def _link(run: Run, results: pathlib.Path) -> str:
  where = run.path.relative_to(results).as_posix()
  return f"[{run.path.name}]({where}) ({run.short_commit}, jax {run.jax})"


def _lessons(runs: list[Run], results: pathlib.Path, plots: dict[str, str]) -> list[str]:
  from bench import lessons
  newest = _newest_with(runs, results, "lessons")
  out = ["## Lessons, measured", "",
         "What the accelerator lecture predicts, then what each device showed "
         "(`python -m bench lessons` on a GPU; `--tpu` compiles the TPU side on any host: "
         "predicted, from the compiled program).", ""]
  for lesson, prediction in lessons.LESSONS.items():
    out += [f"### {lesson}", "", f"*Predicted:* {prediction}", ""]
    rows = [(folder, run, row) for folder, run in newest.items() for row in run.rows
            if row["suite"] == "lessons" and row["name"].startswith(f"{lesson}:")]
    if rows:
      out += ["| case | device | shape | dtype | ms | rate | note |",
              "| --- | --- | --- | --- | ---: | ---: | --- |"]
      for folder, run, row in rows:
        device = row["impl"] if "predicted" in row["impl"] else run.device
        ms = "" if row.get("ms") is None else f"{row['ms']:.4g}"
        rate = _rate(row) if row.get("ms") is not None else ""
        note = (row.get("note") or "").replace("|", "/")
        if row.get("kernel_ms"):
          note = f"kernel (CUPTI) {row['kernel_ms']:.4f} ms; " + note
        case = row["name"].split(": ", 1)[1]
        out.append(f"| {case} | {device} | {row.get('shape', '')} | {row.get('dtype', '')} | "
                   f"{ms} | {rate} | {note} |")
      out += ["", "From " + "; ".join(_link(run, results) for run in
                                      {id(r): r for _, r, _ in rows}.values()), ""]
    if lesson == "waves" and "waves" in plots:
      out += [f"![matmul sweep and the wave model]({plots['waves']})", ""]
    if lesson == "recomputation":
      out += ["The remat table and plot: notes/model.md (model-3..5) and "
              "[remat.png](nvidia_h100/remat.png).", ""]
    if lesson == "low precision":
      out += _fp8_blocks(runs, results)
  return out


def _fp8_blocks(runs: list[Run], results: pathlib.Path) -> list[str]:
  """Block-scaled fp8 (``python -m bench matmul --only fp8_blocks``): each scaling's TFLOP/s
  against the same run's bf16 product by XLA, and its error on outlier rows."""
  newest = _newest_with(runs, results, "matmul", prefix="scaled ")
  out = []
  for folder, run in newest.items():
    timed = [r for r in run.rows if r["name"].startswith("scaled ") and r.get("ms")]
    shapes = list(dict.fromkeys(r["shape"] for r in timed))
    out += [f"**Block-scaled fp8, {run.device}** (TFLOP/s; x: against XLA's bf16 product in "
            f"the same rounds; {_link(run, results)})", "",
            "| scaling | impl | " + " | ".join(shapes) + " |",
            "| --- | --- | " + " | ".join("---:" for _ in shapes) + " |"]
    for key in dict.fromkeys((r["name"], r["impl"]) for r in timed):
      cells = []
      for shape in shapes:
        row = next((r for r in timed if (r["name"], r["impl"]) == key and r["shape"] == shape),
                   None)
        cells.append("" if row is None else
                     f"{row['tflops']:.0f} ({row['vs_xla']:.2f}x)" if row.get("vs_xla") else
                     "" if row is None else f"{row['tflops']:.0f}")
      out.append(f"| {key[0].removeprefix('scaled ')} | {key[1]} | " + " | ".join(cells) + " |")
    accuracy = [r for r in run.rows if r["name"].startswith("accuracy ")]
    if accuracy:
      out += ["", "| accuracy (median row error against the float64 product) | shape | error | "
              "note |", "| --- | --- | ---: | --- |"]
      out += [f"| {r['name'].removeprefix('accuracy ')} | {r['shape']} | {r['error']:.2e} | "
              f"{r.get('note', '')} |" for r in accuracy]
    out.append("")
  return out


def _model_on_tpus(runs: list[Run], results: pathlib.Path) -> list[str]:
  """The train step compiled for each TPU generation (``python -m bench model --tpu``): each
  remat policy's predicted step time and MFU, and its compiled peak memory."""
  one_chip = lambda r: "compiled for" in r["name"] and "remat " in r["impl"]
  # Since the first run of ours with the TPU's default op groups on XLA (tpu-step-1).
  rows, used = _newest_rows(results, "model", keep=one_chip,
                            since=lambda r: one_chip(r) and "on XLA)" in r["impl"])
  if not rows:
    return []
  steps = list(dict.fromkeys(r["name"] for r in rows))
  rows.sort(key=lambda r: (steps.index(r["name"]), r["impl"].startswith("plain"), r["impl"]))
  out = ["## Model step on TPUs (predicted)", "",
         f"The train step on our kernels, and bench.plain_llama's (plain JAX with JAX's splash "
         f"attention as MaxText calls it) beside it, compiled for one chip of each generation; "
         f"time "
         f"predicted from the compiled program (max(FLOPs / bf16 peak, bytes / HBM bandwidth): "
         f"a lower bound), MFU by PaLM's count at that time "
         f"({'; '.join(_link(run, results) for run in used)}: each row from the newest run "
         "that compiled it). The GPUs' measured steps are in the model step lines above.", "",
         "| step | on | remat | predicted ms | TFLOP/s | MFU | note |",
         "| --- | --- | --- | ---: | ---: | ---: | --- |"]
  for r in rows:
    ms = "" if r.get("ms") is None else f"{r['ms']:.1f}"
    tflops = "" if r.get("tflops") is None else f"{r['tflops']:.0f}"
    mfu = "" if r.get("pct_roofline") is None else f"{r['pct_roofline']:.0f}%"
    who, policy = r["impl"].split(", remat ")
    out.append(f"| {r['name']}, {r['shape']} | {who} | {policy} | {ms} | {tflops} | {mfu} | "
               f"{(r.get('note') or '').replace('|', '/')} |")
  out.append("")
  for step in steps:
    ours, plain, fair = {}, float("inf"), float("inf")  # ours: by the residual stream's dtype
    for r in rows:
      if r["name"] != step or r.get("ms") is None:
        continue
      if r["impl"].startswith("plain JAX"):
        plain = min(plain, r["ms"])
        fair = min(fair, _with_splash_flops(r) or r["ms"])
      else:
        stream = re.search(r"stream (\w+)", r["impl"])
        stream = stream.group(1) if stream else "float32"
        ours[stream] = min(ours.get(stream, float("inf")), r["ms"])
    if plain == float("inf"):
      continue
    if not ours:
      out.append(f"- {step}: ours fits under none of the policies run; plain JAX's best "
                 f"{plain:.1f} ms.")
    for stream, ms in ours.items():
      line = (f"- {step}: ours ({stream} stream) {ms:.1f} ms against plain JAX's (bfloat16 "
              f"stream) {plain:.1f} ms, each at its best policy: **{plain / ms:.2f}x** "
              f"(predicted)")
      if abs(fair - plain) > 0.005 * plain:  # not the notes' rounding
        line += (f"; with splash's FLOPs counted (its calls state none to the compiler; "
                 f"`bench.model.splash_flops`), plain JAX's best is {fair:.1f} ms: "
                 f"**{fair / ms:.2f}x**")
      out.append(line + ".")
  return out + [""]


def _with_splash_flops(row) -> float | None:
  """A plain-JAX TPU step row's predicted ms with its splash calls' FLOPs added to the
  compiled program's (which counts none for them): max(FLOPs / bf16 peak, bytes / HBM
  bandwidth) again, from the counts its note records; None where the note has none."""
  from bench import model
  from jaxkernels import hardware
  counts = re.search(r"([\d.]+) TFLOP and ([\d.]+) GB a chip", row.get("note") or "")
  where = re.match(r"(\S+) train step, compiled for (\S+)", row["name"])
  shape = re.match(r"batch (\d+) x (\d+)", row.get("shape") or "")
  if not (counts and where and shape):
    return None
  chip = hardware.chip(f"TPU {where.group(2)}")
  flops = float(counts.group(1)) * 1e12 + model.splash_flops(
      where.group(1), int(shape.group(1)), int(shape.group(2)), row["impl"].split("remat ")[-1])
  return max(flops / chip.flops("bfloat16"), float(counts.group(2)) * 1e9 / chip.hbm_bandwidth) * 1e3


def _published_on_tpus(runs: list[Run], results: pathlib.Path) -> list[str]:
  """The predictor against published TPU runs (``python -m bench model --tpu --published``):
  each run's step predicted by the method of every TPU column, beside the published rate."""
  published = lambda r: "predicted against published" in r["name"]
  run = _newest_with(runs, results, "model", keep=published).get("tpu_compiled")
  rows = [r for r in (run.rows if run else ()) if published(r)]
  if not rows:
    return []
  out = ["## The TPU predictions against published runs", "",
         "Published TPU training runs, their model and batch a chip compiled for a 4-chip slice "
         "of their TPU under FSDP on our kernels and predicted as every TPU column here is "
         "(max(FLOPs / bf16 peak, bytes / HBM bandwidth) of the compiled program; two depths, "
         "extended linearly to the run's). Published / predicted is the error bar of a "
         "predicted TPU time: how much slower a real step ran than the roofline says "
         f"({_link(run, results)}).", "",
         "| run | ours as compiled | predicted s | predicted MFU | note |",
         "| --- | --- | ---: | ---: | --- |"]
  for r in rows:
    seconds = "" if r.get("ms") is None else f"{r['ms'] / 1e3:.3f}"
    mfu = "" if r.get("pct_roofline") is None else f"{r['pct_roofline']:.1f}%"
    out.append(f"| {r['name'].split(':')[0]}, {r['shape']} | {r['impl']} | {seconds} | {mfu} | "
               f"{(r.get('note') or '').replace('|', '/')} |")
  return out + [""]


def _layouts_on_tpus(runs: list[Run], results: pathlib.Path) -> list[str]:
  """The sharded train step compiled for TPU slices (``python -m bench model --tpu
  --layouts``): per chip its memory against the chip's, its collectives, and the predicted
  step time."""
  sliced = lambda r: "compiled for" in r["name"] and "remat " not in r["impl"]
  run = _newest_with(runs, results, "model", keep=sliced).get("tpu_compiled")
  rows = [r for r in (run.rows if run else ()) if sliced(r)]
  if not rows:
    return []
  out = ["## Sharded model step on TPU slices (compiled, predicted)", "",
         "The train step on our kernels laid out as `python -m models.train --mesh` lays it, "
         "AOT-compiled for TPU slices from a CPU host: each chip's share of the parameters and "
         "Adam's moments, the compiled program's peak against the chip's HBM, its collectives, "
         "and the step time predicted from its cost analysis (as above: a lower bound, with no "
         f"collective time in it; MFU by PaLM's count with attention's causal half, the work the "
         f"kernels do: the full count exceeds the compiled FLOPs, and a compute-bound bound "
         f"then passes 100%) "
         f"({_link(run, results)}).", "",
         "| step | layout | predicted ms | MFU | per chip, and the program |",
         "| --- | --- | ---: | ---: | --- |"]
  for r in rows:
    ms = "" if r.get("ms") is None else f"{r['ms']:.1f}"
    mfu = "" if r.get("pct_roofline") is None else f"{r['pct_roofline']:.0f}%"
    out.append(f"| {r['name']}, {r['shape']} | {r['impl'].split(', ', 1)[-1]} | {ms} | {mfu} | "
               f"{(r.get('note') or '').replace('|', '/')} |")
  return out + [""]


def _scaling(runs: list[Run], results: pathlib.Path) -> list[str]:
  """The train step on several GPUs and ring attention (``python -m bench scaling``)."""
  out = []
  steps = _newest_with(runs, results, "scaling", keep=lambda r: "train step" in r["name"])
  rings = _newest_with(runs, results, "scaling", keep=lambda r: "attention" in r["name"])
  for folder in sorted(set(steps) | set(rings)):
    if folder == "tpu_compiled":
      continue
    by_count, ring = _by_count(runs, folder), rings.get(folder)
    ring_rows = [] if ring is None else [r for r in ring.rows
                                         if r["suite"] == "scaling" and "attention" in r["name"]]
    picked = by_count + ([(ring, ring_rows)] if ring is not None else [])
    run = picked[0][0]
    count = lambda r: int(re.search(r" on (\d+) devices", r["name"]).group(1))
    # The steps by device count (sorted is stable: the runs' order within a count), then rings.
    rows = sorted((r for _, rows in by_count for r in rows), key=count) + ring_rows
    out += [f"## Several devices: {run.device}", "",
            "The train step at one batch a device on 1 and n devices of one host, ours and "
            "plain JAX (kernels=\"xla\") on the same mesh; scaling against the same kernels on "
            "one device (tokens/s over n times one device's); memory a device measured (the "
            "allocator's peak) and compiled; on a GPU, a profile of two more steps "
            "(jax.profiler): a step's compute time a device, its collectives' (NCCL's kernels, "
            "whose time includes the wait for the slowest peer), the share of that beside "
            "compute and the rest, exposed; each device count's rows from the newest run that "
            "measured it. Then causal attention forward and backward at "
            "long sequences: one device, our ring, and cuDNN on a heads split (TFLOP/s: the "
            "call's causal work over its time, every device's together; err: against our "
            "one-device flash attention on the same inputs) ("
            + "; ".join(dict.fromkeys(_link(r, results) for r, _ in picked)) + ").",
            "", "| what | impl | ms | MFU or TFLOP/s | err | note |",
            "| --- | --- | ---: | ---: | ---: | --- |"]
    for r in rows:
      ms = "" if r.get("ms") is None else f"{r['ms']:.2f}"
      rate = (f"{r['pct_roofline']:.1f}%" if r.get("pct_roofline") is not None else
              f"{r['tflops']:.0f}" if r.get("tflops") is not None else "")
      err = "" if r.get("error") is None else f"{r['error']:.1e}"
      out.append(f"| {r['name']}, {r['shape']} | {r['impl']} | {ms} | {rate} | {err} | "
                 f"{(r.get('note') or '').replace('|', '/')} |")
    out.append("")
  return out


def _by_count(runs: list[Run], folder: str) -> list[tuple[Run, list[dict]]]:
  """The train step's rows of a device folder, each device count's from the newest run that
  measured it (a run's scaling is against its own one device: a count's rows never mix
  runs), the runs newest first."""
  taken, picked = set(), []
  for run in sorted((r for r in runs if r.path.parent.name == folder), key=lambda r: r.date,
                    reverse=True):
    rows = [r for r in run.rows if r["suite"] == "scaling" and "train step" in r["name"]
            and r["name"] not in taken]
    if rows:
      taken |= {r["name"] for r in rows}
      picked.append((run, rows))
  return picked


def _plots(runs: list[Run], by_device: dict[str, list[Line]], results: pathlib.Path,
           folder: pathlib.Path, report_dir: pathlib.Path) -> dict[str, str]:
  """The plots into ``folder``, by name -> path relative to the report; none without
  matplotlib (the bench extra)."""
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    print("plots: matplotlib is not installed (pip install -e '.[bench]'): none drawn")
    return {}
  from bench import plots
  folder.mkdir(parents=True, exist_ok=True)
  drawn = {}
  for device, device_lines in by_device.items():
    if "predicted" in device:
      continue
    name = "roofline_" + "".join(c if c.isalnum() else "_" for c in device.lower()) + ".png"
    if plots.roofline_plot(runs, device, device_lines, folder / name):
      drawn[f"roofline {device}"] = folder / name
  if plots.waves_plot(results, folder / "matmul_waves.png"):
    drawn["waves"] = folder / "matmul_waves.png"
  return {name: os.path.relpath(path, report_dir) for name, path in drawn.items()}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m bench report", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--results", default=str(ROOT.parent / "results"),
                      help="the results' folder, one subfolder a device (default: results)")
  parser.add_argument("--out", default=str(ROOT.parent / "results" / "REPORT.md"),
                      help="the report to write (in --results: it links the runs by their "
                      "paths from there)")
  parser.add_argument("--plots", default=str(ROOT.parent / "results" / "plots"),
                      help="the plots' folder (default: results/plots); the report links them "
                           "relative to itself")
  args = parser.parse_args(argv)
  results = pathlib.Path(args.results)
  if not results.is_dir():
    parser.error(f"--results {results}: no such folder")
  runs = load(results)
  by_device = lines(runs)
  out = pathlib.Path(args.out)
  drawn = _plots(runs, by_device, results, pathlib.Path(args.plots), out.parent)
  text = [render(by_device, results)]
  rooflines = [(name, path) for name, path in drawn.items() if name.startswith("roofline ")]
  if rooflines:
    text += ["## Rooflines", ""] + [f"![{name}]({path})" for name, path in rooflines] + [""]
  text += _model_on_tpus(runs, results)
  text += _published_on_tpus(runs, results)
  text += _layouts_on_tpus(runs, results)
  text += _scaling(runs, results)
  text += _lessons(runs, results, drawn)
  out.write_text("\n".join(text) + "\n")
  count = sum(map(len, by_device.values()))
  print(f"{count} shapes on {len(by_device)} devices -> {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
