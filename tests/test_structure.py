"""The shape of the package, read from its source: how modules import each other, and how
kernels are reached. Reading imports (not importing) sees the lazy ones inside functions too."""

from __future__ import annotations

import ast
import inspect
import re
import pathlib

import pytest

import jaxkernels as jk
from jaxkernels import backend, dispatch, tuning

PACKAGE = pathlib.Path(jk.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
  """The jaxkernels modules ``name`` imports, anywhere in its body."""
  path = MODULES[name]
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] +
                        ([base] if base else []))
      # `from a import b` imports a, or the module a.b where there is one
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                 for a in node.names]
    else:
      continue
    found |= {t for t in targets if t in MODULES and t != name}
  return found


GRAPH = {name: _imports(name) for name in MODULES}


def _op_of(name: str) -> str | None:
  parts = name.split(".")
  return parts[2] if len(parts) > 2 and parts[1] == "ops" else None


def test_the_import_graph_has_no_circle():
  """Every import reachable from a module leads away from it (a package's __init__ re-exporting
  its own modules is the one way back, and is not a circle of work)."""
  def reaches(start):
    seen, stack = set(), [start]
    while stack:
      for nxt in GRAPH[stack.pop()]:
        if nxt not in seen and not MODULES[nxt].name == "__init__.py":
          seen.add(nxt)
          stack.append(nxt)
    return seen

  circles = [name for name in MODULES
             if MODULES[name].name != "__init__.py" and name in reaches(name)]
  assert not circles, f"modules that import themselves through others: {circles}"


def test_no_module_patches_another_at_import():
  """No module sets another module's attribute when it is imported (``other.hook = ...``):
  what a module does depends on what it is given, not on which modules happened to be
  imported (backend once patched partitioning's nesting switch this way)."""
  patches = []
  for name, path in MODULES.items():
    imported = {alias.asname or alias.name.split(".")[0]
                for node in ast.parse(path.read_text()).body
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    for node in ast.parse(path.read_text()).body:
      targets = node.targets if isinstance(node, ast.Assign) else (
          [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
      for target in targets:
        if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
            and target.value.id in imported):
          patches.append(f"{name}:{node.lineno}: {ast.unparse(target)}")
  assert not patches, patches


def test_no_op_imports_another_ops_modules():
  """Shared helpers live in jaxkernels/_*.py (toolchains, tiling, the online softmax), not in
  one op's backend module that another op reaches into. An op may compose another through
  its api module, which dispatches (matmul(glu=True) runs glu where no kernel fuses it)."""
  crossing = sorted((name, dep) for name, deps in GRAPH.items() for dep in deps
                    if _op_of(name) and _op_of(dep) and _op_of(name) != _op_of(dep)
                    and not dep.endswith(".api"))
  assert not crossing, crossing
  composing = sorted((name, dep) for name, deps in GRAPH.items() for dep in deps
                     if _op_of(name) and _op_of(dep) and _op_of(name) != _op_of(dep))
  assert composing == [("jaxkernels.ops.matmul.api", "jaxkernels.ops.elementwise.api")]


# Above the ops: the package's API and the Flax layers built on it.
ABOVE_OPS = {"jaxkernels", "jaxkernels.flax", "jaxkernels.fp8"}  # built on the ops


def test_the_library_core_imports_no_op():
  """backend, tuning and the toolchain modules are below every op: the ops register with them."""
  core = [name for name in MODULES if _op_of(name) is None and name not in ABOVE_OPS]
  assert core
  reaching = sorted((name, dep) for name in core for dep in GRAPH[name] if _op_of(dep))
  assert not reaching, reaching


def test_no_kernel_looked_up_by_a_built_name():
  """Kernel entry points are named in code (``Kernels(forward=triton.forward)``), so that a
  search for ``triton.forward`` finds every call: no getattr with a variable name on a module
  or on kernels, and none whose name is built at run time (an f-string, a sum, a call). Config
  fields read by name (``check_fields``) and constant names are the getattrs left."""
  built = []
  for name, path in MODULES.items():
    tree = ast.parse(path.read_text())
    # names this file binds to modules: `from jaxkernels.ops.norms import triton`, `import x`
    modules = {"module", "modules"}
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module:
        modules |= {a.asname or a.name for a in node.names
                    if f"{node.module}.{a.name}" in MODULES}
      elif isinstance(node, ast.Import):
        modules |= {(a.asname or a.name).split(".")[0] for a in node.names}
    for node in ast.walk(tree):
      if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "getattr" and len(node.args) > 1):
        continue
      target, attribute = ast.unparse(node.args[0]), node.args[1]
      if isinstance(attribute, ast.Constant):
        continue  # a name in the code: a search finds it
      if (target.split(".")[-1] in modules or "kernel" in target
          or isinstance(attribute, (ast.JoinedStr, ast.BinOp, ast.Call))):
        built.append(f"{name}:{node.lineno} getattr({target}, {ast.unparse(attribute)})")
  assert not built, built


def _public_ops() -> list[str]:
  """The functions jaxkernels exports from its ops' packages."""
  return sorted(name for name in dir(jk) if callable(getattr(jk, name)) and
                getattr(getattr(jk, name), "__module__", "").startswith("jaxkernels.ops."))


def test_every_public_op_is_registered():
  assert backend.ops() == _public_ops()


@pytest.mark.parametrize("op", _public_ops())
def test_every_op_runs_through_the_one_backend_entry(op):
  """Each public op is a declaration (``backend.Op``) and one ``backend.call``: validation,
  the split, the plan and the fallback are backend's, the same for every op. No op's api
  splits by itself (``partitioning.split``) or sequences a call's steps another way."""
  function = getattr(jk, op)
  tree = ast.parse(inspect.getsource(function))
  calls = [ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)]
  assert calls.count("backend.call") == 1, (op, calls)
  assert backend.kernels(op)  # registered, with its kernels
  source = pathlib.Path(inspect.getsourcefile(function)).read_text()
  assert "partitioning.split(" not in source


