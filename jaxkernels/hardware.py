"""Chip table: the numbers heuristics and rooflines are computed from.

Datasheet numbers are the vendors' (dense, no sparsity). ``measured`` holds
ceilings read on a real machine of ours (the device tool's GPU machines,
jaxkernels' own bench runs); rooflines prefer them, because a datasheet peak is
a lead, not a ceiling code reaches.

Sources:
  [nv-h100]  NVIDIA H100 Tensor Core GPU datasheet (SXM5 column).
  [nv-h200]  NVIDIA H200 Tensor Core GPU datasheet (SXM column).
  [nv-a100]  NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB column).
  [nv-hopper-tuning]  CUDA Hopper tuning guide: 228 KB shared memory per SM, 227 KB per block.
  [gc-tpu]   Google Cloud TPU system architecture pages for v4, v5e, v5p, v6e.
  [jax-tpu-info]  jax/_src/pallas/mosaic/tpu_info.py (VMEM capacity per core, MXU shape).
  [kinds]    the GPU machines we measure on (their device kinds and clocks as they report
             them, 2026-10-28 .. 2026-11-21; results/ holds those runs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

TB = 1e12
MiB = 1 << 20
GiB = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
  name: str
  platform: str  # "gpu" | "tpu"
  device_kinds: tuple[str, ...]  # jax Device.device_kind values (exact, lower-cased match)
  peak_flops: Mapping[str, float]  # dtype -> dense FLOP/s (int8: OP/s)
  hbm_bandwidth: float  # bytes/s, datasheet
  hbm_bytes: int
  onchip_bytes: int  # TPU: VMEM per TensorCore; GPU: shared memory per SM
  block_onchip_bytes: int | None = None  # GPU: shared memory one CTA may take
  registers_per_sm: int | None = None  # GPU: 32-bit registers in an SM's register file
  cores: int  # TPU: TensorCores per chip (megacore); GPU: SMs
  mxu: int | None = None  # TPU: MXU edge (128 or 256)
  l2_bytes: int | None = None
  compute_capability: tuple[int, int] | None = None
  measured: Mapping[str, float] = dataclasses.field(default_factory=dict)
  sources: tuple[str, ...] = ()

  @property
  def copy_bandwidth(self) -> float:
    """Best device-to-device copy bandwidth known (read + write bytes per second)."""
    return self.measured.get("copy_bandwidth", self.hbm_bandwidth)

  def flops(self, dtype: str) -> float:
    return self.measured.get(f"{dtype}_matmul", self.peak_flops[dtype])


_HOPPER_FLOPS = {
    "float32": 66.9 * TB,  # CUDA cores
    "tf32": 494.7 * TB,
    "bfloat16": 989.4 * TB,
    "float16": 989.4 * TB,
    "float8_e4m3fn": 1978.9 * TB,
    "float8_e5m2": 1978.9 * TB,
    "int8": 1978.9 * TB,
}

CHIPS: tuple[Chip, ...] = (
    Chip(
        name="H100",
        platform="gpu",
        device_kinds=("nvidia h100 80gb hbm3", "nvidia h100", "nvidia h100 sxm5 80gb"),
        peak_flops=_HOPPER_FLOPS,
        hbm_bandwidth=3.35 * TB,
        hbm_bytes=80 * GiB,
        onchip_bytes=228 * 1024,
        block_onchip_bytes=227 * 1024,  # [nv-hopper-tuning]
        registers_per_sm=64 * 1024,  # [nv-hopper-tuning]
        cores=132,
        l2_bytes=50 * MiB,
        compute_capability=(9, 0),
        # [kinds] 2026-11-13: torch copy ~3.0 TB/s, bf16 8192^3 at 798 TFLOP/s on random data.
        measured={"copy_bandwidth": 3.0 * TB, "bfloat16_matmul": 798 * TB},
        sources=("nv-h100", "nv-hopper-tuning", "kinds"),
    ),
    Chip(
        name="H200",
        platform="gpu",
        device_kinds=("nvidia h200", "nvidia h200 nvl"),
        peak_flops=_HOPPER_FLOPS,
        hbm_bandwidth=4.8 * TB,
        hbm_bytes=141 * 10**9,
        onchip_bytes=228 * 1024,
        block_onchip_bytes=227 * 1024,  # [nv-hopper-tuning]
        registers_per_sm=64 * 1024,  # [nv-hopper-tuning]
        cores=132,
        l2_bytes=60 * 10**6,  # [kinds] torch reported 60 MB of L2
        compute_capability=(9, 0),
        # [kinds] anchors measured 2026-11-21: torch 2 GiB copy 4.24 TB/s, cuBLAS bf16 8192^3 790 TFLOP/s.
        measured={"copy_bandwidth": 4.24 * TB, "bfloat16_matmul": 790 * TB},
        sources=("nv-h200", "nv-hopper-tuning", "kinds"),
    ),
    Chip(
        name="A100",
        platform="gpu",
        device_kinds=("nvidia a100-sxm4-80gb", "nvidia a100-sxm4-40gb", "nvidia a100 80gb pcie"),
        peak_flops={
            "float32": 19.5 * TB,
            "tf32": 156 * TB,
            "bfloat16": 312 * TB,
            "float16": 312 * TB,
            "int8": 624 * TB,
        },
        hbm_bandwidth=2.039 * TB,
        hbm_bytes=80 * GiB,
        onchip_bytes=164 * 1024,
        block_onchip_bytes=163 * 1024,  # CUDA programming guide, compute capability 8.0
        registers_per_sm=64 * 1024,
        cores=108,
        l2_bytes=40 * MiB,
        compute_capability=(8, 0),
        sources=("nv-a100",),
    ),
    Chip(
        name="TPU v4",
        platform="tpu",
        device_kinds=("tpu v4",),
        peak_flops={"bfloat16": 275 * TB},
        hbm_bandwidth=1.2 * TB,
        hbm_bytes=32 * GiB,
        onchip_bytes=16 * MiB,
        cores=2,
        mxu=128,
        sources=("gc-tpu", "jax-tpu-info"),
    ),
    Chip(
        name="TPU v5e",
        platform="tpu",
        device_kinds=("tpu v5 lite", "tpu v5e"),
        peak_flops={"bfloat16": 197 * TB, "int8": 394 * TB},
        hbm_bandwidth=0.819 * TB,
        hbm_bytes=16 * GiB,
        onchip_bytes=128 * MiB,
        cores=1,
        mxu=128,
        sources=("gc-tpu", "jax-tpu-info"),
    ),
    Chip(
        name="TPU v5p",
        platform="tpu",
        device_kinds=("tpu v5", "tpu v5p"),
        peak_flops={"bfloat16": 459 * TB, "int8": 918 * TB},
        hbm_bandwidth=2.765 * TB,
        hbm_bytes=95 * GiB,
        onchip_bytes=64 * MiB,
        cores=2,
        mxu=128,
        sources=("gc-tpu", "jax-tpu-info"),
    ),
    Chip(
        name="TPU v6e",
        platform="tpu",
        device_kinds=("tpu v6 lite", "tpu v6e"),
        peak_flops={
            "bfloat16": 918 * TB,
            "int8": 1836 * TB,
            "float8_e4m3fn": 918 * TB,  # [jax-tpu-info]: no faster than bf16 on v6e
        },
        hbm_bandwidth=1.64 * TB,
        hbm_bytes=32 * GiB,
        onchip_bytes=128 * MiB,
        cores=1,
        mxu=256,
        sources=("gc-tpu", "jax-tpu-info"),
    ),
)

_BY_KIND = {kind: chip for chip in CHIPS for kind in chip.device_kinds}
_BY_NAME = {chip.name: chip for chip in CHIPS}

# When tracing for a TPU whose generation cannot be seen (AOT from a CPU host),
# configs are sized for the smallest VMEM among the chips we compile for.
SMALLEST_VMEM_TPU = _BY_NAME["TPU v4"]
DEFAULT_GPU = _BY_NAME["H100"]
# A small topology of each TPU generation we compile for, by name for
# jax.experimental.topologies.get_topology_desc: AOT compiles from a host without a TPU.
TPU_TOPOLOGIES = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


def chip_for(device_kind: str) -> Chip | None:
  """The chip for a jax ``device_kind`` (e.g. "NVIDIA H200", "TPU v5 lite"), or None."""
  kind = device_kind.strip().lower()
  if kind in _BY_KIND:
    return _BY_KIND[kind]
  for chip in CHIPS:  # e.g. "NVIDIA H100 PCIe": same SM count class, slower HBM; close enough for tiling
    if chip.platform == "gpu" and chip.name.lower() in kind:
      return chip
  return None


def unknown_chip(device_kind: str, platform: str) -> Chip:
  """A device of ``platform`` that the table does not know: the stand-in chip's sizes (an H100;
  the TPU with the least VMEM), named for the device, its compute capability unknown (so
  that a kernel that needs a given one refuses it)."""
  stand_in = DEFAULT_GPU if platform == "gpu" else SMALLEST_VMEM_TPU
  return dataclasses.replace(stand_in, name=device_kind, device_kinds=(device_kind.lower(),),
                             compute_capability=None, measured={}, sources=())


def chip(name: str) -> Chip:
  """A chip by its table name ("H200", "TPU v6e", ...)."""
  try:
    return _BY_NAME[name]
  except KeyError:
    raise ValueError(f"unknown chip {name!r}; known: {sorted(_BY_NAME)}") from None
