"""Shared fixtures: TPU topologies for AOT compiles, and the seed in the report header."""

from __future__ import annotations

import os
import zlib

# Eight host devices, set before jax starts, so that the sharding tests have a (4, 2) mesh on
# the CPU; everything else runs on the first of them, as on one device.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
# Interpreted on the CPU, the suite's time is mostly XLA compiling small programs (the
# interpreted kernels, the oracle's), not running them: LLVM's optimization passes cost more
# than they save at the tests' shapes (a quarter of the time), and XLA:CPU's MLIR fusion
# emitters take twice the time of its older loop emitters to compile them (a switch XLA
# dropped after jax 0.10: set only where this XLA knows it, or it would refuse to start).
# These change how fast code compiles and runs, not what it computes (no fast-math); compiled
# on a GPU (the GPU check) they are left alone. notes/paths.md readme-2, readme-3.
OPTIMIZATION_LEVEL = "--xla_backend_optimization_level=0"
LOOP_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_knows(flag: str) -> bool:
  """Whether this jaxlib's XLA takes ``flag`` (an unknown XLA flag ends the process at start)."""
  import subprocess
  import sys
  env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                        capture_output=True, timeout=120).returncode == 0


# Once, in the first process: xdist's workers inherit the flags.
if (os.environ.get("JAXKERNELS_TEST_COMPILED", "0") in ("", "0")
    and "JAXKERNELS_TEST_CPU_FLAGS" not in os.environ):
  _flags = [f for f in (OPTIMIZATION_LEVEL, LOOP_EMITTERS)
            if f.split("=")[0] not in os.environ["XLA_FLAGS"]]
  if LOOP_EMITTERS in _flags and not _xla_knows(LOOP_EMITTERS):
    _flags.remove(LOOP_EMITTERS)
  os.environ["XLA_FLAGS"] += "".join(" " + f for f in _flags)
  os.environ["JAXKERNELS_TEST_CPU_FLAGS"] = " ".join(_flags)

# The Mosaic GPU interpreter runs a CTA's warpgroups as threads whose barrier waits block inside
# host callbacks, and XLA:CPU runs those on its pool of NPROC (default: the cores) threads: on
# two cores, two blocked waits starve the third warpgroup and the kernel hangs. Enough threads
# for the grid loop's callback, three warpgroups and their nested calls. (The TPU interpreter
# on 8 host devices needs one more thread than devices: the sharding tests that run it give
# their own processes NPROC=16; interpret.check_interpreter_threads refuses fewer.)
os.environ.setdefault("NPROC", str(max(os.cpu_count() or 1, 8)))
# pytest-xdist's workers each load libtpu for the TPU AOT compiles; its lockfile would let only
# one of them (the others' compiles would skip).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxkernels import hardware  # noqa: E402
from tests import numerics  # noqa: E402

# xdist's workers start after this (the controller's) import: they draw the same session seed.
os.environ.setdefault("JAXKERNELS_TEST_SEED", str(numerics.SEED))

TPU_TOPOLOGIES = hardware.TPU_TOPOLOGIES


def pytest_report_header(config):
  mode = "compiled on the default device" if numerics.COMPILED else "interpreted on the CPU"
  return (f"jaxkernels test seed: {numerics.SEED} (set JAXKERNELS_TEST_SEED to replay); "
          f"kernels {mode} (JAXKERNELS_TEST_COMPILED)")


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "cpu_only: asserts what happens to arrays on a CPU (dispatch, fallback, the "
      "bench's interpret mode); skipped where the kernels compile (JAXKERNELS_TEST_COMPILED)")
  config.addinivalue_line(
      "markers", "slow: a case beyond the one-of-each that CI runs (a grid's other points, a "
      "second layout of a mode already covered): runs under JAXKERNELS_TEST_SLOW=1 and "
      "compiled in the GPU check (docs/testing.md)")


