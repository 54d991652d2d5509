"""Pallas Mosaic GPU flash attention for Hopper: FlashAttention-3's schedule.

A CTA takes two blocks of ``block_q`` queries of one head; three warpgroups share it. One
issues TMA loads of the key and value blocks into a ``stages``-deep ring of swizzled shared
memory; each of the other two owns one query block and runs S = q k^T and then P V on wgmma,
q and k from shared memory, P from registers, the float32 accumulator in registers. The two
compute warpgroups take turns at the tensor cores (the "schedule barrier", a rendezvous
twice a step): while one runs its softmax, the other's matmuls run. Statistics are the online
softmax's in base 2 (one ex2 per score, the scale folded into an FMA).

Masks as the Triton kernels do them (``common.key_blocks``): each warpgroup walks the key
blocks its window leaves visible in three runs, only the edge runs paying for a position
mask; the ring is filled with the union of the two warpgroups' runs, and a warpgroup idles
through the steps outside its own (it still waits for and releases their slots, so that the
barriers' phases stay in step). Segment ids come with the key blocks (one more TMA copy a
step) and mask every block; a tile visits only the key blocks whose id ranges overlap its own
(``schedule.meeting_blocks``, computed by XLA before the kernel: packed sequences skip each other).
A bias comes the same way, the CTA's (2 block_q, block_kv) tile a stage, each compute
warpgroup reading its half in the WGMMA layout; past head dim 128, where a ring of them does
not fit beside q, k and v, each compute warpgroup loads its own half, one buffer deep.

Edges: swizzled TMA reads rows in tiles of 8 and no copy may run past an array, so T and S
are padded to whole blocks where they are not (one copy of q, k and v, and of the output);
the keys past S are masked in the last block. The log-sum-exp is written (B, N, T) and
transposed by XLA (a few hundred KiB).

The backward is two more kernels of the same make (a dq kernel, and a dk/dv kernel that walks
the queries for each block of keys), both reading a bias as the forward does (the dk/dv kernel
a transposed copy of it); and with a bias a third, d(bias)'s, its own launch (XLA drops it
where the bias's gradient is not asked for).

The package: ``config`` (the Config, its heuristic, what each kernel needs of shared memory),
``schedule`` (the warpgroups' roles and the walk every kernel shares), ``forward``,
``backward`` and ``dbias``; the interpreter's shims are the toolchain's
(``jaxkernels._mosaic_gpu``).
"""

from jaxkernels.ops.attention.mosaic_gpu.backward import backward as backward
from jaxkernels.ops.attention.mosaic_gpu.config import (Config as Config,
                                                        backward_smem_bytes as
                                                        backward_smem_bytes,
                                                        config_error as config_error,
                                                        head_parts as head_parts,
                                                        heuristic as heuristic,
                                                        on_auto as on_auto,
                                                        smem_bytes as smem_bytes,
                                                        unsupported as unsupported)
from jaxkernels.ops.attention.mosaic_gpu.forward import forward as forward
