"""Mosaic GPU's product schedules: the ragged-edge crop, the wave model that picks CTA
tiles, every CTA shape lowering for CUDA, Stream-K's plan, heuristic and numerics, and TMA's
padding."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkernels as jk
from jaxkernels import _mosaic_gpu, hardware
from jaxkernels.ops.matmul import mosaic_gpu
from jaxkernels.ops.matmul.common import Problem
from bench import shapes
from tests import numerics
from tests.conftest import cuda_lowering


@pytest.mark.parametrize("shape,padded", [((33, 1025), (40, 1100)), ((17, 513), (17, 520)),
                                          ((1, 1), (8, 64)), ((40, 1100), (40, 1100))])
def test_crop(shape, padded):
  """The copy that cuts Mosaic GPU's padded C, odd rows and columns included, bit-exact."""
  gen = np.random.default_rng(3)
  y = numerics.normal(gen, padded, jnp.bfloat16)
  got = mosaic_gpu.crop(y, *shape, interpret=True)
  assert got.shape == shape
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(y[:shape[0], :shape[1]], np.float32))
  too_many = (padded[0] + 1, 1)
  with pytest.raises(ValueError, match=re.escape(f"at least {too_many}, got shape {padded}")):
    mosaic_gpu.crop(y, *too_many)


def test_mosaic_gpu_wave_model():
  """The heuristic leaves 128 x 256 tiles where they fill their waves and takes fuller waves
  where they do not (3072^3: 2.2 waves of 128 x 256 against 2.9 of 128 x 192)."""
  chip = hardware.chip_for("NVIDIA H200")
  bf = jnp.dtype(jnp.bfloat16)
  problem = lambda m, n, k: Problem(m=m, n=n, k=k, dtype=bf, out_dtype=bf)
  cta = lambda p: (lambda c: (c.cta_m, c.cta_n))(mosaic_gpu.heuristic(p, chip))
  assert cta(problem(8192, 8192, 8192)) == cta(problem(4096, 4096, 4096)) == (128, 256)
  assert cta(problem(3072, 3072, 3072)) == cta(problem(1536, 1536, 1536)) == (128, 192)
  assert cta(problem(1024, 1024, 1024)) == (64, 128)  # 128 tiles: the most SMs at work
  # 6528^3: 128 x 256 tiles make 10.05 waves, 256 x 192 ones 6.7.
  assert cta(problem(6528, 6528, 6528)) == (256, 192)
  # 4224 x 640: 128 x 256 tiles make 33 x 3 = 99 (0.75 waves); 256 x 128 ones 17 x 5 = 85.
  tall = problem(4224, 640, 4096)
  chosen = mosaic_gpu.heuristic(tall, chip)
  for tile_m, tile_n, split in mosaic_gpu.CTA_SHAPES:
    other = mosaic_gpu.Config(tile_m=tile_m, tile_n=tile_n, split=split)
    assert mosaic_gpu.predicted_seconds(tall, chosen, 132) <= \
        mosaic_gpu.predicted_seconds(tall, other, 132) / (1 - mosaic_gpu.WAVE_MARGIN)


def _lowered(p: Problem, config) -> str:
  """Mosaic GPU's kernel for ``p`` lowered for CUDA: bias and residual with a 16-bit problem,
  a_scale and b_scale with an fp8 one (the shapes' ragged edges included)."""
  fp8 = p.has_scales
  m, n, k = p.m, p.n, p.k

  def fn(a, b, v, r, s):
    return mosaic_gpu.matmul(a, b, bias=None if fp8 else v, residual=None if fp8 else r,
                             a_scale=s if fp8 else None, b_scale=v if fp8 else None,
                             problem=p, config=config)
  return cuda_lowering(fn, jax.ShapeDtypeStruct((m, k), p.dtype),
                       jax.ShapeDtypeStruct((k, n), p.dtype),
                       jax.ShapeDtypeStruct((n,), jnp.float32),
                       jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
                       jax.ShapeDtypeStruct((m,), jnp.float32))


