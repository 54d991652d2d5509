"""Every command the README shows runs, with its own flags, at the smallest size that keeps
them meaningful: the train commands on the tiny preset over the 8 host devices with the
kernels interpreted (Triton's interpreter: every remat policy runs there), the bench as `make
bench` runs it on a CPU. A command the README shows that no size is known for fails here."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from bench import readme

ROOT = readme.ROOT
COMMANDS = readme.commands()


def _clone(tmp_path) -> pathlib.Path:
  """A directory laid out as the README's set-up leaves a clone: the repository's files
  (linked), and a ``.venv`` that is this test's environment (``make setup``'s is not made on
  CI: it installs what ``make test``'s does, without the test tools)."""
  clone = tmp_path / "clone"
  if clone.exists():
    return clone
  clone.mkdir()
  for entry in ROOT.iterdir():
    if not entry.name.startswith((".venv", ".git")):
      (clone / entry.name).symlink_to(entry)
  (clone / ".venv").symlink_to(pathlib.Path(sys.prefix))
  assert (clone / ".venv" / "bin" / "python").exists(), sys.prefix
  return clone


def _run(argv, tmp_path, timeout=600):
  """``argv`` as the README types it: ``.venv/bin/python`` from the clone's root (a bare
  ``python``, ``make bench``'s, as this test's interpreter)."""
  cwd = ROOT
  if argv[0] == ".venv/bin/python":
    cwd = _clone(tmp_path)
  else:
    argv = [sys.executable, *argv[1:]]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXKERNELS_INTERPRET": "triton",
         "PYTHONUNBUFFERED": "1"}
  env.pop("PYTHONPATH", None)  # the clone's root, where the command runs, is on the path
  done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=timeout)
  return done.returncode, done.stdout, done.stderr


def test_the_readme_shows_the_commands_this_file_runs():
  kinds = [c.kind for c in COMMANDS]
  # The two commands of the quickstart and the two of training: if a rewrite of the README
  # drops or renames them, this says so instead of testing nothing.
  assert kinds.count("train") >= 2 and "bench" in kinds and "make test" in kinds, COMMANDS
  for command in COMMANDS:
    if command.argv:  # not CI's own (.ci/run) nor the set-up
      readme.on_cpu(command, ROOT / "unused")  # raises where no CPU size is known


def test_the_set_up_is_the_install_the_commands_run_in():
  """``make setup`` builds the ``.venv`` the README's train commands name, the same install
  ``make bench`` begins with (so the GPU check's run of ``make bench`` proves it there)."""
  assert "make setup" in [c.text for c in COMMANDS]
  named = {c.argv[0] for c in COMMANDS if c.kind == "train"}
  assert named == {".venv/bin/python"}, named
  env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
  dry = lambda target: subprocess.run(  # noqa: E731 - not make's child's view (make test's)
      ["make", "-n", "-B", "--no-print-directory", target], cwd=ROOT, env=env,
      capture_output=True, text=True, check=True).stdout
  setup = dry("setup")
  assert "-m venv .venv" in setup and 'pip install -q -e ".[bench' in setup, setup
  assert dry("bench").startswith(setup), (setup, dry("bench"))


def test_a_command_of_an_unknown_kind_is_refused(tmp_path):
  page = tmp_path / "README.md"
  for command in ("make deploy", "python -m bench.gpu_check"):
    page.write_text(f"```\n{command}\n```\n")
    with pytest.raises(ValueError, match=command):
      readme.commands(page)


def test_commands_are_sized_and_keep_their_own_flags(tmp_path):
  [big] = [c for c in COMMANDS if "--remat" in c.argv] or [None]
  assert big is not None, "the README's second train command (remat auto) is gone"
  cpu = readme.on_cpu(big, tmp_path)
  assert cpu[cpu.index("--preset") + 1] == "tiny" and cpu[cpu.index("--steps") + 1] == "3"
  assert cpu[cpu.index("--remat") + 1] == "auto"  # the flag under test is kept
  assert cpu[cpu.index("--checkpoint-dir") + 1].startswith(str(tmp_path))
  gpu = readme.on_gpu(big, tmp_path)
  for flag in ("--preset", "--batch", "--seq-len", "--remat"):  # the README's own sizes
    assert gpu[gpu.index(flag) + 1] == big.argv[big.argv.index(flag) + 1]


@pytest.mark.cpu_only
@pytest.mark.parametrize("command", [c for c in COMMANDS if c.kind == "train"],
                         ids=lambda c: " ".join(c.argv[3:5]))
