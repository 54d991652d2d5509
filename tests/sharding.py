"""What the sharded tests share (their fixtures, the (4, 2) mesh of Explicit axes over 8 host
devices and the TPU topologies of four chips, are conftest's): a mesh of Auto axes, the rows'
shape and a shard's of it, arrays placed, a TPU compile, a test that runs again in a process of
its own (the Mosaic TPU interpreter's callbacks on 8 devices), and the Mosaic GPU attention's
gradients lowered for CUDA."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding

import jaxkernels as jk
from jaxkernels import partitioning
from tests.conftest import run_alone


CHILD = "JAXKERNELS_TEST_SHARDING_CHILD"


def in_own_process(request) -> bool:
  """Runs this test in a process of its own and returns True there; in the parent, waits for
  it and fails with its output if it failed. The TPU interpreter keeps global simulated
  memory and semaphores across kernels (jax 0.10.2): run one after another in one process,
  its multi-device kernels waited forever at the third to ninth case (resetting that state
  between tests did not help); each alone passes in seconds."""
  if os.environ.get(CHILD):
    return True
  # NPROC: the TPU interpreter's callbacks on 8 devices wait for each other, and need a thread
  # more than there are devices (interpret.check_interpreter_threads).
  done = run_alone(request, 300, **{CHILD: "1", "NPROC": "16"})
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
  return False


def put(mesh, a, spec):
  return None if a is None else jax.device_put(a, NamedSharding(mesh, spec))


def auto_mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"),
                           axis_types=(AxisType.Auto,) * 2)


# A rows array (B, T, N): the row ops' layouts split its batch, its sequence or its last axis.
SHAPE = (8, 4, 128)


def local_shape(spec, mesh):
  """The local (per-shard) shape of a SHAPE array split as ``spec`` on ``mesh``."""
  return [n // partitioning.size(mesh, partitioning.axes(e)) for n, e in
          zip(SHAPE, tuple(spec) + (None,) * (len(SHAPE) - len(spec)))]


def tpu_compile(mesh, fn, *args):
  with jax.set_mesh(mesh):
    return jax.jit(fn).lower(*args).compile()


MOSAIC_GPU_ATTENTION_KERNELS = ("jk_attention_fwd_mgpu", "jk_attention_dq_mgpu",
                                "jk_attention_dkdv_mgpu")


def mosaic_gpu_attention_grads(q, k, v):
  """Causal attention's gradients on the Mosaic GPU kernels (forward, dq, dk/dv)."""
  return jax.grad(lambda q, k, v: jnp.sum(jk.flash_attention(
      q, k, v, causal=True, implementation="mosaic_gpu").astype(jnp.float32)),
      argnums=(0, 1, 2))(q, k, v)
