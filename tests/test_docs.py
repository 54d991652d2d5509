"""The README and docs/ stay true: a landing page of at most 300 lines; every link, path,
module, command and public name they cite exists; docs/layout.md names every module."""

from __future__ import annotations

import glob
import importlib
import importlib.util
import pathlib
import re
import shlex

import pytest

import jaxkernels
from bench import readme

ROOT = readme.ROOT
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("jaxkernels", "models", "bench", "tests", "docs", ".ci")
OPS = sorted(p.name for p in (ROOT / "jaxkernels" / "ops").iterdir()
             if (p / "api.py").exists())


def _prose(page: pathlib.Path):
  """(line number, line) of ``page`` outside its fenced blocks."""
  fenced = False
  for number, line in enumerate(page.read_text().splitlines(), 1):
    if line.startswith("```"):
      fenced = not fenced
    elif not fenced:
      yield number, line


def _matches(cited: str) -> list[str]:
  """The files a cited path names: ``<op>`` any op's folder, ``<device>`` any device's,
  ``*`` a glob, a leading ``...`` any folder of results/."""
  cited = cited.rstrip(",.;:")
  if cited.startswith("..."):
    cited = "results/**/*" + cited[3:].lstrip("/")
  pattern = re.sub(r"<[a-z_]+>", "*", cited)
  return glob.glob(str(ROOT / pattern), recursive=True)


def test_the_readme_is_a_landing_page():
  lines = (ROOT / "README.md").read_text().splitlines()
  assert len(lines) <= 300, f"README.md is {len(lines)} lines; the reference goes in docs/"
  long = [(n, len(line)) for n, line in _prose(ROOT / "README.md")
          if len(line) > 100 and not line.startswith("|")]
  assert not long, f"prose lines over 100 characters: {long}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_and_paths_exist(page):
  missing = []
  for number, line in _prose(page):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", line):
      if not target.startswith("http") and not (page.parent / target).exists():
        missing.append((number, target))
    for cited in re.findall(r"`([^`\s]+)`", line):
      looks_like_path = ("/" in cited and re.fullmatch(r"[\w.*<>~/-]+", cited)
                         and (cited.split("/")[0] in TOP or cited.startswith("...")))
      if looks_like_path and not _matches(cited):
        missing.append((number, cited))
  assert not missing, f"{page.name} cites what does not exist: {missing}"


def _names(page):
  """Public names cited as ``jk.name`` or ``jaxkernels.a.b`` in prose and Python blocks."""
  for name in re.findall(r"`(?:jk|jaxkernels)((?:\.\w+)+)", page.read_text()):
    yield name.lstrip(".")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_cited_names_resolve(page):
  unresolved = []
  for dotted in sorted(set(_names(page))):
    thing, parts = jaxkernels, dotted.split(".")
    for i, part in enumerate(parts):
      if hasattr(thing, part):
        thing = getattr(thing, part)
        continue
      module = "jaxkernels." + ".".join(parts[:i + 1])
      if importlib.util.find_spec(module) is None:
        unresolved.append(dotted)
        break
      thing = importlib.import_module(module)
  assert not unresolved, f"{page.name} names what jaxkernels lacks: {unresolved}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_cited_commands_exist(page):
  """Every ``python -m X`` names a module there is; every train command's flags parse."""
  text = page.read_text()
  bad = []
  for module in sorted(set(re.findall(r"python -m ([\w.]+)", text))):
    if module not in ("pytest", "pip") and importlib.util.find_spec(module) is None:
      bad.append(module)
  from bench import __main__ as bench_main
  from models import train
  parsers = {"models.train": train.parser(), "bench": bench_main.parser()}
  spans = re.findall(r"`(python -m [^`]+)`", text)  # a code span may wrap a line
  fenced = [line.split(" #")[0] for line in readme.fenced_lines(page)]
  for command in [" ".join(c.split()) for c in spans + fenced]:
    found = re.match(r"python -m (models\.train|bench)(?= |$)(.*)", command)
    if found is None:
      continue
    module, argv = found.group(1), shlex.split(found.group(2))
    if argv[:1] == ["report"] or any("[" in a or "..." in a for a in argv):
      continue  # report parses its own flags; a synopsis or an elided command
    try:
      parsers[module].parse_args(argv)
    except SystemExit as e:
      if e.code:
        bad.append(command)
  assert not bad, f"{page.name}: {bad}"


def test_layout_names_every_module_and_nothing_else():
  page = (ROOT / "docs/layout.md").read_text()
  named = set(re.findall(r"^\| `([^`]+)` \|", page, re.M))
  for cited in named:
    assert _matches(cited), f"the layout page names {cited}, which does not exist"
  patterns = [re.compile("^" + re.escape(n).replace(re.escape("<op>"), "(" + "|".join(OPS) + ")")
                         + ("" if not n.endswith("/") else ".*") + "$") for n in named]
  files = [p.relative_to(ROOT).as_posix() for top in ("jaxkernels", "models", "bench")
           for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts]
  unnamed = [f for f in files
             if not any(p.match(f) for p in patterns if not p.pattern.endswith("/.*$"))]
  assert not unnamed, f"the layout page (docs/layout.md) does not name: {unnamed}"


def test_committed_results_carry_no_machines_paths_and_stay_readable():
  """results holds what a reader can open: no file over 256 KiB, and no path of the
  machine a run ran on (``bench.harness.scrub`` takes them out as a run writes)."""
  results = ROOT / "results"
  machine = re.compile(r"(?<![\w.~<>$-])/(root|work|home|tmp|opt|usr|mnt)/\w")
  found = []
  for path in sorted(p for p in results.rglob("*") if p.is_file()):
    if path.stat().st_size > 256 << 10:
      found.append(f"{path.relative_to(ROOT)}: {path.stat().st_size} bytes")
    if path.suffix in (".json", ".jsonl", ".log", ".txt", ".md", ".csv"):
      for number, line in enumerate(path.read_text().splitlines(), 1):
        if machine.search(line):
          found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
          break
  assert not found, "\n".join(found)