@pytest.mark.parametrize("shape", mosaic_gpu.CTA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_mosaic_gpu_cta_shapes_lower(shape):
  """Each CTA tile the heuristic may choose through Mosaic GPU's compiler passes (which the
  interpreter skips), on a ragged shape: bf16 with gelu + bias + residual, and fp8 with
  scales (128-deep K steps)."""
  tile_m, tile_n, split = shape
  m, n, k = 1000, 1030, 520
  for dtype, act in ((jnp.bfloat16, "gelu"), (jnp.float8_e4m3fn, None)):
    fp8 = act is None
    p = Problem(m=m, n=n, k=k, dtype=jnp.dtype(dtype), out_dtype=jnp.dtype(jnp.bfloat16),
                activation=act, has_bias=not fp8, has_residual=not fp8, has_scales=fp8)
    chip = hardware.chip_for("NVIDIA H200")
    config = mosaic_gpu.fitted(p, mosaic_gpu.tile_config(p, shape), chip)
    assert (config.tile_m, config.tile_n, config.split, config.tile_k) == (*shape, 64 + 64 * fp8)
    assert mosaic_gpu.config_error(p, config, chip) is None

    assert "mosaic_gpu" in _lowered(p, config)


@pytest.mark.parametrize("tiles,k_steps,ctas", [(3, 5, 2), (7, 4, 3), (1, 17, 132), (435, 58, 132),
                                                  (5, 1, 4), (800, 80, 132)])
@pytest.mark.parametrize("wave", [True, False])
def test_stream_k_plan(tiles, k_steps, ctas, wave):
  """Stream-K's runs (``StreamK``) cover every K step of the cut tiles once; each tile's
  first step lies in its owner's run, and the runs after the owner's that hold its other steps
  are exactly ``cta + 1 .. last_run(tile)``, each beginning there (so each CTA hands over at
  most one partial, first thing). Whole tiles fill whole waves, one wave fewer than there are
  when tiles are left over (``stream_k_wave``), or all of them."""
  k = k_steps
  problem = Problem(m=tiles * 64, n=64, k=k * 64, dtype=jnp.dtype(jnp.bfloat16),
                    out_dtype=jnp.dtype(jnp.bfloat16))
  config = mosaic_gpu.Config(tile_m=64, tile_n=64, tile_k=64, split="m", stream_k=True,
                             stream_k_wave=wave)
  plan = mosaic_gpu.StreamK.plan(problem, config, ctas)
  assert config.cta_m == 128 and plan.whole + plan.cut == math.ceil(tiles / 2)
  tiles = plan.whole + plan.cut
  assert plan.whole % ctas == 0
  assert plan.whole == (tiles if tiles % ctas == 0 else max(tiles // ctas - wave, 0) * ctas)
  start = [int(plan.start(r)) for r in range(ctas + 1)]
  owner_of, covered = {}, []
  for r in range(ctas):
    for step in range(start[r], start[r + 1]):
      covered.append(step)
      tile, k_step = divmod(step, k)
      if k_step == 0:
        owner_of[tile] = r
      else:  # a run that does not begin the tile holds its steps only where the run begins
        assert step == start[r] or (step - 1) // k == tile
  assert covered == list(range(plan.steps))
  for tile, owner in owner_of.items():
    helpers = [r for r in range(ctas) if r != owner and
               any(tile * k <= s < (tile + 1) * k for s in range(start[r], start[r + 1]))]
    assert helpers == list(range(owner + 1, int(plan.last_run(tile)) + 1))
    assert all(tile * k < start[r] < (tile + 1) * k for r in helpers)


def test_stream_k_heuristic_and_lowering(monkeypatch):
  """The heuristic cuts the last wave where it stays part-empty after whole waves and the
  model, with cut tiles slower the larger the operands, predicts a gain: 3712^3 (3.3 waves of
  128 x 256 tiles) and 5120^3 (6.06), not 4096^3 (3.9) or 8192^3 (15.5), nor below two waves
  (1536^3, where the hand-over ran 50% slower). Stream-K then lowers for CUDA on a ragged
  shape with gelu + bias + residual and for fp8 with scales. The interpreter has no
  semaphores (jax 0.10.2), so its numerics are checked on the GPU machine (`python -m bench
  matmul --only streamk`: 49 checks, results/)."""
  chip = hardware.chip_for("NVIDIA H200")
  bf = jnp.dtype(jnp.bfloat16)
  pick = lambda s: mosaic_gpu.heuristic(Problem(m=s, n=s, k=s, dtype=bf, out_dtype=bf), chip)
  assert pick(3712).stream_k and pick(5120).stream_k
  assert not any(pick(s).stream_k for s in (4096, 8192, 1536, 6144))
  assert (pick(5120).epi_tile_m, pick(5120).stages) == (64, 4)  # whole-tile pieces: ring-slow
  with pytest.raises(ValueError, match="stream_k=True needs the cooperative schedule"):
    mosaic_gpu.Config(schedule="pingpong", stream_k=True)
  monkeypatch.setattr(_mosaic_gpu, "num_sms", lambda: 132)
  m, n, k = 1000, 1030, 520  # 4 x 6 CTA tiles of 256 x 192, 9 K steps each: 132 runs of 1-2
  for dtype, act in ((jnp.bfloat16, "gelu"), (jnp.float8_e4m3fn, None)):
    fp8 = act is None
    p = Problem(m=m, n=n, k=k, dtype=jnp.dtype(dtype), out_dtype=bf, activation=act,
                has_bias=not fp8, has_residual=not fp8, has_scales=fp8)
    config = mosaic_gpu.fitted(p, dataclasses.replace(
        mosaic_gpu.tile_config(p, (128, 192, "m")), stream_k=True), chip)

    assert "mosaic_gpu" in _lowered(p, config)


@pytest.mark.parametrize("m,k,n", [(192, 320, 128), (300, 1000, 260)])
def test_stream_k(monkeypatch, m, k, n):
  """Stream-K on two SMs: runs that end one tile and begin the next, owners adding partials.
  Under the interpreter, which has no semaphores, a stream-K config walks the same tiles whole
  on the same ring: the product is still right either way (bf16 output: within its rounding).
  Ragged edges (the second shape) only compiled: the interpreter has no TMA edge handling."""
  if (m, k, n) != (192, 320, 128) and not numerics.COMPILED:
    pytest.skip("ragged edges: compiled only (JAXKERNELS_TEST_COMPILED on a Hopper GPU)")
  monkeypatch.setattr(_mosaic_gpu, "num_sms", lambda: 2)
  gen = numerics.rng("stream-k", m, k, n)
  a = numerics.normal(gen, (m, k), jnp.bfloat16)
  b = numerics.normal(gen, (k, n), jnp.bfloat16)
  config = mosaic_gpu.Config(tile_m=64, tile_n=64, tile_k=64, stages=3, stream_k=True)
  with numerics.kernel_mode():
    numerics.must_serve(jk.supports("matmul", "mosaic_gpu", a, b))
    y = jk.matmul(a, b, implementation="mosaic_gpu", config=config)
  want = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  assert np.abs(np.asarray(y, np.float64) - want).max() <= 2 ** -8 * np.abs(want).max()


def test_mosaic_gpu_padding():
  """Only TMA's alignment pads A, B and C; a residual, read piece by piece through C's
  buffers, pads C so that no piece starts past its end."""
  bf = jnp.dtype(jnp.bfloat16)
  shapes = lambda size, **kw: mosaic_gpu.padded_shapes(
      Problem(m=size, n=size, k=size, dtype=bf, out_dtype=bf, **kw), mosaic_gpu.Config())
  assert shapes(4224) == ((4224, 4224),) * 3  # 16.5 CTA tiles of 256 columns: no padding
  assert shapes(8193) == ((8200, 8256),) * 3  # rows to 8, rows of 128 bytes
  # 64 x 64 pieces: the last CTA tile's would start past 8200 rows and 8256 columns.
  assert shapes(8193, has_residual=True)[2] == (8320, 8448)
  assert shapes(6, has_residual=True) == ((8, 64), (8, 64), (128, 256))