@pytest.mark.parametrize("op", _public_ops())
def test_every_op_registers_its_kernels_by_name(op):
  kernels = backend.kernels(op)
  assert set(kernels) <= set(dispatch.KERNELS) and kernels
  for implementation, k in kernels.items():
    # an op's own kernels, or those of the op it runs on (the fused loss: the row kernels)
    assert k.implementation == implementation and k.op in backend.ops()
    assert (k.op, implementation) in tuning.registered()
    # each entry point is a function of that implementation's own module
    module = k.forward.__module__
    assert implementation in module.split(".")[-1] or implementation in module, module
    assert k.backward is None or implementation in k.backward.__module__, k.backward.__module__


@pytest.mark.parametrize("alias,module", [("plgpu", "_mosaic_gpu"), ("pltriton", "_triton"),
                                          ("pltpu", "_mosaic_tpu")])
def test_each_toolchain_lists_the_api_its_kernels_call(alias, module):
  """backend asks each toolchain module which of the Pallas names its kernels call this JAX
  lacks: the list is the names the source calls, read from it, so it cannot go stale."""
  import importlib
  import re
  called = set()
  for path in MODULES.values():
    called |= set(re.findall(rf"\b{alias}\.([A-Za-z_]\w*)", path.read_text()))
  assert set(importlib.import_module(f"jaxkernels.{module}").API) == called


def test_the_code_cites_only_documents_the_repository_holds():
  """A docstring or comment that sends the reader to a document (a `.md` file) sends them to
  one of this repository (four once cited a design document it does not hold): from its root,
  its own folder, or results/ (where the report lives)."""
  root = PACKAGE.parent
  missing = []
  for folder in ("jaxkernels", "models", "bench", "tests"):
    for path in sorted((root / folder).rglob("*.py")):
      for number, line in enumerate(path.read_text().splitlines(), 1):
        for name in re.findall(r"\b((?:[\w-]+/)*[\w-]+\.md)\b", line):
          if not any((base / name).exists() for base in (root, path.parent, root / "results")):
            missing.append(f"{path.relative_to(root)}:{number}: {name}")
  assert not missing, missing


# --------------------------------------------------------------------------- #
# The typed call
# --------------------------------------------------------------------------- #

# Each hook of backend.Op and the parameters it takes, in order (backend.Op's docstring).
HOOK_PARAMETERS = {
    "problem": 1, "reference": 1, "options": 1, "empty": 1, "rule": 1, "forward": 1,
    "kernel": 2, "out": 2, "compose": 2, "across": 4, "composed": 1,
}


