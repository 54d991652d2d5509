"""The Mosaic GPU matmul (Hopper): ``config`` (Config, the wave model, the heuristic, stream-K's
deal), ``kernel`` (the kernel bodies and the wrapper), ``epilogue`` (each warpgroup's tile
written out), ``padding`` (what TMA asks of the arrays, and the copy that cuts a padded C)."""

from jaxkernels.ops.matmul.mosaic_gpu.config import (
    CTA_SHAPES as CTA_SHAPES,
    WAVE_MARGIN as WAVE_MARGIN,
    Config as Config,
    StreamK as StreamK,
    config_error as config_error,
    fitted as fitted,
    heuristic as heuristic,
    predicted_seconds as predicted_seconds,
    tile_config as tile_config,
    unsupported as unsupported,
)
from jaxkernels.ops.matmul.mosaic_gpu.kernel import matmul as matmul
from jaxkernels.ops.matmul.mosaic_gpu.padding import crop as crop, padded_shapes as padded_shapes
