"""python -m models.train --preset tiny [--steps N] [--checkpoint-dir DIR] ...

Trains the Llama model (``models.llama``) on a byte-level text corpus: optax's AdamW under a
linear warmup and cosine decay, with the gradients' global norm clipped; a progress bar with
the loss, tokens/s and MFU; orbax checkpoints. Run again with the same ``--checkpoint-dir`` and
it resumes where the last checkpoint stopped, on the same batches, to the same loss curve as a
run that was never stopped: the batch of step s is drawn from (seed, s) alone, and the
checkpoint holds the parameters, the optimizer's state and its step.

The corpus is the text of the Python standard library's modules (``--corpus`` takes a file or
a directory of text instead): nothing is fetched. Tokens are bytes (the presets' vocabularies
are at least 256).

The step runs on a mesh of every local device with axes ``data``, ``fsdp``, ``tensor`` and
``sequence`` (``--mesh data=2,fsdp=2,tensor=2``: an axis left out is 1, fsdp takes the devices
the others leave): the parameters and the optimizer's state laid out by their logical names
(``llama.place``: each weight's width over fsdp, its heads, MLP width or vocabulary over
tensor), the batch split over data and fsdp, the sequence over sequence. The layout chosen
and what it costs a device (parameters, optimizer state, the compiled step's activations) are
printed before the first step. On GPUs the step compiles with XLA's collective combiner
thresholds raised (``GPU_COMBINE_BYTES``: a layer's gradients leave as one collective); an
``XLA_FLAGS`` that sets one of them wins.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import signal
import sys
import warnings

import jax

from jaxkernels import FallbackWarning, ShardingWarning, remat
from models import llama
from models.hparams import TrainConfig, UsageError, flag
from models.loop import Outcome, abandoned, train
from models.placement import distributed, parse_mesh
from models.train_step import default_compilation_cache

class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
  """The module's docstring as written, and every flag's default in --help (where its help
  does not already say it)."""

  def _get_help_string(self, action):
    if action.default is None or action.default is False or "default" in (action.help or ""):
      return action.help
    return super()._get_help_string(action)


_FLAG_HELP = {
    "steps": "steps to train to (a resumed run counts from its checkpoint)",
    "batch": "sequences a step", "seq_len": "tokens a sequence",
    "learning_rate": "AdamW's peak learning rate",
    "warmup": "steps of linear warmup (default: a tenth of --steps, at most 30)",
    "final_lr_ratio": "the cosine decays to --learning-rate times this",
    "weight_decay": "AdamW's, on the weight matrices", "clip": "the gradients' global norm",
    "seed": "of the parameters and the batches"}


class _Parser(argparse.ArgumentParser):
  """A bad flag is one line on stderr and exit status 2, as every other usage error of the
  CLI is (argparse's own prints the whole usage first: 20 lines to find one)."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message} (--help lists every flag)\n")


def _at_least_1(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1")
  return value


def _gib(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not 0 < value < math.inf:
    raise argparse.ArgumentTypeError(f"{text!r} must be a number of GiB > 0")
  return value


def _reference_ops(text: str) -> tuple[str, ...]:
  ops = tuple(op.strip() for op in text.split(",") if op.strip())
  if unknown := [op for op in ops if op not in llama.OPS]:
    raise argparse.ArgumentTypeError(f"{text!r}: {', '.join(map(repr, unknown))} is not one "
                                     f"of {', '.join(llama.OPS)}")
  return ops


def train_flags():
  """TrainConfig's fields that the CLI sets, one flag each."""
  return [f for f in dataclasses.fields(TrainConfig) if f.init]


def parser() -> argparse.ArgumentParser:
  """The CLI's flags."""
  parser = _Parser(prog="python -m models.train", description=__doc__,
                   formatter_class=_Formatter)
  parser.add_argument("--preset", default="tiny", choices=llama.PRESETS,
                      help=f"one of {', '.join(llama.PRESETS)}")
  parser.add_argument("--kernels", default="jaxkernels", choices=llama.KERNELS,
                      help=f"one of {', '.join(llama.KERNELS)}")
  parser.add_argument("--reference-ops", default=None, type=_reference_ops, help="with the "
                      "kernels: these op "
                      f"groups (comma-separated, of {', '.join(llama.OPS)}) run as --kernels xla "
                      "runs them, to find which kernel a difference comes from (default: none "
                      f"on a GPU; on a TPU {','.join(llama.TPU_REFERENCE_OPS)}, which XLA:TPU "
                      "fuses into its dots)")
  parser.add_argument("--remat", default=None, choices=(*remat.POLICIES, "auto"),
                      help=f"one of {', '.join(remat.POLICIES)}, or auto (default: the "
                      "preset's, none)")
  parser.add_argument("--stream", default="float32", choices=llama.STREAMS,
                      help=f"the residual stream's dtype, one "
                      f"of {', '.join(llama.STREAMS)} (a 16-bit one, as plain-JAX Llamas keep "
                      "it, halves its traffic; float32 keeps every layer's sum exact to f32)")
  parser.add_argument("--fp8", action="store_true", help="the blocks' products in fp8, "
                      "forward and backward (e4m3, DeepSeek-V3's block scales; one device)")
  parser.add_argument("--remat-budget", type=_gib, default=None, help="GiB a device for "
                      "--remat auto (default: 95%% of the device's memory)")
  for field in train_flags():
    kind = int if field.name == "warmup" else type(field.default)
    parser.add_argument(f"--{flag(field.name)}", type=kind, default=field.default,
                        help=_FLAG_HELP[field.name])
  parser.add_argument("--corpus", default=None, help="a text file or directory (default: the "
                      "Python standard library's modules)")
  parser.add_argument("--checkpoint-dir", default=None, help="resume from it, save into it")
  parser.add_argument("--checkpoint-every", type=_at_least_1, default=100, help="steps between "
                      "checkpoints (and at the end, and on SIGINT/SIGTERM)")
  parser.add_argument("--mesh", default="", help="devices on each mesh axis, e.g. "
                      "data=2,fsdp=2,tensor=2,sequence=1: the axes are "
                      f"{', '.join(llama.MESH_AXES)}; one left out is 1, fsdp takes the devices "
                      "the others leave (default: every device on fsdp)")
  parser.add_argument("--distributed", action="store_true", help="one process of a run on "
                      "several hosts: jax.distributed.initialize() from the cluster's "
                      "environment (a Cloud TPU pod slice, SLURM), or from --coordinator")
  parser.add_argument("--coordinator", default=None, help="HOST:PORT of process 0, for "
                      "--distributed where no cluster environment says it")
  parser.add_argument("--num-processes", type=int, default=None, help="with --coordinator")
  parser.add_argument("--process-id", type=int, default=None, help="with --coordinator")
  parser.add_argument("--metrics", default=None, help="append each step's numbers here (JSON "
                      "lines)")
  parser.add_argument("--log-every", type=_at_least_1, default=10, help="steps between progress lines "
                      "(redrawn in place on a terminal)")
  parser.add_argument("--compilation-cache", default=default_compilation_cache(),
                      help="JAX's persistent compilation cache: a second run of the same "
                      "step loads its compiled program from here")
  parser.add_argument("--no-compilation-cache", action="store_true",
                      help="compile everything afresh, and write no cache")
  return parser


def writable(flag: str, path: str, *, directory: bool) -> None:
  """Raises a UsageError naming ``flag`` where ``path`` (a directory, or a file appended to)
  could not be made or written, so that a run finds out before it compiles, not at its first
  save; writes nothing (a refused run leaves no directory behind)."""
  path = os.path.abspath(path)
  if os.path.exists(path):
    if directory != os.path.isdir(path):
      kind = ("a file, not a directory" if directory else "a directory, not a file")
      raise UsageError(f"{flag} {path}: is {kind}")
    there = path
  else:  # the nearest part of it that exists must be a directory this user may write in
    there = os.path.dirname(path)
    while not os.path.exists(there):
      there = os.path.dirname(there)
    if not os.path.isdir(there):
      raise UsageError(f"{flag} {path}: cannot be made: {there} is a file, not a directory")
  if not os.access(there, os.W_OK | (os.X_OK if os.path.isdir(there) else 0)):
    raise UsageError(f"{flag} {path}: cannot be written: {there} is not writable by this "
                     "user; pass a path that is")


def configured(args) -> tuple[llama.Config, TrainConfig]:
  """The model's and the run's configuration from the flags, every flag checked and every
  path it writes tried, before anything is traced: a UsageError names the flag."""
  changes = {"kernels": args.kernels, "stream": args.stream,
             "reference_ops": args.reference_ops or None}
  if args.remat is not None:
    changes["remat"] = args.remat
  if args.fp8:
    changes["fp8"] = True
  try:  # each value a choice argparse checked; what the Config checks across them remains
    cfg = llama.preset(args.preset, **changes)
  except ValueError as e:  # --fp8 on a preset whose widths are not multiples of 128, say
    given = " ".join(f"--{flag(k)}" + ("" if v is True else f" {v}") for k, v in changes.items()
                     if v not in (None, llama.Config.__dataclass_fields__[k].default))
    raise UsageError(f"--preset {args.preset} {given}: {str(e).removeprefix('Config: ')}"
                     ) from e
  tc = TrainConfig(**{f.name: getattr(args, f.name) for f in train_flags()})
  if tc.seq_len > cfg.max_len:
    raise UsageError(f"--seq-len {tc.seq_len} is longer than the preset's max_len "
                     f"{cfg.max_len}")
  if args.remat_budget is not None and cfg.remat != "auto":
    raise UsageError(f"--remat-budget {args.remat_budget:g}: only --remat auto reads it "
                     f"(this run's remat is {cfg.remat})")
  if args.checkpoint_dir is not None:
    writable("--checkpoint-dir", args.checkpoint_dir, directory=True)
  if args.metrics is not None and jax.process_index() == 0:  # process 0 writes them
    writable("--metrics", args.metrics, directory=False)
  if not args.no_compilation_cache:
    writable("--compilation-cache", args.compilation_cache, directory=True)
  return cfg, tc


def _said(message, category, filename, lineno, file=None, line=None):
  """How the run shows a warning: the library's (which kernel serves, how a split is read)
  as their one line, with no source path; anything else as Python shows it."""
  if issubclass(category, (FallbackWarning, ShardingWarning)):
    print(str(message), file=file or sys.stderr, flush=True)
  else:
    _show(message, category, filename, lineno, file, line)


_show = warnings.showwarning


def main(argv=None) -> int:
  try:
    args = parser().parse_args(argv)
  except SystemExit as e:  # --help (0), or a bad flag (2: its one line is on stderr)
    return e.code
  if args.coordinator is not None or args.num_processes is not None or (
      args.process_id is not None):
    args.distributed = True
  try:
    if args.distributed:
      distributed(args.coordinator, args.num_processes, args.process_id)
    mesh_sizes = parse_mesh(args.mesh)
    cfg, tc = configured(args)
    if not args.no_compilation_cache:
      jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
    with warnings.catch_warnings():
      warnings.showwarning = _said
      outcome = train(cfg, tc, corpus_path=args.corpus, checkpoint_dir=args.checkpoint_dir,
                      checkpoint_every=args.checkpoint_every, mesh_sizes=mesh_sizes,
                      metrics_path=args.metrics, log_every=args.log_every,
                      remat_budget=None if args.remat_budget is None else
                      int(args.remat_budget * 2**30))
  except UsageError as e:
    print(f"python -m models.train: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:  # before the loop's own handler was in place: nothing ran yet
    print("python -m models.train: interrupted before the first step; nothing saved",
          file=sys.stderr)
    if jax.process_index() == 0:
      print("interrupted before the first step; nothing saved", flush=True)
    return 128 + signal.SIGINT
  if outcome.stopped:
    print(f"python -m models.train: {outcome.stopped}", file=sys.stderr)
  if outcome.code != 1 and jax.process_index() == 0 and (outcome.losses or outcome.code):
    print(summary(outcome), flush=True)
  return outcome.code


def summary(outcome: Outcome) -> str:
  """The run's one line on stdout, for scripts. A finished run: ``final loss L at step S``,
  then the perplexity a byte and the last interval's tokens/s. One a signal stopped:
  ``interrupted at step S by SIGINT``, its last loss, and whether it saved there."""
  if outcome.code > 1:  # 128 + a signal's number
    name = signal.Signals(outcome.code - 128).name
    loss = f": loss {outcome.losses[-1]:.4f}" if outcome.losses else ""
    return (f"interrupted at step {outcome.step or 0} by {name}{loss}; "
            + (f"saved at step {outcome.saved}" if outcome.saved is not None else
               "nothing saved"))
  loss = outcome.losses[-1]
  rate = f", {outcome.tokens_per_s:,.0f} tokens/s" if outcome.tokens_per_s else ""
  return (f"final loss {loss:.4f} at step {outcome.step} ({math.exp(min(loss, 50)):.2f} "
          f"perplexity per byte{rate})")


if __name__ == "__main__":
  status = main()
  if abandoned():  # a second Ctrl-C left a wait for the device behind: leave without it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
  sys.exit(status)