def _registered_hooks():
  for name, op in sorted(backend.registered().items()):
    for hook, count in HOOK_PARAMETERS.items():
      function = getattr(op, hook)
      if function is not None:
        yield name, hook, count, function


@pytest.mark.parametrize("name,hook,count,function",
                         [pytest.param(*h, id=f"{h[0]}.{h[1]}") for h in _registered_hooks()])
def test_every_hook_takes_the_typed_call(name, hook, count, function):
  """Every hook of every op takes what backend.Op says it does, by position, and nothing
  else: no ``**unused`` swallowing the arguments it does not name, no keyword it expects the
  pipeline to pass by name. (``options`` and ``empty`` may be backend's defaults.)"""
  parameters = list(inspect.signature(function).parameters.values())
  kinds = {p.kind for p in parameters}
  assert inspect.Parameter.VAR_KEYWORD not in kinds, (name, hook, parameters)
  assert inspect.Parameter.VAR_POSITIONAL not in kinds, (name, hook, parameters)
  required = [p for p in parameters if p.default is inspect.Parameter.empty
              and p.kind != inspect.Parameter.KEYWORD_ONLY]
  assert len(required) == count, (name, hook, parameters)
  assert not [p for p in parameters if p.kind == inspect.Parameter.KEYWORD_ONLY
              and p.default is inspect.Parameter.empty], (name, hook, parameters)


def test_every_op_validates_into_a_frozen_dataclass_of_its_own():
  """Each op's validate returns (by its annotation) a frozen subclass of ``backend.Args``."""
  import dataclasses
  import typing
  for name, op in sorted(backend.registered().items()):
    returned = typing.get_type_hints(op.validate).get("return")
    assert isinstance(returned, type) and issubclass(returned, backend.Args), (name, returned)
    assert returned is not backend.Args and dataclasses.is_dataclass(returned), name
    assert returned.__dataclass_params__.frozen, name


def _args_classes(tree: ast.Module) -> dict[str, set[str]]:
  """The module's subclasses of backend.Args, each with the names an instance answers: its
  fields and methods, and backend.Args's own."""
  base = {n for n in dir(backend.Args) if not n.startswith("__")}
  classes = {}
  for node in tree.body:
    if isinstance(node, ast.ClassDef) and any(ast.unparse(b) == "backend.Args"
                                              for b in node.bases):
      names = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign)}
      names |= {s.name for s in node.body if isinstance(s, ast.FunctionDef)}
      classes[node.name] = names | base
  return classes


def _typed_parameters(node, classes):
  """The parameters of a function or lambda that hold a call's arguments, with the names
  they answer: annotated with one of the module's Args classes, or (a lambda's, unannotated)
  named ``args``, which answers what any of them does."""
  union = set().union(*classes.values()) if classes else set()
  found = {}
  for p in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
    if p.annotation is not None and ast.unparse(p.annotation) in classes:
      found[p.arg] = classes[ast.unparse(p.annotation)]
    elif p.annotation is None and p.arg == "args" and union:
      found[p.arg] = union
  return found


def test_every_argument_a_hook_reads_is_a_field():
  """Read from the source: wherever an op's module reads ``args.name`` off a call's arguments
  (a parameter annotated with its Args class, or a lambda's ``args``), or changes them
  (``args.replace(name=...)``, ``local(name=...)``, ``local.plan(name=...)``), the name is a
  field of that class: a misnamed field fails here, not inside a user's jit."""
  wrong = []
  for module, path in MODULES.items():
    if _op_of(module) is None:
      continue
    tree = ast.parse(path.read_text())
    classes = _args_classes(tree)
    if not classes:
      continue
    fields = set().union(*classes.values())
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.Lambda)):
        typed = _typed_parameters(node, classes)
        for inner in ast.walk(node):
          if (isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name)
              and inner.value.id in typed and inner.attr not in typed[inner.value.id]):
            wrong.append(f"{module}:{inner.lineno}: {ast.unparse(inner)}")
      if isinstance(node, ast.Call):
        callee = ast.unparse(node.func)
        if callee in ("local", "local.plan") or callee.endswith("args.replace"):
          wrong += [f"{module}:{node.lineno}: {callee}({k.arg}=...)" for k in node.keywords
                    if k.arg is not None and k.arg not in fields]
  assert not wrong, wrong


