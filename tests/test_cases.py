"""Every op of the case table (tests/cases.py, one case a registered op) against its float64
oracle by the numerics rule, forward and gradient: on XLA's path, on the interpreted Triton and
Mosaic TPU kernels on the CPU, and on the compiled kernels of the GPU check."""

from __future__ import annotations

import pytest

from jaxkernels import backend
from tests import cases, numerics

# x's (B, T, width): the rows of the row ops, a product's A, the logits, two heads of q.
SHAPE = (2, 16, 64)
IMPLEMENTATIONS = ("xla", "triton", "mosaic_tpu", *(("mosaic_gpu",) if numerics.COMPILED else ()))


def test_every_registered_op_has_a_case():
  assert sorted(cases.CASES) == backend.ops()
  assert all(case.op == name for name, case in cases.CASES.items())
  assert all(case.op in backend.ops() for case in cases.VARIANTS.values())


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("op", sorted(cases.CASES))
def test_every_op_matches_its_oracle(op, implementation):
  cases.CASES[op].check(implementation, SHAPE)