def _first_case_only(item) -> bool:
  """A test base's subclass (one with an ``IMPL``: the XLA reference's battery, or a kernel
  backend's interpreted class) runs the first case of each parametrized test, and its drawn
  (hypothesis) test not at all, outside SLOW, unless it sets ``FIRST_CASE_ONLY = False``.
  Interpreted, a kernel case takes seconds where compiled it takes milliseconds: CI checks
  each test once a backend (its dispatch, its dtype path, its kernel body), and the grids
  run under SLOW on the CPU and compiled, every case, in the GPU check (Triton's and Mosaic
  GPU's). The Mosaic TPU classes' grids have no compiled run: a change to a TPU kernel runs
  them under SLOW (docs/testing.md)."""
  if not getattr(item.cls, "FIRST_CASE_ONLY", getattr(item.cls, "IMPL", None) is not None):
    return False
  if item.originalname == "test_drawn":
    return True
  callspec = getattr(item, "callspec", None)
  return callspec is not None and any(index for index in callspec.indices.values())


# The fixtures that compile for a real TPU generation, one case per generation.
TPU_GENERATION_FIXTURES = ("tpu_mesh", "tpu4")


def _other_generations(items) -> set:
  """The TPU AOT cases CI leaves to SLOW: of each test's cases that differ only in the TPU
  generation, all but one, picked by a hash of the test's name, so that each generation still
  compiles a share of the kernels on CI and every kernel compiles for a TPU (the compiler's
  work is the same program per generation, ~5-15 s a case; the GPU check runs them all)."""
  groups = {}
  for item in items:
    callspec = getattr(item, "callspec", None)
    generation = [n for n in TPU_GENERATION_FIXTURES if callspec and n in callspec.indices]
    if not generation:
      continue
    value = str(callspec.params[generation[0]])
    others = [part for part in callspec.id.split("-") if part != value]
    key = f"{item.path.name}::{item.cls and item.cls.__name__}::{item.originalname}{others}"
    groups.setdefault(key, []).append((value, item))
  out = set()
  for key, group in groups.items():
    group.sort(key=lambda pair: pair[0])
    keep = zlib.crc32(key.encode()) % len(group)
    out.update(id(item) for i, (_, item) in enumerate(group) if i != keep)
  return out


# The files of the longest tests (the README's commands, whole training runs: 20-100 s each),
# collected first: xdist's workers take the collection in contiguous halves and steal only
# what is still queued, so a long test left at the end of a half ran on past the other
# worker's last (the suite's tail).
LONGEST_FIRST = ("test_readme.py", "test_train.py", "test_models.py")


def pytest_collection_modifyitems(config, items):
  """The longest tests' files first (``LONGEST_FIRST``). Outside SLOW and COMPILED, the
  ``slow`` cases skip (CI runs one of each, and each TPU compile for one generation).
  Compiled, the tests that assert CPU behaviour skip, and so do a test base's cases for a
  kernel of another platform (Mosaic TPU on a GPU), except its AOT compiles
  (``tpu_mesh``)."""
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: else unmoved
  if not (numerics.COMPILED or numerics.SLOW):
    slow = pytest.mark.skip(reason="slow: JAXKERNELS_TEST_SLOW=1 runs it (docs/testing.md)")
    other_generations = _other_generations(items)
    for item in items:
      if "slow" in item.keywords or _first_case_only(item) or id(item) in other_generations:
        item.add_marker(slow)
  if not numerics.COMPILED:
    return
  cpu_only = pytest.mark.skip(reason="cpu_only: the arrays live on an accelerator here")
  for item in items:
    elsewhere = numerics.elsewhere(getattr(item.cls, "IMPL", None))
    if "cpu_only" in item.keywords:
      item.add_marker(cpu_only)
    elif elsewhere is not None and "tpu_mesh" not in item.fixturenames:
      item.add_marker(pytest.mark.skip(reason=elsewhere))


def tpu_topology(name: str):
  """The devices of a TPU topology (``"v5e:2x2"``, say) for AOT compiles by the real TPU
  compiler, libtpu's. Where it cannot be had (libtpu missing or broken) the test fails: the
  suite's `test` extra installs it, and a skip there hid every TPU compile. Compiled on a GPU
  (the GPU check, on a machine without libtpu) it skips, saying so: TPU compiles are CI's."""
  from jax.experimental import topologies

  try:
    return topologies.get_topology_desc(platform="tpu", topology_name=name)
  except Exception as e:  # noqa: BLE001 - whatever libtpu raised, said whole
    message = f"no TPU compiler here ({type(e).__name__}: {e})"
    if numerics.COMPILED:
      pytest.skip(f"{message}: the GPU check leaves the TPU compiles to CI")
    pytest.fail(f"{message}: the tests' `test` extra installs libtpu (pip install -e "
                "'.[test]', as `make test` does)", pytrace=False)


