"""How close is close enough: the float64 oracle and tolerances derived from the numerics.

The rule (``jaxkernels/testing.py`` says why): a kernel's error against the exact
answer may be at most twice the error of the naive computation in the
low-precision dtype (the reference run with ``compute_dtype`` equal to the input
dtype), leaf by leaf.
Float32 work has a floor: reductions of length n in float32 carry a random
walk of rounding errors, ~sqrt(n) ulps; four times that is allowed whatever the
baseline happened to get.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import warnings
import zlib
from collections.abc import Collection, Iterator

import jax.numpy as jnp
import numpy as np
import pytest

import jaxkernels as jk
from jaxkernels import testing

F32_EPS = testing.F32_EPS
# JAXKERNELS_TEST_COMPILED=1 (on the GPU machine): the test bases' kernels compile for the
# device the arrays live on instead of running interpreted on the CPU, under the same cases and
# the same derived tolerances; kernels for another platform (Mosaic TPU there) skip with the
# reason ``jk.supports`` gives.
COMPILED = os.environ.get("JAXKERNELS_TEST_COMPILED", "0") not in ("", "0")


# JAXKERNELS_TEST_SLOW=1: also the interpreted cases that cost minutes each on 2 CPU cores and
# run compiled in the GPU check (the Mosaic GPU attention kernels' edge cases): CI skips them.
SLOW = os.environ.get("JAXKERNELS_TEST_SLOW", "0") not in ("", "0")


def slow_when_interpreted(seconds: int) -> None:
  """Skips the calling test where its kernels would run interpreted (unless SLOW): it took
  ``seconds`` on CI's 2 cores, and the GPU check runs it compiled."""
  if not (COMPILED or SLOW):
    pytest.skip(f"interpreted it takes ~{seconds} s on 2 CPU cores: compiled in the GPU check "
                "(python -m bench.gpu_check); JAXKERNELS_TEST_SLOW=1 runs it here")


