"""Ops on sharded arrays: an op whose inputs are split over a mesh runs its kernels once per
shard, under ``jax.shard_map`` over the mesh the inputs carry, with the collectives its rule
asks for and no others.

Why shard_map, not ``custom_partitioning`` (notes/base.md, sharding-1): a Pallas call is one
opaque custom call, which neither GSPMD nor Shardy can split (Mosaic TPU refuses, "cannot be
automatically partitioned"; a Triton call is pinned to one device). ``custom_partitioning``
hands the split to a Python callback at compile time, but on TPU the callback is never
registered (jax-ml/jax#38196: "Custom emitter for CustomSPMDPartitioning not found", also AOT
for v5e from a CPU host), and the TPU interpreter's callbacks are refused inside it. shard_map
works for every backend, interpreted and compiled, forward and backward (its transpose sums the
cotangents of operands that every shard shares: d(scale), d(bias), dB). Arrays replicated over
the mesh run the kernel whole on every device, as XLA runs replicated work. It needs the split
at trace time: arrays on a mesh whose axes are ``jax.sharding.AxisType.Explicit`` carry it in
their type (``jax.typeof(x).sharding``), so that is what the ops read. On ``Auto`` axes the
compiler decides the split later and cannot split a kernel, so the ops decide it themselves
where a mesh is in context (below). With no mesh in context (``jit(in_shardings=...)``
alone) an operand's type names its mesh but not its split, and no rule applies
(:func:`unsplit_mesh`): dispatch serves the call with XLA's ops, which the compiler splits,
and warns with the fix (put the mesh in context); a kernel named by the caller is refused
(:func:`refuse_or_fall_back`). Host arrays handed to ``jit(in_shardings=...)`` give the traced
operands no mesh at all; only the lowering sees the program's devices, and warns or refuses
there (``interpret.lowering_check``).

On a mesh of ``Auto`` axes in context (``jax.set_mesh(mesh)``, arrays placed by
``jit(in_shardings=...)`` or ``device_put``; ``with mesh:`` sets no mesh that traced code can
read, jax 0.10 to 0.12, so it counts as none) the arrays' types carry no split, so the op
takes it from logical axis rules: each dimension has a logical name ("batch", "length",
"embed", ...), and the rules say which mesh axes each name splits over
(:class:`sharding_rules`, else Flax's ``nnx.logical_axis_rules`` where set, else the default:
"batch" over every data-like axis the mesh has, :data:`DATA_AXES`, everything else whole).
The op then runs per shard in shard_map over the mesh in context exactly as on Explicit axes;
where the arrays were split otherwise, the compiler moves them to that split first.

Each op states its rule as data (:class:`Free`, :class:`Whole`): for each operand, what each
dimension does. A free dimension splits, and dimensions of one group (x's rows and the
residual's, q's heads and k's, a matmul's K in A and in B) split over the same mesh axes, those
of the first operand that splits one; a mesh axis splits one group at most. A whole dimension
(one the kernels reduce, walk or contract over) is gathered where it is split, with a one-time
:class:`ShardingWarning` naming the op, the axes and the bytes moved (or a ValueError where the
caller named a kernel), as is a group whose axes do not divide one of its dimensions. A
weight's dimension (``weight=True``: a matmul's B, the fused loss's w) split over data-like
axes is fully sharded data parallelism: gathered quietly inside the map, its gradient
reduce-scattered back (:func:`gathers_inside`). One
function, :func:`split`, reads a rule and the operands' layout for every op, and dispatch's one
entry (``backend.call``) runs the op per shard through :meth:`Split.run`, with what the op adds
across shards (a row-parallel matmul's psum, the losses' sums: its ``across``).
"""

from jaxkernels.partitioning.rules import (DATA_AXES as DATA_AXES, current_rules as current_rules,
                                           logical_spec as logical_spec,
                                           partition_spec as partition_spec,
                                           row_names as row_names, rules_set as rules_set,
                                           sharding_rules as sharding_rules)
from jaxkernels.partitioning.shard_map import (all_gather as all_gather,
                                               psum_out as psum_out, run as run)
from jaxkernels.partitioning.specs import (ShardingWarning as ShardingWarning,
                                           auto_mesh as auto_mesh, axes as axes,
                                           check_vma as check_vma, entry as entry,
                                           layout as layout, size as size, zigzag as zigzag)
from jaxkernels.partitioning.splitting import (Free as Free, Rule as Rule, Split as Split,
                                           Whole as Whole, gathers_inside as gathers_inside,
                                           row_dims as row_dims, rows_rule as rows_rule,
                                           split as split)
from jaxkernels.partitioning.unsplit import (check_mesh_in_context as check_mesh_in_context,
                                             refuse_or_fall_back as refuse_or_fall_back,
                                             unseen as unseen, unseen_split as unseen_split,
                                             unsplit_mesh as unsplit_mesh)
