"""python -m bench [suite ...] [--smoke] [--sweep] [--out DIR]; python -m bench report

Runs the suites on whatever device JAX sees, with the anchors measured in the
same run, prints a table, and writes the results as JSON under
results/<device>/ (or --out), row by row: a run cut off keeps what it measured.
Where the tree travelled without its .git, JAXKERNELS_COMMIT names the commit. On a CPU the default is the smoke size and
the Pallas kernels run in interpret mode: numbers for correctness, not speed.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

from bench import (attention, ceilings, cross_entropy, elementwise, harness, lessons, matmul,
                   model, norms, report, scaling, sharding, softmax)

SUITES = {
    "norms": norms.run,
    "elementwise": elementwise.run,
    "softmax": softmax.run,
    "cross_entropy": cross_entropy.run,
    "ceilings": ceilings.run,
    "matmul": matmul.run,
    "sharding": sharding.run,
    "attention": attention.run,
    "model": model.run,
    "lessons": lessons.run,
    "scaling": scaling.run,
}
DEFAULT = ("norms", "elementwise", "softmax")
# --smoke (the default on a CPU): every op family, at small shapes, each checked against its
# reference.
SMOKE = ("norms", "elementwise", "softmax", "cross_entropy", "matmul", "attention")


def parser() -> argparse.ArgumentParser:
  """The command's flags (``report`` has its own: ``bench.report``)."""
  parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("suites", nargs="*", choices=[*SUITES, []], default=[],
                      help=f"suites to run (default: {', '.join(DEFAULT)}; with --smoke: "
                           f"{', '.join(SMOKE)})")
  parser.add_argument("--smoke", action="store_true", help="small shapes (default on a CPU)")
  parser.add_argument("--sweep", action="store_true", help="also time candidate kernel configs")
  parser.add_argument("--rounds", type=int, default=None, help="timing rounds (median taken)")
  parser.add_argument("--calls", type=int, default=10, help="back-to-back calls per round")
  parser.add_argument("--step", type=int, default=128, help="matmul --sweep: size step")
  parser.add_argument("--sweep-range", default="1024:8192",
                      help="matmul --sweep: first:last size (a long sweep may need two runs)")
  parser.add_argument("--tune", action="store_true", help="matmul: autotune ours first")
  parser.add_argument("--only", default=None,
                      help="matmul: run only these parts, comma-separated (checks,headline,sweep,glu); "
                           "attention: only these shapes, by name; model: only these presets; scaling: steps, "
                           "ring, and device counts (1,4: only those)")
  parser.add_argument("--remat", action="store_true",
                      help="model: every remat policy and auto, with the largest batch each fits")
  parser.add_argument("--policies", default=None,
                      help="model: only these remat policies, comma-separated (with --remat, "
                           "auto runs when none and full are among them)")
  parser.add_argument("--compile", action="store_true",
                      help="model: what the train step spends before its first step, cold and "
                           "in a second run (persistent cache), ours against plain JAX's")
  parser.add_argument("--unrolled", action="store_true",
                      help="model: the unrolled layers only (not the scanned rows)")
  parser.add_argument("--tpu", action="store_true",
                      help="model: the train step AOT-compiled for v5e, v5p and v6e, each remat "
                           "policy's compiled peak memory; lessons: fusion's bytes and tiling's "
                           "VMEM compiled for them (any host; needs libtpu)")
  parser.add_argument("--streams", default=None,
                      help="model --tpu: our step's residual-stream dtypes, comma-separated "
                           "(default float32,bfloat16; plain JAX's is bfloat16)")
  parser.add_argument("--layouts", action="store_true",
                      help="model --tpu: the sharded train steps (1b under fsdp and fsdp x "
                           "tensor on 4 chips of v5p and v6e, the 8b on 8 of v5p): per-chip "
                           "memory, collectives and predicted step time")
  parser.add_argument("--published", action="store_true",
                      help="model --tpu: the predictor against published TPU runs (MaxText's "
                           "Llama 3.1 8B on v6e): the same step predicted beside the published "
                           "rate")
  parser.add_argument("--out", default=None, help="directory for the JSON (default "
                      "results/<device>; --smoke: ~/.cache/jaxkernels/bench-smoke/<device>)")
  return parser


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] == ["report"]:  # from the committed results: no device, no suite run
    return report.main(argv[1:])
  args = parser().parse_args(argv)
  if args.tpu and args.out is None:  # compiled for TPUs from this host: their own folder
    args.out = str(harness.RESULTS / "tpu_compiled")

  on_cpu = jax.devices()[0].platform == "cpu"
  # --tpu compiles for TPUs at full size from any host: not a smoke run, though on a CPU.
  smoke = args.smoke or (on_cpu and not args.tpu)
  # On a CPU the kernels are interpreted: a row is a check, and its ms the interpreter's (one
  # round after one warm-up call; three of each cost the README's make bench 2x its time).
  session = harness.Session(smoke=smoke, rounds=args.rounds or (1 if on_cpu else 20),
                            calls=args.calls if not on_cpu else 1)
  print(harness.environment_line(session), flush=True)
  session.printer = harness.Table(session.interpret)
  session.printer.header()
  suites = args.suites or list(SMOKE if smoke else DEFAULT)
  path = harness.save(session, suites, args.out)
  session.on_row = lambda: harness.save(session, suites, args.out, path)
  harness.copy_bandwidth(session)
  only = args.only.split(",") if args.only else None
  policies = args.policies.split(",") if args.policies else None
  for name in suites:
    began, rows = time.perf_counter(), len(session.rows)
    if name == "ceilings":
      SUITES[name](session)
    elif name == "matmul":
      matmul.run(session, sweep=args.sweep, step=args.step, tune_first=args.tune,
                 sweep_range=tuple(int(v) for v in args.sweep_range.split(":")), only=only)
    elif name == "attention":
      attention.run(session, sweep=args.sweep, only=only)
    elif name == "scaling":
      scaling.run(session, only=only)
    elif name == "model" and args.tpu and args.published:
      model.tpu_published(session)
    elif name == "model" and args.tpu and args.layouts:
      model.tpu_layouts(session)
    elif name == "model" and args.tpu:
      model.tpu_compiled(session, policies=policies, presets=only,
                         streams=args.streams.split(",") if args.streams else None)
    elif name == "lessons" and args.tpu:
      lessons.tpu_compiled(session)
    elif name == "model" and args.compile:
      model.run_compile(session, only=only)
    elif name == "model" and args.remat:
      model.run_remat(session, only=only, policies=policies)
    elif name == "model":
      model.run(session, only=only, policies=policies, unrolled=args.unrolled)
    else:
      SUITES[name](session, sweep=args.sweep)
    print(f"({name}: {len(session.rows) - rows} rows in {time.perf_counter() - began:.0f} s)",
          file=sys.stderr, flush=True)
  if session.platform == "gpu":  # the copy again: a drop means the card throttled mid-run
    harness.copy_bandwidth(session).name = "copy (end of run)"
  harness.save(session, suites, args.out, path)
  session.printer.footer()
  failed = [r for r in session.rows if r.error is not None and r.tolerance is not None
            and not r.error <= r.tolerance]
  print(f"{len(session.rows)} rows, {len(failed)} over their tolerance; "
        f"results: {harness.shown_path(path)}")
  if not session.smoke:
    print(f"report: {harness.shown_path(harness.RESULTS / 'REPORT.md')} (every device, every op "
          "against its anchors; `python -m bench report` rebuilds it from results/)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