def test_one_dispatcher():
  """Only the pipeline dispatches: no op module asks dispatch for a plan, a choice, the
  kernels' reasons or the target by itself (a plan another op's kernels need is
  ``backend.plan_call``'s, through that op's own hooks), and no op module calls a public op
  but through ``backend.call`` (matmul's glu once re-entered ``matmul`` four times)."""
  forbidden = {f"{m}.{n}" for m in ("backend", "dispatch")
               for n in ("plan", "choice", "kernel_reasons", "target_of", "select")}
  public = set(backend.ops())
  found = []
  for module, path in MODULES.items():
    if _op_of(module) is None:
      continue
    tree = ast.parse(path.read_text())
    # the names this module binds to jaxkernels' api modules, or to jaxkernels itself
    apis = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            for a in node.names
            if f"{node.module}.{a.name}".endswith(".api") or a.name == "jaxkernels"}
    own_kernels = module.split(".")[-1].startswith(("triton", "mosaic", "reference"))
    for node in ast.walk(tree):
      if not isinstance(node, ast.Call):
        continue
      callee = ast.unparse(node.func)
      head, _, last = callee.rpartition(".")
      public_call = last in public and (head in apis or (not head and not own_kernels))
      if callee in forbidden or public_call:
        found.append(f"{module}:{node.lineno}: {callee}(...)")
  assert not found, found


# --------------------------------------------------------------------------- #
# docs/architecture.md's layers
# --------------------------------------------------------------------------- #

ARCHITECTURE = PACKAGE.parent / "docs/architecture.md"


def _layers() -> list[tuple[str, list[str]]]:
  """The layer table of docs/architecture.md: (layer, module patterns), top first."""
  text = ARCHITECTURE.read_text()
  table = text[text.index("| layer | modules |"):].split("\n\n")[0].splitlines()[2:]
  return [(row.split("|")[1].strip(), re.findall(r"`([^`]+)`", row.split("|")[2]))
          for row in table]


# The modules of an op's package in the ops layer (docs/architecture.md): the rest are kernels.
PIPELINE = ("api", "arguments", "decode", "rows", "linear")


def _layer_of(module: str, layers) -> tuple[int, int]:
  """(the module's layer, its place among the layer's patterns)."""
  short = "jaxkernels" if module == "jaxkernels" else module.removeprefix("jaxkernels.")
  parts = short.split(".")
  for index, (_, patterns) in enumerate(layers):
    for place, pattern in enumerate(patterns):
      p = pattern.split(".")
      # <kernel>: a module of the op's package, or of a package in it (matmul's mosaic_gpu)
      deeper = p[-1] == "<kernel>" and len(parts) > len(p)
      if len(p) != len(parts) and not deeper:
        continue
      if all(a == b or (a == "<op>" and _op_of(module) == b) or a == "<part>" or
             (a == "<kernel>" and b not in PIPELINE) for a, b in zip(p, parts)):
        return index, place
  raise AssertionError(f"{module} is in no layer of docs/architecture.md")


def test_every_import_keeps_to_the_layers_of_the_architecture_page():
  """Each module imports only from layers above its own in docs/architecture.md's table (in
  the dispatch layer, only modules listed before it); within an op's package its own
  modules; across ops, an api only another op's api."""
  layers = _layers()
  names = [name for name, _ in layers]
  assert names == ["foundations", "commons", "kernels", "dispatch", "ops", "above the ops"]
  crossing = []
  for module, deps in GRAPH.items():
    layer, place = _layer_of(module, layers)
    for dep in deps:
      dep_layer, dep_place = _layer_of(dep, layers)
      # one package's own modules (an op's, partitioning's)
      package = lambda m: m.split(".")[:2] if len(m.split(".")) > 2 else None
      same_op = package(module) is not None and package(module) == package(dep)
      composes = (module.endswith(".api") and dep.endswith(".api"))
      ordered = dep_layer < layer or (dep_layer == layer and names[layer] == "dispatch"
                                      and dep_place < place)
      if not (ordered or same_op or composes or module == "jaxkernels"
              or dep.startswith(module + ".")  # a package's __init__, its own modules
              or MODULES[dep].name == "__init__.py" and dep == module.rpartition(".")[0]):
        crossing.append(f"{module} ({names[layer]}) imports {dep} ({names[dep_layer]})")
  assert not crossing, crossing


