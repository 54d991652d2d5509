"""fp8_matmul: the training product in fp8 against its spec (each of the three products built
from ``jk.quantize`` and a float64 product of the dequantized operands), forward and
gradients, under jit and jax.checkpoint; its errors; the model's and the CLI's fp8 switch.

On both paths its products take: XLA's reference, and Mosaic GPU's block-scaled kernel, which
every product call is asserted to have run on; compiled on a Hopper GPU (the GPU check), and on
the CPU lowered for CUDA (its interpreter hangs on fp8 on jax 0.10.2)."""

from __future__ import annotations

import contextlib
import functools

import chex
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

import jaxkernels as jk
from jaxkernels.ops.matmul import reference as matmul_reference
from tests import numerics
from tests.conftest import cuda_lowering

E4M3 = jnp.float8_e4m3fn
PATHS = ("xla", "mosaic_gpu")


@contextlib.contextmanager
def _on(path):
  """Where ``path``'s products run, each of them asserted to have (a skip for the kernel on the
  CPU: test_lowers_for_cuda_on_its_kernels)."""
  if path == "mosaic_gpu" and not numerics.COMPILED:
    pytest.skip("Mosaic GPU's fp8 kernels: compiled in the GPU check (the interpreter hangs on "
                "fp8 on jax 0.10.2); lowered for CUDA on the CPU")
  with numerics.kernel_mode(), numerics.served_by(path, ["matmul"]):
    yield


@functools.partial(jax.jit, static_argnums=1)  # compiled as the op's quantizations are
def _quantized(x, block):
  return jk.quantize(x, dtype=E4M3, block=block)


def dequantized(x, block):
  """``x`` through fp8 and back, in float64 on the host. The fp8 array leaves the program that
  made it: inside one program XLA's GPU compiler drops an f32 -> fp8 -> f32 round trip as
  excess precision (its SimplifyFPConversions), and a spec jitted whole was the exact product
  there."""
  q, scale = (np.asarray(a, np.float64) for a in _quantized(x, block))
  rows, cols = block
  return q * np.repeat(np.repeat(scale, rows, axis=-2), cols, axis=-1)


def spec(x, w, dy):
  """(y, dx, dw) as the module docstring defines them, in float64 (x (M, K), M a multiple of
  128)."""
  y = dequantized(x, (1, 128)) @ dequantized(w, (128, 128))
  dx = dequantized(dy, (1, 128)) @ dequantized(w, (128, 128)).T
  dw = dequantized(x.T, (1, 128)) @ dequantized(dy, (128, 128))
  return y, dx, dw


def assert_close_to_spec(got, want, k, dtype):
  """Within the product's documented accuracy (``matmul_reference.fp8_accuracy``): the output
  rounding relative to each element, the tensor cores' accumulation relative to the largest."""
  per_element, per_max = matmul_reference.fp8_accuracy(k)
  rounding = float(jnp.finfo(dtype).eps)  # the output's own rounding (bfloat16: 2^-7)
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  bound = (max(per_element, rounding) * np.abs(want)
           + per_max * np.max(np.abs(want)) + 1e-30)
  np.testing.assert_array_less(np.abs(got - want), 2 * bound + 1e-6 * np.max(np.abs(want)))


@pytest.mark.parametrize("path", PATHS)
@hypothesis.settings(max_examples=numerics.draws(8), deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.differing_executors])
@hypothesis.given(lead=st.sampled_from([(), (2,), (2, 3)]), m=st.integers(1, 300),
                  k=st.sampled_from([128, 256, 384]), n=st.sampled_from([128, 256]),
                  dtype=st.sampled_from([jnp.bfloat16, jnp.float32]))
