"""The boundary around the Triton kernels, which serve GPUs before Hopper (and Hopper's calls
no Mosaic GPU kernel takes): the files they are, and their import where present.

Pallas Triton is deprecated since JAX 0.11 and will be removed. The day it goes, the files in
``MODULES`` go with it and nothing else changes: every other module reaches them through
:func:`optional` (a structure test keeps it so), the ops register no Triton kernels, and
dispatch says why an sm80 call falls back (``tests/test_backend.py`` deletes them, simulated).
"""

from __future__ import annotations

import importlib
from types import ModuleType

# The Triton kernels and their commons: every module that imports Pallas Triton, and only them.
MODULES = (
    "jaxkernels._triton",
    "jaxkernels.ops.attention.triton",
    "jaxkernels.ops.attention.triton_decode",
    "jaxkernels.ops.cross_entropy.triton",
    "jaxkernels.ops.elementwise.triton",
    "jaxkernels.ops.matmul.triton",
    "jaxkernels.ops.matmul.triton_crop",
    "jaxkernels.ops.norms.triton",
    "jaxkernels.ops.softmax.triton",
)


def optional(name: str) -> ModuleType | None:
  """The Triton module ``name`` (one of ``MODULES``), or None where its file is gone."""
  if name not in MODULES:
    raise ValueError(f"{name} is not one of the Triton files {MODULES}")
  try:
    return importlib.import_module(name)
  except ModuleNotFoundError as e:
    if e.name not in MODULES:  # a module it imports is missing: not the file's absence
      raise
    return None


def pallas_triton() -> ModuleType | None:
  """Pallas Triton where both it and the kernels' commons import, else None."""
  commons = optional("jaxkernels._triton")
  return None if commons is None else commons.pltriton