LIMIT = 600


def test_no_module_does_too_many_jobs_to_read():
  """No file of the library or the model is over 600 lines: one job a file, read in one
  sitting."""
  root = PACKAGE.parent
  over = {}
  for folder in ("jaxkernels", "models"):
    for path in sorted((root / folder).rglob("*.py")):
      name = str(path.relative_to(root))
      size = len(path.read_text().splitlines())
      if size > LIMIT:
        over[name] = size
  assert not over, over


def test_the_model_is_built_on_the_public_api():
  """models/llama.py, our own model, imports of jaxkernels only what a user would: the package,
  its Flax drop-ins and its remat policies, and reads off the package only its exported
  names: what it needs, the public API grows (``jk.partition_spec``, ``jkf.checkpointed``)."""
  path = PACKAGE.parent / "models" / "llama.py"
  tree = ast.parse(path.read_text())
  imported = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      imported |= {a.name for a in node.names if a.name.startswith("jaxkernels")}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxkernels"):
      imported |= {f"{node.module}.{a.name}" for a in node.names}
  assert imported <= {"jaxkernels", "jaxkernels.flax", "jaxkernels.remat"}, imported
  exported = {name for name in dir(jk) if not name.startswith("_")
              and not inspect.ismodule(getattr(jk, name))}
  read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
          and isinstance(node.value, ast.Name) and node.value.id == "jk"}
  assert read <= exported, read - exported


def test_pallas_triton_is_imported_in_one_place():
  """JAX deprecated Pallas Triton in 0.11 and will remove it: ``_triton`` is the package's one
  import of it (and survives its absence), so that the day it goes the package still imports
  and dispatch refuses the Triton kernels with the reason (test_backend's
  test_a_jax_without_pallas_triton)."""
  importing = []
  for name, path in MODULES.items():
    for node in ast.walk(ast.parse(path.read_text())):
      modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [f"{node.module}.{a.name}" for a in node.names]
                 if isinstance(node, ast.ImportFrom) else [])
      if any(m.startswith(("jax.experimental.pallas.triton", "jax._src.pallas.triton"))
             for m in modules):
        importing.append(name)
  assert set(importing) == {"jaxkernels._triton"}, importing


def test_the_triton_files_are_behind_one_boundary():
  """The Triton kernels' files (``_triton_files.MODULES``: every module whose name says
  triton, each importing Pallas Triton through ``_triton``) are imported by each other and by
  nothing else: every other module reaches them through ``_triton_files.optional``, so that
  deleting them, the day Pallas Triton goes, changes nothing else (test_backend's
  test_the_triton_files_deleted runs the package without them)."""
  from jaxkernels import _triton_files
  named = {name for name in MODULES if "triton" in name.rpartition(".")[2]} - {
      "jaxkernels._triton_files"}
  assert named == set(_triton_files.MODULES), named ^ set(_triton_files.MODULES)
  outside = {name: sorted(GRAPH[name] & named) for name in MODULES
             if name not in named and GRAPH[name] & named}
  assert not outside, outside


def _returns_through_the_pipeline(fn) -> list[str]:
  """The returns of the public op ``fn`` whose value does not come from ``backend.call``: one
  that calls it, or names only values assigned from a call of it in the function (unpacked or
  indexed after)."""
  import textwrap

  body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
  calls = lambda node: any(isinstance(n, ast.Call) and ast.unparse(n.func) == "backend.call"
                           for n in ast.walk(node))
  piped = set()
  for node in ast.walk(body):
    if isinstance(node, ast.Assign) and calls(node.value):
      piped |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
  for node in ast.walk(body):  # names taken apart from a piped value: out, lse = out
    if isinstance(node, ast.Assign) and {n.id for n in ast.walk(node.value)
                                         if isinstance(n, ast.Name)} & piped:
      piped |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
  off = []
  for node in ast.walk(body):
    if isinstance(node, ast.Return) and node.value is not None and not calls(node.value):
      names = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)
               and isinstance(n.ctx, ast.Load)}
      if not names & piped:
        off.append(ast.unparse(node))
  return off


