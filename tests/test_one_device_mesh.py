"""The ops on a mesh of one device with Explicit axes, as ``python -m models.train`` runs them
on one GPU: each op takes its sharded path (shard_map over the mesh) and must give what it
gives on plain arrays, forward and gradients. Interpreted on the CPU (Triton), compiled on a GPU
(JAXKERNELS_TEST_COMPILED=1): the train step's 1x1 mesh once crashed there (jax 0.11) and never
on the CPU's jax 0.10."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxkernels as jk
from tests import numerics

ROWS = P(("data", "fsdp"))


def _ops():
  def attention(q, k, v):
    return jk.flash_attention(q, k, v, causal=True)

  return {
      "rms_norm": (lambda x, s: jk.rms_norm(x, s), [(4, 16, 64), (64,)], [ROWS, P()]),
      "softmax": (lambda x: jk.softmax(x), [(4, 16, 64)], [ROWS]),
      "glu": (lambda x: jk.glu(x), [(4, 16, 128)], [ROWS]),
      "matmul": (lambda a, b: jk.matmul(a, b), [(4, 16, 64), (64, 128)], [ROWS, P()]),
      "cross_entropy": (lambda z, y: jk.softmax_cross_entropy(z, y),
                        [(4, 16, 96), "labels"], [ROWS, ROWS]),
      "linear_cross_entropy": (lambda x, w, y: jk.linear_softmax_cross_entropy(x, w, y),
                               [(4, 16, 64), (64, 96), "labels"], [ROWS, P(), ROWS]),
      "flash_attention": (attention, [(2, 128, 4, 64), (2, 128, 2, 64), (2, 128, 2, 64)],
                          [ROWS, ROWS, ROWS]),
  }


OPS = _ops()


@pytest.mark.parametrize("op", sorted(OPS))
def test_one_device_mesh_matches_plain_arrays(op):
  fn, shapes, specs = OPS[op]
  gen = numerics.rng("one-device-mesh", op)
  args = [jnp.asarray(gen.integers(0, 96, (4, 16)), jnp.int32) if s == "labels"
          else numerics.normal(gen, s, jnp.float32) for s in shapes]
  floats = [i for i, s in enumerate(shapes) if s != "labels"]

  def loss(*xs):
    full = list(args)
    for i, x in zip(floats, xs):
      full[i] = x
    out = fn(*full)
    return jnp.sum(out * out) if out.ndim else out

  mesh = jax.make_mesh((1, 1), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2,
                       devices=jax.devices()[:1])
  # Both on the kernels (interpreted: Triton's; compiled: the device's best), neither falling
  # back to XLA's reference.
  with numerics.kernel_mode("triton"):
    with numerics.served_by(None if numerics.COMPILED else "triton"):
      want = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(floats)))))(
          *[args[i] for i in floats])
    with jax.set_mesh(mesh), numerics.served_by(None if numerics.COMPILED else "triton"):
      placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
      args[:] = placed
      got = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(floats)))))(
          *[placed[i] for i in floats])
  # The same kernels on the same numbers: only the order of a few float32 sums may differ.
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5,
                               atol=1e-5 * float(np.max(np.abs(np.asarray(w)))))
