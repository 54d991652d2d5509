"""Tuning: the user's cache on disk, the shipped tables and ``tuning.ship``, and every kernel
heuristic's config valid for the problems it serves (the matmul's backends here, the
widest set of configs)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib

import jax.numpy as jnp
import pytest

from jaxkernels import backend, hardware, tuning
from jaxkernels.ops.matmul import mosaic_gpu, mosaic_tpu, triton
from jaxkernels.ops.matmul.common import Problem


def test_tuning_cache_roundtrip(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXKERNELS_CACHE_DIR", str(tmp_path))
  p = Problem(m=3000, n=3000, k=3000, dtype=jnp.dtype(jnp.bfloat16),
              out_dtype=jnp.dtype(jnp.bfloat16))
  chip = hardware.chip_for("NVIDIA H100 80GB HBM3")
  kernels = backend.kernels("matmul")["triton"]
  assert tuning.config_for(kernels, p, chip) == triton.heuristic(p, chip)
  mine = triton.Config(block_m=64, block_n=64, block_k=32, group_m=4, num_warps=4, num_stages=2)
  tuning.record(kernels, p, "NVIDIA H100 80GB HBM3", mine, 1e-3)
  assert tuning.config_for(kernels, p, chip) == mine
  # A shape in the same bucket shares the entry; another bucket does not.
  assert tuning.config_for(kernels, Problem(**{**p.__dict__, "m": 2950}), chip) == mine
  assert tuning.config_for(kernels, Problem(**{**p.__dict__, "m": 5000}), chip) != mine
  # An activation epilogue is tuned apart: the plain entry does not serve it.
  act = Problem(**{**p.__dict__, "activation": "gelu", "has_bias": True})
  assert tuning.config_for(kernels, act, chip) == triton.heuristic(act, chip)
  # The op is part of the key: another op's kernels never read the matmul's entry.
  assert all(k.startswith("matmul|triton|nvidia h100 80gb hbm3|jax")
             for k in json.loads((tmp_path / "tuning.json").read_text()))
  (tmp_path / "tuning.json").write_text("{not json")
  assert tuning.config_for(kernels, p, chip) == triton.heuristic(p, chip)


def test_shipped_table_and_ship(tmp_path):
  p = Problem(m=8192, n=8192, k=8192, dtype=jnp.dtype(jnp.bfloat16),
              out_dtype=jnp.dtype(jnp.bfloat16))
  chip = hardware.chip_for("NVIDIA H200")
  kernels = backend.kernels("matmul")["mosaic_gpu"]
  table = json.loads((pathlib.Path(tuning.__file__).parent / "data" / "tuned" / "nvidia_h200" /
                      "matmul.json").read_text())["entries"]
  for size in (8192, 4096):
    q = dataclasses.replace(p, m=size, n=size, k=size)
    entry = table[tuning.key(kernels, q, "NVIDIA H200", versioned=False)]
    assert tuning.config_for(kernels, q, chip, device_kind="NVIDIA H200") == \
        mosaic_gpu.Config(**entry["config"])
  # bias+gelu is not served by the plain 4096 entry (its key names the epilogue): the heuristic
  # runs it, with the 2 epilogue buffers over 3 stages it gives activation epilogues, on the
  # ring in 128 x 256 tiles.
  act = dataclasses.replace(p, m=4096, n=4096, k=4096, activation="gelu", has_bias=True)
  assert tuning.key(kernels, act, "NVIDIA H200", versioned=False) not in table
  config = tuning.config_for(kernels, act, chip, device_kind="NVIDIA H200")
  assert config == mosaic_gpu.heuristic(act, chip)
  assert (config.cta_m, config.cta_n, config.ring, config.stages, config.epi_slots,
          config.epi_tile_m, config.epi_tile_n) == (128, 256, True, 3, 2, 64, 64)
  plain = mosaic_gpu.heuristic(p, chip)  # 128 x 256 tiles: the ring, 64 x 64 pieces, 4 stages
  assert (plain.ring, plain.stages, plain.epi_tile_m, plain.epi_tile_n) == (True, 4, 64, 64)
  # Other 128-row warpgroup tiles (256 x 128): JAX's pipeline, one whole-tile piece, 3 stages.
  tall = mosaic_gpu.fitted(p, mosaic_gpu.tile_config(p, (128, 128, "m")), chip)
  assert (tall.ring, tall.stages, tall.epi_tile_m, tall.epi_tile_n) == (False, 3, 128, 128)
  # 64-row warpgroup tiles (1536^3: 128 x 192 CTA tiles) keep 64 x 64 pieces over 4 stages.
  small = mosaic_gpu.heuristic(dataclasses.replace(p, m=1536, n=1536, k=1536), chip)
  assert (small.tile_m, small.stages, small.epi_tile_m, small.epi_tile_n) == (64, 4, 64, 64)
  cache = tmp_path / "cache.json"
  cache.write_text(json.dumps({"matmul|triton|gpu x|jax9.9|bfloat16->bfloat16|nn|1024x1024x1024":
                               {"config": {}, "seconds": 1.0}}))
  assert tuning.ship(cache, tmp_path, note="test") == 1
  assert list(json.loads((tmp_path / "gpu_x" / "matmul.json").read_text())["entries"]) == [
      "matmul|triton|gpu x|bfloat16->bfloat16|nn|1024x1024x1024"]


@pytest.mark.parametrize("module", [triton, mosaic_gpu, mosaic_tpu])
@pytest.mark.parametrize("size", [1, 100, 4096, 8193])
def test_heuristics_are_valid(module, size):
  dtypes = {triton: (jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn),
            mosaic_gpu: (jnp.bfloat16, jnp.float8_e4m3fn),
            mosaic_tpu: (jnp.bfloat16, jnp.float32, jnp.int8)}[module]
  chip = hardware.DEFAULT_GPU if module is not mosaic_tpu else hardware.SMALLEST_VMEM_TPU
  for dtype, out_dtype, activation in itertools.product(
      dtypes, (jnp.bfloat16, jnp.float32), (None, "gelu")):
    # With an activation the training forward also saves the pre-activation: two outputs.
    p = Problem(m=size, n=size, k=size, dtype=jnp.dtype(dtype), out_dtype=jnp.dtype(out_dtype),
                activation=activation, has_bias=activation is not None,
                save_preactivation=activation is not None)
    assert module.config_error(p, module.heuristic(p, chip), chip) is None, p
