"""jaxkernels: JAX Pallas kernels for TPU and CUDA GPUs, with exact jnp references."""

from jaxkernels.backend import (
    FallbackWarning as FallbackWarning,
    IMPLEMENTATIONS as IMPLEMENTATIONS,
    interpret_mode as interpret_mode,
    supports as supports,
)
from jaxkernels.ops.norms.api import layer_norm as layer_norm, rms_norm as rms_norm

__version__ = "0.1.0"