@pytest.fixture(scope="session", params=sorted(TPU_TOPOLOGIES))
def tpu_mesh(request):
  """A one-device mesh of a real TPU generation's topology: compiles run the TPU compiler."""
  import jax

  topology = tpu_topology(TPU_TOPOLOGIES[request.param])
  return jax.sharding.Mesh(np.array(topology.devices[:1]), ("x",))


def aot_compile(mesh, fn, *shapes):
  """Compiles fn for the mesh's TPU from ShapeDtypeStructs; returns the compiled text."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec

  sharding = NamedSharding(mesh, PartitionSpec())
  args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in shapes]
  with jax.set_mesh(mesh):
    compiled = jax.jit(fn).lower(*args).compile()
  return compiled.as_text()


def cuda_lowering(fn, *shapes) -> str:
  """fn exported for CUDA (Triton kernels serialized, no GPU needed): the StableHLO text."""
  import jax
  from jax import export

  from jaxkernels._triton import CUSTOM_CALL as TRITON_CUSTOM_CALL

  exported = export.export(
      jax.jit(fn), platforms=["cuda"],
      disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)])(*shapes)
  return exported.mlir_module()


def run_alone(request, timeout: int, **env):
  """This test (its node id) run again in a pytest process of its own, with ``env`` over this
  process's environment and the session's seed: the finished process, for the caller to
  check."""
  import pathlib
  import subprocess
  import sys
  return subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
      env={**os.environ, "JAXKERNELS_TEST_SEED": str(numerics.SEED), **env},
      capture_output=True, text=True, timeout=timeout,
      cwd=pathlib.Path(__file__).parent.parent)


@pytest.fixture
def default_emitters(request) -> bool:
  """For a test that compares bits between programs of different shapes (one device's and a
  device's share, say): XLA:CPU's loop emitters (LOOP_EMITTERS above) round a vector loop's
  tail apart from its body (an initializer's values 1 ulp apart in 4% of the elements), its
  default emitters do not. Where the flag is set the test runs again in a process of its own
  without it, and this returns False (the parent waits and fails with the child's output);
  True where the test's body runs."""
  if LOOP_EMITTERS not in os.environ.get("XLA_FLAGS", ""):
    return True
  flags = os.environ["XLA_FLAGS"].replace(LOOP_EMITTERS, "").strip()
  done = run_alone(request, 600, XLA_FLAGS=flags, JAXKERNELS_TEST_CPU_FLAGS=flags)
  assert done.returncode == 0 and " passed" in done.stdout, (
      done.stdout[-4000:] + done.stderr[-2000:])
  return False


# The sharded tests' fixtures (tests/sharding.py holds their helpers).
@pytest.fixture(scope="module")
def mesh():
  """A (4, 2) mesh of Explicit axes, ("data", "model"), over 8 host devices."""
  import jax
  from jax.sharding import AxisType

  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (conftest sets --xla_force_host_platform_device_count=8)")
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
  """Every test starts with no ShardingWarning or FallbackWarning given yet (each is given
  once a process: a test that expects one failed where an earlier test in its worker had
  drawn the same words)."""
  from jaxkernels import dispatch, partitioning
  monkeypatch.setattr(partitioning.specs, "_WARNED", set())
  monkeypatch.setattr(dispatch, "_WARNED", set())


@pytest.fixture(scope="module", params=["v5e:2x2", "v6e:2x2"])
def tpu4(request):
  """Four chips of a TPU topology on one Explicit axis, "data": compiles run the TPU compiler."""
  import jax
  from jax.sharding import AxisType

  topology = tpu_topology(request.param)
  return jax.sharding.Mesh(np.array(topology.devices[:4]), ("data",),
                           axis_types=(AxisType.Explicit,))