def test_forward_and_gradients_are_the_spec(path, lead, m, k, n, dtype):
  gen = numerics.rng("fp8", lead, m, k, n, jnp.dtype(dtype).name)
  x = numerics.normal(gen, (*lead, m, k), dtype)
  w = numerics.normal(gen, (k, n), dtype, k ** -0.5)
  dy = numerics.normal(gen, (*lead, m, n), dtype)
  with _on(path):
    y, vjp = jax.vjp(jax.jit(functools.partial(jk.fp8_matmul, implementation=path)), x, w)
    dx, dw = vjp(dy)
  chex.assert_shape(y, (*lead, m, n))
  chex.assert_type((y, dx, dw), dtype)
  rows = int(np.prod(lead, dtype=int)) * m
  pad = -rows % 128  # the spec over whole blocks of M: zero rows, as the op pads them
  flat = lambda a: jnp.pad(a.reshape(rows, -1).astype(jnp.float32), ((0, pad), (0, 0)))
  want_y, want_dx, want_dw = spec(flat(x), w.astype(jnp.float32), flat(dy))
  assert_close_to_spec(y.reshape(rows, n), want_y[:rows], k, dtype)
  assert_close_to_spec(dx.reshape(rows, k), want_dx[:rows], n, dtype)
  assert_close_to_spec(dw, want_dw, rows + pad, dtype)


@pytest.mark.parametrize("path", PATHS)
def test_it_is_near_the_exact_product(path):
  """fp8's 3 mantissa bits: each operand within 2^-4 of itself (relative), so the product's
  error stays a few percent of its size; a block scale applied to the wrong rows or columns
  would miss by O(1)."""
  gen = numerics.rng("fp8 exact")
  x = numerics.normal(gen, (256, 384), jnp.float32) * jnp.logspace(-3, 3, 256)[:, None]
  w = numerics.normal(gen, (384, 256), jnp.float32, 384 ** -0.5)
  dy = numerics.normal(gen, (256, 256), jnp.float32) * jnp.logspace(2, -2, 256)[:, None]
  with _on(path):
    y, vjp = jax.vjp(functools.partial(jk.fp8_matmul, implementation=path), x, w)
    dx, dw = vjp(dy)
  for got, want in ((y, x @ w), (dx, dy @ w.T), (dw, x.T @ dy)):
    rows = jnp.linalg.norm(got - want, axis=-1) / jnp.linalg.norm(want, axis=-1)
    assert float(jnp.max(rows)) < 2 ** -3, float(jnp.max(rows))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("policy", ["everything_saveable", "nothing_saveable",
                                    "dots_saveable"])
def test_under_checkpoint_the_saved_fp8_copies_keep_their_values(policy, path):
  """jax.checkpoint rounds each floating residual with reduce_precision, which takes e4m3fn's
  entries over 240 to NaN (JAX 0.10): the saved copies travel as their bits."""
  gen = numerics.rng("fp8 remat", policy)
  x = numerics.normal(gen, (128, 256), jnp.bfloat16)
  w = numerics.normal(gen, (256, 256), jnp.bfloat16, 0.05)
  f = lambda x, w: jnp.sum(jk.fp8_matmul(x, w, implementation=path).astype(jnp.float32) ** 2)
  with _on(path):
    want = jax.value_and_grad(f, argnums=(0, 1))(x, w)
    got = jax.value_and_grad(jax.checkpoint(f, policy=getattr(jax.checkpoint_policies, policy)),
                             argnums=(0, 1))(x, w)
  chex.assert_tree_all_finite(got)
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("x_shape, w_shape, message", [
    ((4, 96), (96, 128), r"K=96 must be a multiple of 128"),
    ((4, 128), (128, 200), r"N=200 must be a multiple of 128"),
    ((4, 128), (256, 128), r"x's last dimension 128 must equal w's first \(K\)"),
    ((4, 128), (128, 2, 64), r"w must be \(K, N\), got shape \(128, 2, 64\)"),
    ((128,), (128, 128), r"x must have rank >= 2, got shape \(128,\)"),
])
def test_bad_shapes_are_named(x_shape, w_shape, message):
  with pytest.raises(ValueError, match="fp8_matmul: " + message):
    jk.fp8_matmul(jnp.ones(x_shape, jnp.bfloat16), jnp.ones(w_shape, jnp.bfloat16))


