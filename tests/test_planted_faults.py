"""The tests of the tests: a fault planted in the library must fail the test that names what it
breaks, not pass on XLA's reference (which agrees with the oracle by construction) nor turn
into a skip. Each plants one fault and runs the real test, or the check it goes through,
expecting it to fail: a kernel that refuses every call (one op a backend), a call that skips
its kernels, a listed refusal gone stale, forward mode that drifts from what the kernels
compute."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxkernels as jk
from jaxkernels import backend
from jaxkernels.ops.cross_entropy import linear as linear_api
from jaxkernels.ops.softmax import api as softmax_api
from tests import cases, sharding, test_cases, test_forward_mode, test_models
from tests import test_one_device_mesh

PLANTED = "a planted refusal"


@pytest.fixture
def refuse(monkeypatch):
  """``refuse(op, implementation)``: that kernel refuses every call for the rest of the test,
  as a bug in its ``unsupported`` would."""
  def plant(op: str, implementation: str) -> None:
    table = backend.registered()[op].kernels
    monkeypatch.setitem(table, implementation, dataclasses.replace(
        table[implementation], unsupported=lambda problem, chip: PLANTED))
  return plant


@pytest.mark.parametrize("implementation,op", [("triton", "rms_norm"), ("mosaic_tpu", "softmax"),
                                               ("mosaic_gpu", "glu")])
def test_a_refusal_fails_the_case_table(refuse, implementation, op):
  """One op a backend, at the case table's own shape and dtype for that backend."""
  refuse(op, implementation)
  _, shape, dtype = next(at for at in test_cases.AT if at[0] == implementation)
  with pytest.raises(pytest.fail.Exception, match=PLANTED):
    cases.CASES[op].check(implementation, shape, dtype=dtype)


def test_a_call_that_skips_its_kernel_fails_the_check():
  """A test's call that runs XLA's path, though it names Triton (an op that returns before
  dispatch, say): the numbers are right, what served them is not."""
  case = cases.CASES["softmax"]
  x = jnp.linspace(-2.0, 2.0, 2 * 16 * 64, dtype=jnp.float32).reshape(2, 16, 64)
  with pytest.raises(AssertionError, match=r"served by other than triton: \[\('softmax', 'xla'"):
    cases.check("softmax", "triton", case.call("xla"), case.reference, (x,), x,
                dtype=jnp.float32, reduction=64, support=((x,), {"axis": 1}))


def test_a_stale_listed_refusal_fails():
  """A refusal listed where the kernel serves the call after all (fixed, or never refused)."""
  case = cases.CASES["softmax"]
  x = jnp.ones((2, 16, 64), jnp.float32)
  with pytest.raises(AssertionError, match="the listing is stale"):
    cases.check("softmax", "triton", case.call("triton"), case.reference, (x,), x,
                dtype=jnp.float32, reduction=64, support=((x,), {"axis": 1}),
                refused=cases.NO_TPU_FLOAT16)


def test_a_refusal_fails_the_sharded_check(refuse, mesh):
  """A sharded call that names no kernel (dispatch picks per shard) and falls back."""
  refuse("rms_norm", "triton")
  with pytest.raises(AssertionError, match=PLANTED):
    cases.CASES["rms_norm"].check_sharded("triton", mesh, P("data"), sharding.SHAPE, "planted")


def test_a_refusal_fails_the_models_kernel_test(refuse):
  refuse("rms_norm", "triton")
  with pytest.raises(jk.FallbackWarning, match=PLANTED):
    test_models.test_kernels_match_the_xla_path()


def test_a_refusal_fails_the_one_device_mesh(refuse):
  refuse("softmax", "triton")
  with pytest.raises(jk.FallbackWarning, match=PLANTED):
    test_one_device_mesh.test_one_device_mesh_matches_plain_arrays("softmax")


@pytest.mark.parametrize("op,module,name,hook", [
    ("softmax", softmax_api, "_OP", "reference"),
    ("linear_softmax_cross_entropy", linear_api, "_LINEAR_OP", "forward")])
def test_a_drift_in_forward_mode_fails_its_test(monkeypatch, op, module, name, hook):
  """What forward mode runs (the op's ``forward``, else its reference) 5% off: the kernels'
  reverse mode does not follow it (the test this one checks compared forward mode on a kernel
  path with forward mode on XLA's, the same drifted code both ways, and passed)."""
  registered = getattr(module, name)
  runs = getattr(registered, hook) or registered.reference
  monkeypatch.setattr(module, name, dataclasses.replace(
      registered, **{hook: lambda args: 1.05 * runs(args)}))
  with pytest.raises(AssertionError):
    test_forward_mode.test_forward_mode_agrees_with_the_kernels_reverse_mode(op, "triton")
