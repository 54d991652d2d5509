"""The transformer trains with jaxkernels' ops, and its kernels agree with the XLA path."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxkernels as jk
from models import transformer
from tests import numerics


def _tokens(cfg, batch=4, seed_label="tokens"):
  gen = numerics.rng(seed_label)
  return jnp.asarray(gen.integers(0, cfg.vocab, (batch, cfg.max_len)), jnp.int32)


def test_training_lowers_the_loss():
  cfg = dataclasses.replace(transformer.PRESETS["test"], implementation="xla")
  model, optimizer = transformer.make(cfg)
  tokens = _tokens(cfg)
  losses = [float(transformer.train_step(model, optimizer, tokens)) for _ in range(8)]
  assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1


def test_kernels_match_the_xla_path():
  cfg = transformer.PRESETS["test"]
  tokens = _tokens(cfg, seed_label="match")
  want_model, _ = transformer.make(dataclasses.replace(cfg, implementation="xla"), seed=3)
  # The model's dense layers are XLA dots in both runs: in full float32, so that on a GPU tf32
  # tensor cores (10-bit mantissas) do not round the kernels' float32-close outputs apart.
  with jax.default_matmul_precision("highest"):
    want_loss, want_grads = nnx.value_and_grad(transformer.loss_fn)(want_model, tokens)
  # Float32 throughout: each of the 2 * depth + 1 fused norm/glu ops may differ from XLA's
  # by its reduction's rounding, ~4 eps sqrt(width); errors pass through, they do not grow.
  tolerance = 4 * numerics.F32_EPS * cfg.width**0.5 * (2 * cfg.depth + 1)
  # Compiled (on a GPU), the model's Triton kernels; interpreted, both kernel families.
  for implementation in ("triton",) if numerics.COMPILED else ("triton", "mosaic_tpu"):
    model, _ = transformer.make(dataclasses.replace(cfg, implementation=implementation), seed=3)
    with numerics.kernel_mode(), jax.default_matmul_precision("highest"):
      loss, grads = nnx.value_and_grad(transformer.loss_fn)(model, tokens)
    assert abs(float(loss) - float(want_loss)) <= tolerance * abs(float(want_loss))
    errors = numerics.errors(jax.tree.leaves(nnx.state(grads)),
                             [np.asarray(g) for g in jax.tree.leaves(nnx.state(want_grads))])
    assert max(errors) <= tolerance, (implementation, max(errors), tolerance)


@pytest.mark.cpu_only
def test_data_parallel_train_step_matches_one_device():
  """The batch split over 8 host devices (a mesh of Explicit axes): the same losses, step for
  step, as on one device, with the kernels (Triton, interpreted) splitting with the batch."""
  cfg = dataclasses.replace(transformer.PRESETS["test"], implementation=None)
  tokens = [_tokens(cfg, batch=8, seed_label=("dp", i)) for i in range(3)]
  with jk.interpret_mode("triton"):
    model, optimizer = transformer.make(cfg, seed=3)
    want = [float(transformer.train_step(model, optimizer, t)) for t in tokens]
    model, optimizer = transformer.make(cfg, seed=3)
    mesh = transformer.data_parallel(model, optimizer, jax.devices()[:8])
    with jax.set_mesh(mesh):
      got = [float(transformer.train_step(model, optimizer, transformer.shard_batch(t, mesh)))
             for t in tokens]
  # Float32 throughout; the gradients' sums over the batch run in another order across shards.
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_mfu():
  cfg = transformer.PRESETS["small"]
  tokens_per_second = 1e5
  expected = 100 * cfg.flops_per_token(1024) * tokens_per_second / 989e12
  assert transformer.mfu(cfg, tokens_per_second, 1024, 989e12) == expected