def test_a_block_of_float32_subnormals_quantizes_without_nan():
  """A block whose largest entry over 448 is below float32's least normal (a backward's
  vanishing gradient rows) took the scale to 0 and the block to NaN (0/0)."""
  x = jnp.full((2, 128), 1e-37, jnp.float32).at[1].set(0.0)
  q, scale = jk.quantize(x, block=(1, 128))
  chex.assert_tree_all_finite((q.astype(jnp.float32), scale))
  chex.assert_trees_all_close(q.astype(jnp.float32) * scale[:, :1], x, rtol=2 ** -3)


@pytest.mark.cpu_only
def test_the_model_trains_in_fp8_near_its_bf16_run():
  """Config(fp8=True): the blocks' products in fp8. Same first loss to fp8's accuracy (the
  products differ by a few percent, the loss by far less), and a few steps on one batch fall
  as the 16-bit run's do."""
  from models import hparams, llama, train_step

  shape = dict(width=256, heads=4, kv_heads=2, mlp_width=512, depth=2, vocab=512)
  tc = hparams.TrainConfig(batch=2, seq_len=64, steps=10)
  tokens = jax.random.randint(jax.random.key(0), (2, 65), 0, 512)
  losses = {}
  for fp8 in (False, True):
    graphdef, state = train_step.init(llama.preset("125m", fp8=fp8, **shape), tc)
    step = train_step.step_fn(graphdef)
    losses[fp8] = []
    for _ in range(6):
      state, metrics = step(state, tokens)
      losses[fp8].append(float(metrics["loss"]))
  assert abs(losses[True][0] - losses[False][0]) < 1e-2 * losses[False][0], losses
  assert losses[True][-1] < 0.9 * losses[True][0], losses


def test_the_config_and_the_cli_say_what_fp8_needs(capsys):
  from models import llama, train

  with pytest.raises(ValueError, match=r"fp8=True quantizes in blocks of 128.*'width': 64"):
    llama.preset("tiny", fp8=True)
  assert train.main(["--preset", "tiny", "--fp8", "--steps", "2"]) == 2
  assert "error: --preset tiny --fp8: fp8=True quantizes in blocks of 128" in (
      capsys.readouterr().err)


@pytest.mark.parametrize("path", PATHS)
def test_on_the_one_device_mesh_the_cli_builds(path):
  """The train CLI lays everything out on a mesh of Explicit axes, of size 1 on one device:
  the batch is typed as split over (data, fsdp) though nothing is, and the blocks' reshapes
  refused it. The operands are taken whole there (free), forward and backward."""
  from models import placement

  mesh = placement.mesh(1, jax.devices()[:1])
  gen = numerics.rng("fp8 mesh")
  x = numerics.normal(gen, (2, 128, 256), jnp.bfloat16)
  w = numerics.normal(gen, (256, 128), jnp.bfloat16, 0.05)
  loss = jax.value_and_grad(lambda x, w: jnp.sum(jk.fp8_matmul(
      x, w, implementation=path).astype(jnp.float32)), argnums=(0, 1))
  with _on(path):
    want = jax.jit(loss)(x, w)  # compiled both: op by op, XLA:CPU takes x / scale as
    # x * (1 / scale) in one program and not the other, and an entry on an fp8 rounding boundary
    # goes the other way (a rank-1 dw then differs by its ulp, 6%)
  with jax.set_mesh(mesh), _on(path):
    xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
        ("data", "fsdp"))))
    got = jax.jit(loss)(xs, w)
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=0)


def test_lowers_for_cuda_on_its_kernels():
  """Forward and both gradients, lowered for CUDA with no GPU: each of the three products a
  Mosaic GPU kernel in the program (its custom call), and every product call on them."""
  x = jax.ShapeDtypeStruct((256, 384), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((384, 128), jnp.bfloat16)
  loss = lambda x, w: jnp.sum(jk.fp8_matmul(x, w, implementation="mosaic_gpu").astype(
      jnp.float32))
  with numerics.served_by("mosaic_gpu", ["matmul"]) as calls:
    text = cuda_lowering(jax.value_and_grad(loss, argnums=(0, 1)), x, w)
  assert len(calls) == 3, calls  # y = x w, dx = dy wT, dw = xT dy
  assert text.count("custom_call @mosaic_gpu") == 3, text.count("custom_call @mosaic_gpu")
