"""The shape of the package, read from its source: how modules import each other, and how
kernels are reached. Reading imports (not importing) sees the lazy ones inside functions too."""

from __future__ import annotations

import ast
import inspect
import re
import pathlib

import pytest

import jaxkernels as jk
from jaxkernels import backend, tuning

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
  assert set(kernels) <= set(backend.KERNELS) and kernels
  for implementation, k in kernels.items():
    # an op's own kernels, or those of the op it runs on (the fused loss: the row kernels)
    assert k.implementation == implementation and k.op in backend.ops()
    assert (k.op, implementation) in tuning.registered()
    # each entry point is a function of that implementation's own module
    module = k.forward.__module__
    assert implementation in module.split(".")[-1] or implementation in module, module
    assert k.backward is None or k.backward.__module__ == module


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
  one of this repository (four once cited a design document it does not hold)."""
  root = PACKAGE.parent
  missing = []
  for folder in ("jaxkernels", "models", "bench", "tests"):
    for path in sorted((root / folder).rglob("*.py")):
      for number, line in enumerate(path.read_text().splitlines(), 1):
        for name in re.findall(r"\b((?:[\w-]+/)*[\w-]+\.md)\b", line):
          if not any((base / name).exists() for base in (root, path.parent)):
            missing.append(f"{path.relative_to(root)}:{number}: {name}")
  assert not missing, missing
