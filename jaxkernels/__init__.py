"""jaxkernels: JAX Pallas kernels for TPU and CUDA GPUs, with exact jnp references."""

from jaxkernels.backend import supports as supports
from jaxkernels.dispatch import (FallbackWarning as FallbackWarning,
                                 IMPLEMENTATIONS as IMPLEMENTATIONS)
from jaxkernels.interpret import interpret_mode as interpret_mode
from jaxkernels import timing as timing, tuning as tuning
from jaxkernels.partitioning import (ShardingWarning as ShardingWarning,
                                     partition_spec as partition_spec, zigzag as zigzag,
                                     sharding_rules as sharding_rules)
from jaxkernels.ops.cross_entropy.api import softmax_cross_entropy as softmax_cross_entropy
from jaxkernels.ops.cross_entropy.linear import (
    linear_softmax_cross_entropy as linear_softmax_cross_entropy)
from jaxkernels.ops.attention.api import flash_attention as flash_attention
from jaxkernels.ops.attention.decode import decode_attention as decode_attention
from jaxkernels.ops.matmul.api import matmul as matmul
from jaxkernels.quantize import quantize as quantize
from jaxkernels.fp8 import fp8_matmul as fp8_matmul
from jaxkernels.ops.elementwise.api import bias_activation as bias_activation, glu as glu
from jaxkernels.ops.norms.api import layer_norm as layer_norm, rms_norm as rms_norm
from jaxkernels.ops.softmax.api import softmax as softmax

__version__ = "0.1.0"
