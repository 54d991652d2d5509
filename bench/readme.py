"""The commands the README shows, found in it, and each sized for where it runs.

Every command in a fenced block of README.md that starts with ``make``, or runs
``models.train`` or ``bench`` with ``-m`` under ``python`` or the set-up's ``.venv/bin/python``,
is one the README promises runs. The CPU tests run each
one (``tests/test_readme.py``) at the smallest size that keeps its flags meaningful: the tiny
preset, a few steps, the kernels interpreted. The GPU check (``bench/gpu_check.py``) runs each
one at the README's own sizes for a few steps. A command of a kind this module cannot size is
an error, so a new command in the README cannot go untested.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shlex

ROOT = pathlib.Path(__file__).parent.parent
README = ROOT / "README.md"

# What ``make bench`` runs; ``make test`` is CI's own command (.ci/run), not run again here,
# and ``make setup`` the install ``make bench`` begins with (its target's prerequisite: a test
# holds the Makefile to it).
MAKE = {"make bench": ("python", "-m", "bench"), "make test": None, "make setup": None}
PYTHONS = ("python", ".venv/bin/python")  # the interpreters a README command may name
KINDS = {"models.train": "train", "bench": "bench"}  # python -m X: what this module sizes


@dataclasses.dataclass(frozen=True)
class Command:
  text: str  # as the README shows it, its comment dropped
  line: int  # where, 1-based

  @property
  def argv(self) -> tuple[str, ...]:
    """The command as a process runs it (``make bench`` as what it runs)."""
    if self.text in MAKE:
      return MAKE[self.text] or ()
    return tuple(shlex.split(self.text))

  @property
  def kind(self) -> str:
    """"train", "bench", or the make command's text."""
    argv = self.argv
    return KINDS[argv[2]] if argv else self.text


def fenced_lines(path: pathlib.Path, numbered: bool = False):
  """The lines of ``path``'s shell blocks (fenced, no language or a shell's; not Python)."""
  fence = None
  for number, line in enumerate(path.read_text().splitlines(), 1):
    if line.startswith("```"):
      fence = None if fence is not None else line[3:].strip()
    elif fence in ("", "sh", "bash", "console"):
      yield (number, line) if numbered else line


def commands(path: pathlib.Path = README) -> list[Command]:
  """The runnable commands of ``path``'s shell blocks, in order."""
  found = []
  for number, line in fenced_lines(path, numbered=True):
    text = line.split(" #")[0].strip()
    if not text.startswith(("make ", *(f"{python} -m " for python in PYTHONS))):
      continue
    words = text.split()
    known = text in MAKE or (len(words) > 2 and words[2] in KINDS)
    if not known:  # shown to users, so it must run: this module must learn to size it
      raise ValueError(f"README.md:{number}: {text!r}: a command this module does not run; "
                       f"known: {', '.join(MAKE)}, {{{', '.join(PYTHONS)}}} -m "
                       f"{{{', '.join(KINDS)}}}")
    found.append(Command(text, number))
  return found


def _set(argv: list[str], flag: str, value: str | None) -> list[str]:
  """``argv`` with ``flag`` set to ``value`` (replaced where present, else appended); a
  ``value`` of None adds ``flag`` alone."""
  argv = list(argv)
  if flag in argv:
    i = argv.index(flag)
    if value is not None:
      argv[i + 1] = value
    return argv
  return argv + ([flag] if value is None else [flag, value])


def _paths(argv: list[str], workdir: pathlib.Path) -> list[str]:
  """``argv`` with the directories it writes (checkpoints, metrics, results) under
  ``workdir``, so that a run writes nothing into the repository."""
  for flag in ("--checkpoint-dir", "--metrics", "--out", "--compilation-cache"):
    if flag in argv:
      argv = _set(argv, flag, str(workdir / pathlib.Path(argv[argv.index(flag) + 1]).name))
  return argv


def on_cpu(command: Command, workdir: pathlib.Path) -> list[str]:
  """``command`` at the smallest size that keeps its flags meaningful on a 2-core CPU: the
  tiny preset, 8 sequences of 32 tokens (one a host device), 3 steps, every other flag as the
  README gives it, JAX's compilation cache (on by default) under ``workdir`` as on a GPU;
  the bench's suites at one round of one call (a check, not a timing)."""
  argv = _paths(list(command.argv), workdir)
  if command.kind == "train":
    for flag, value in (("--preset", "tiny"), ("--batch", "8"), ("--seq-len", "32"),
                        ("--steps", "3"), ("--log-every", "1")):
      argv = _set(argv, flag, value)
    return argv if "--compilation-cache" in argv else _set(
        argv, "--compilation-cache", str(workdir / "xla"))
  if command.kind == "bench":
    argv = _set(_set(argv, "--rounds", "1"), "--calls", "1")
    return argv if "--out" in argv else _set(argv, "--out", str(workdir / "bench"))
  raise ValueError(f"README.md:{command.line}: {command.text!r} has no CPU size")


def on_gpu(command: Command, workdir: pathlib.Path, steps: int = 6) -> list[str]:
  """``command`` at the README's own sizes, ``steps`` steps of it (a train command), its
  files under ``workdir``; the bench at three rounds."""
  argv = _paths(list(command.argv), workdir)
  if command.kind == "train":
    argv = _set(_set(argv, "--steps", str(steps)), "--log-every", "1")
    return argv if "--compilation-cache" in argv else _set(
        argv, "--compilation-cache", str(workdir / "xla"))
  if command.kind == "bench":
    argv = _set(argv, "--rounds", "3")
    return argv if "--out" in argv else _set(argv, "--out", str(workdir / "bench"))
  raise ValueError(f"README.md:{command.line}: {command.text!r} has no GPU size")