def test_train_command_runs(command, tmp_path):
  argv = readme.on_cpu(command, tmp_path)
  code, out, err = _run(argv, tmp_path)
  assert code == 0, err[-3000:]
  # stdout holds the run's one line, for scripts; everything else is on stderr.
  assert re.fullmatch(r"final loss \d+\.\d{4} at step 3 \([\d.]+ perplexity per byte, "
                      r"[\d,]+ tokens/s\)\n", out), out
  assert "step 3/3 loss" in err and "Traceback" not in err
  cache = argv[argv.index("--compilation-cache") + 1]
  assert os.listdir(os.path.join(cache, "jaxkernels-programs")), "no kept train step"
  if "--remat" in argv and argv[argv.index("--remat") + 1] == "auto":
    assert re.search(r"^remat auto: .* against a budget of", err, re.M), err[-3000:]
  if "--checkpoint-dir" in argv:
    directory = argv[argv.index("--checkpoint-dir") + 1]
    assert os.path.isdir(os.path.join(directory, "3")), os.listdir(directory)
    code, out, err = _run(argv, tmp_path)  # the same command again: the run is whole
    assert code == 0 and "nothing to do: the checkpoint is at step 3" in err, err[-3000:]
    assert "remat auto:" not in err, "a finished run probed remat plans it will not train"
    assert os.listdir(os.path.join(os.path.dirname(directory), "xla")), "no compilation cache"


@pytest.mark.cpu_only
@pytest.mark.parametrize("command", [c for c in COMMANDS if c.kind == "bench"],
                         ids=lambda c: c.text)
def test_bench_command_runs_and_reads(command, tmp_path):
  """What a person reads on a CPU: one notice that the rows check correctness, a legend of
  the columns, each row once, paths relative to the repository or the home directory."""
  argv = readme.on_cpu(command, tmp_path)
  code, out, err = _run(argv, tmp_path, timeout=900)
  assert code == 0, err[-3000:]
  [path] = (tmp_path / "bench").glob("*.json")
  record = json.loads(path.read_text())
  assert record["interpret_mode"] and record["smoke"] and record["commit"]
  assert record["command"].startswith("python -m bench")
  lines = out.splitlines()
  assert sum("INTERPRET mode" in line for line in lines) == 1
  start = lines.index("Columns:")
  legend = [line.split()[0] for line in lines[start + 1:] if line.startswith("  ")]
  header = lines[start + 1 + len(legend)].split()
  assert header == legend and header[:6] == ["suite", "op", "impl", "shape", "dtype", "ms"]
  assert "GB/s" not in header  # no rates from an interpreter
  body = lines[start + 2 + len(legend):-1]
  rows = [line for line in body if not line.startswith("[")]
  assert len(rows) == len(record["rows"]), "each row printed once"
  named = [row[:lines[start + 1 + len(legend)].index("  ms")] for row in rows]
  assert len(set(named)) == len(named), "two rows a reader cannot tell apart"
  for row in record["rows"]:
    ours = row["impl"] not in ("xla",) and row["suite"] != "anchor"
    assert not (ours and row["note"].startswith(("FAILED", "WRONG"))), row
  assert re.fullmatch(rf"{len(rows)} rows, 0 over their tolerance; results: \S+",
                      lines[-1]), lines[-1]
  assert not re.search(r"(^|\s)/(root|work|home|tmp)/", lines[-1].replace(str(tmp_path), "")), (
      lines[-1])
  assert all(len(line) <= 400 for line in lines), "no line a person cannot read"


def test_the_install_line_names_extras_the_package_has():
  """The "use it in your project" line (not run here: it needs the network) installs as
  ``make setup`` does, with extras the package declares, and the JAX range the README gives
  is the one the package requires at its floor."""
  import tomllib
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  lines = [line for line in readme.fenced_lines(readme.README) if line.startswith("pip ")]
  assert lines, "the README's install line is gone"
  for line in lines:
    [spec] = re.findall(r'pip install -e "path/to/jaxkernels\[(\w+)\]"', line) or [None]
    assert spec in project["optional-dependencies"], line
    for extra in re.findall(r"\[(\w+)\]: jax\[(\w+)\]", line):
      assert any(f"jax[{extra[1]}]" in d for d in project["optional-dependencies"][extra[0]])
  assert "jax>=0.10.2" in project["dependencies"]
  assert "jax 0.10.2 to 0.12" in readme.README.read_text()