def test_every_public_op_returns_through_the_pipeline():
  """Each registered op's public function returns only what ``backend.call`` computed: a
  return before it (softmax_cross_entropy's class-wise mask once returned XLA's answer there)
  would skip dispatch, so an explicit implementation would be neither honoured nor refused."""
  off = {name: _returns_through_the_pipeline(getattr(jk, name)) for name in backend.ops()}
  assert not any(off.values()), {name: rets for name, rets in off.items() if rets}
  def early(x, implementation=None):
    if x is None:
      return 0
    return backend.call(None, implementation, None, x=x)
  assert _returns_through_the_pipeline(early) == ["return 0"]  # what it catches


# --------------------------------------------------------------------------- #
# File sizes
# --------------------------------------------------------------------------- #

LINE_CEILING = 600
# Files still over the ceiling, at their length when it was set (issue 77's house splits them):
# none may grow, and a file not listed may not pass the ceiling.
OVER_THE_CEILING = {"bench/model.py": 662,
                    "bench/matmul.py": 648, "bench/harness.py": 615}


def test_every_file_stays_under_the_line_ceiling():
  """A file a person reads whole: every file of jaxkernels/, models/, bench/ and tests/ under
  600 lines (test_attention.py had grown to 1,165, test_matmul.py to 1,006), but those listed,
  which may only shrink."""
  root = PACKAGE.parent
  over = {}
  for folder in ("jaxkernels", "models", "bench", "tests"):
    for path in sorted((root / folder).rglob("*")):
      if path.suffix in (".py", ".md", ".sh") and "__pycache__" not in path.parts:
        lines = len(path.read_text().splitlines())
        name = path.relative_to(root).as_posix()
        if lines > OVER_THE_CEILING.get(name, LINE_CEILING):
          over[name] = lines
  assert not over, f"over {LINE_CEILING} lines (or past their listed length): {over}"


SHARED_CONSTANTS = ("MAX_HEAD_DIM", "LOG2E", "LN2")


def test_shared_constants_are_defined_once():
  """A limit or a number several kernels share is assigned in one module and imported by the
  rest (MAX_HEAD_DIM and LOG2E were each assigned in 4): changed in one place, it cannot drift."""
  where = {name: [] for name in SHARED_CONSTANTS}
  for path in sorted(PACKAGE.rglob("*.py")):
    for node in ast.parse(path.read_text()).body:
      if isinstance(node, ast.Assign):
        for target in node.targets:
          if isinstance(target, ast.Name) and target.id in where:
            where[target.id].append(path.relative_to(PACKAGE.parent).as_posix())
  assert all(len(files) <= 1 for files in where.values()), where


def test_a_cited_note_holds_what_it_is_cited_for():
  """Code and docs cite a measurement as ``notes/<topic>.md <label>`` (``run 17``,
  ``matmul-24``): the file exists and holds that label, so a reader's grep finds it (bench's
  one notes file of 4,249 lines was cited 106 times; one label cited there never existed)."""
  root = PACKAGE.parent
  label = re.compile(r"^[\s,(`]*(runs? \d+|[a-z][a-z0-9]*(?:-[a-z0-9]+)*-\d+)", re.I)
  wrong = []
  paths = [p for folder in ("jaxkernels", "models", "bench", "tests", "docs")
           for p in sorted((root / folder).rglob("*")) if p.suffix in (".py", ".md")]
  for path in [*paths, root / "README.md"]:
    text = path.read_text()
    for cited in re.finditer(r"notes/([\w-]+\.md)", text):
      note = root / "notes" / cited.group(1)
      if not note.is_file():
        wrong.append(f"{path.relative_to(root)}: {cited.group(0)} does not exist")
        continue
      found = label.match(text[cited.end():cited.end() + 40])
      if found:
        name = re.sub(r"^runs ", "run ", found.group(1).lower())
        if name not in note.read_text().lower():
          wrong.append(f"{path.relative_to(root)}: {cited.group(0)} has no {name!r}")
  assert not wrong, wrong