def draws(full: int) -> int:
  """How many examples a hypothesis test draws: ``full`` where the kernels compile (the GPU
  check) or under SLOW; on CI's 2 cores a quarter, at least one (each drawn case is a fresh
  interpreted run; the suite's time)."""
  return full if COMPILED or SLOW else max(1, full // 4)


def _id(value) -> str:
  if isinstance(value, tuple):
    return ("x" if all(type(v) is int for v in value) else "-").join(map(str, value))
  if isinstance(value, type) and hasattr(value, "dtype"):  # jnp.bfloat16: "bfloat16"
    return jnp.dtype(value).name
  return str(value)


def grid(*axes, center=None) -> list:
  """The parameter combinations a test runs. Where the kernels compile (COMPILED, the GPU
  check) or under SLOW: every combination. Interpreted on CI's 2 cores: a cross through
  ``center`` (default: each axis's first value): every value of each axis once, with the
  center's values on the other axes. Each value's own path (each shape's edges, each
  activation's formula) still runs on the CPU; its pairings with every other axis's values
  run compiled in the GPU check, where they take seconds, not minutes (notes/model.md, Test
  time)."""
  if COMPILED or SLOW:
    out = list(itertools.product(*axes))
  else:
    center = tuple(a[0] for a in axes) if center is None else tuple(center)
    out = [center]
    for i, axis in enumerate(axes):
      out += [center[:i] + (v,) + center[i + 1:] for v in axis if v != center[i]]
  return [pytest.param(*values, id="-".join(map(_id, values))) for values in out]


def some(params, keep) -> list:
  """``params`` (values or ``pytest.param``s, ids as pytest makes them) with those not in
  ``keep`` (their ids) marked slow: CI runs ``keep``, SLOW and the GPU check all of them."""
  out = []
  for value in params:
    param = value if isinstance(value, type(pytest.param(0))) else pytest.param(value)
    ident = param.id if param.id is not None else "-".join(map(_id, param.values))
    marks = () if ident in keep else (pytest.mark.slow,)
    out.append(pytest.param(*param.values, id=ident, marks=(*param.marks, *marks)))
  unknown = set(keep) - {p.id for p in out}
  if unknown:
    raise ValueError(f"some: keep names {sorted(unknown)}, not among the params' ids")
  return out


@contextlib.contextmanager
def kernel_mode(implementation: str | None = None) -> Iterator[None]:
  """Where a test runs the kernels it checks: interpreted on the CPU (CI; ``implementation``:
  the kernel that a call naming none picks there, default Mosaic TPU's, then Triton's), or
  compiled (``COMPILED``). A FallbackWarning inside is an error: a kernel test whose call fell
  back to the XLA reference would compare the reference with itself, and pass."""
  interpreted = contextlib.nullcontext() if COMPILED else jk.interpret_mode(implementation)
  with interpreted, warnings.catch_warnings():
    warnings.filterwarnings("error", category=jk.FallbackWarning)
    yield


def elsewhere(implementation: str | None) -> str | None:
  """Compiled (``COMPILED``): why ``implementation``'s kernels cannot run on this machine's
  device (a kernel of another platform, Mosaic TPU's on a GPU), else None; interpreted, None."""
  from jaxkernels import dispatch

  platform = dispatch.KERNEL_PLATFORM.get(implementation)
  if not COMPILED or platform in (None, dispatch.target_of().platform):
    return None
  import jax
  return f"{implementation} compiles for {platform}; {jax.devices()[0].device_kind} here"


def must_serve(support) -> None:
  """A call a kernel must serve (``jk.supports``' answer): a refusal fails the test with the
  kernel's reason, but where the reason is the device itself (a GPU before Hopper, which
  Mosaic GPU's kernels need), it skips saying so."""
  if support:
    return
  if "needs a Hopper GPU" in support.reason:
    pytest.skip(support.reason)
  pytest.fail(f"a call its kernel must serve was refused: {support.reason}", pytrace=False)


def assert_served(calls: Collection[testing.Served], implementation: str | None,
                  ops: Collection[str] = ()) -> None:
  """Each call of ``ops`` recorded in ``calls`` (:func:`jaxkernels.testing.served`; every call,
  where ``ops`` is empty) ran on ``implementation`` (None: on some kernel, not the XLA
  reference), and at least one of each was made. Calls of other ops that those make inside
  (the gated product's glu backward, on whichever kernel takes its width) ran on some kernel,
  where ``implementation`` is one."""
  ran = sorted({(c.op, c.implementation) for c in calls})
  assert ran, ("no op call was traced inside (a program cached from an earlier trace, or no "
               "op at all): nothing shows which implementation ran")

  def wrong(op, served):
    if not ops or op in ops:
      return served != implementation if implementation is not None else served == "xla"
    return implementation != "xla" and served == "xla"

  off = [r for r in ran if wrong(*r)]
  assert not off, (f"op calls served by other than {implementation or 'a kernel'}: {off} "
                   f"(all: {ran})")
  missing = sorted(set(ops) - {op for op, _ in ran})
  assert not missing, f"no call of {missing} was traced (all: {ran})"


@contextlib.contextmanager
def served_by(implementation: str | None, ops: Collection[str] = ()
              ) -> Iterator[list[testing.Served]]:
  """Records the op calls traced inside (:func:`jaxkernels.testing.served`) and, on leaving,
  asserts them with :func:`assert_served`."""
  with testing.served() as calls:
    yield calls
  assert_served(calls, implementation, ops)

SEED = int(os.environ.get("JAXKERNELS_TEST_SEED", np.random.SeedSequence().entropy % 2**31))


def rng(*labels) -> np.random.Generator:
  """A generator fresh for every session (SEED) and distinct for every test case (labels)."""
  return np.random.default_rng([SEED, zlib.crc32(repr(labels).encode())])


def normal(gen, shape, dtype, scale=1.0, shift=0.0, bound=None):
  values = gen.standard_normal(shape) * scale + shift
  if bound is not None:
    values = np.clip(values, -bound, bound)
  # Rounded by NumPy (ml_dtypes for bfloat16 and float8): no conversion program to compile.
  return jnp.asarray(np.asarray(values).astype(jnp.dtype(dtype)))


# The rule itself lives in the library, for users' own tests too.
evaluate, errors = testing.evaluate, testing.errors


def assert_matches(got, reference, primals, cotangent=None, *, note: str = "", **kwargs):
  """:func:`jaxkernels.testing.assert_matches`, its failures naming the session's seed (after
  ``note``, what was checked)."""
  testing.assert_matches(got, reference, primals, cotangent,
                         note=f"{note} (seed {SEED})".lstrip(), **kwargs)
