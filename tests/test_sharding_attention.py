"""Attention on sharded arrays: batch and heads split, ring attention over a split sequence
(contiguous and zig-zag, forward and backward, memory at 128K), decode's batch and heads,
compiled for TPUs and lowered for CUDA (the Mosaic GPU kernels per shard)."""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxkernels as jk
from tests import numerics
from tests.sharding import (MOSAIC_GPU_ATTENTION_KERNELS, mosaic_gpu_attention_grads, put,
                            tpu_compile)

pytestmark = pytest.mark.cpu_only  # the mesh is of host devices, the kernels interpreted


# flash_attention's layouts of q (B, T, N, H) = (8, 16, 4, 16) against k (8, 20, 2, 16): the batch
# over both axes; batch and heads (q's N and k's K together); the query sequence split
# (gathered, warned); heads over an axis that k's 2 heads cannot follow (gathered, warned).
ATTENTION_LAYOUTS = {"batch": P(("data", "model"), None, None, None),
                     "batch+heads": P("data", None, "model", None),
                     "batch+seq": P("data", "model", None, None),
                     "heads over 4": P("model", None, "data", None)}


ATTENTION_GATHERS = {"batch+seq", "heads over 4"}


# CI: heads split (attention's tensor parallelism, batch beside it) and a gathered sequence;
# the batch alone and heads over both axes under SLOW.
@pytest.mark.parametrize("layout", numerics.some(sorted(ATTENTION_LAYOUTS),
                                                 keep={"batch+heads", "batch+seq"}))
def test_attention_layouts(mesh, layout):
  """Causal GQA attention with segments and a per-head bias, forward and every gradient, by the
  numerics rule; the output split as q was where nothing is gathered."""
  from jaxkernels.ops.attention import reference as attention_reference
  from jaxkernels.ops.attention.common import Window

  spec = ATTENTION_LAYOUTS[layout]
  gen = numerics.rng("sharding-attention", layout)
  q = numerics.normal(gen, (8, 16, 4, 16), jnp.float32)
  k = numerics.normal(gen, (8, 20, 2, 16), jnp.float32)
  v = numerics.normal(gen, (8, 20, 2, 16), jnp.float32)
  bias = numerics.normal(gen, (1, 4, 16, 20), jnp.float32)
  seg = jnp.asarray(np.sort(gen.integers(0, 2, (8, 16))), jnp.int32)
  kv_seg = jnp.asarray(np.sort(gen.integers(0, 2, (8, 20))), jnp.int32)
  ct = numerics.normal(gen, q.shape, jnp.float32)
  # k and v follow q's split where their 2 heads can; "heads over 4": they cannot.
  kv_spec = P(spec[0], None, None if layout == "heads over 4" else spec[2], None)

  def fn(q, k, v, bias):
    return jk.flash_attention(q, k, v, bias=bias, causal=True, segment_ids=seg,
                              kv_segment_ids=kv_seg)

  def ref(cd):
    return lambda q, k, v, bias: attention_reference.attention(
        q, k, v, bias=bias, q_segments=seg, kv_segments=kv_seg, window=Window.of(True, None),
        scale=0.25, compute_dtype=cd)

  with jk.interpret_mode("triton"), warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out, vjp = jax.vjp(jax.jit(fn), put(mesh, q, spec), put(mesh, k, kv_spec),
                       put(mesh, v, kv_spec), bias)
    got = (out, vjp(ct))
  gathered = [w for w in caught if issubclass(w.category, jk.ShardingWarning)]
  assert bool(gathered) == (layout in ATTENTION_GATHERS), [str(w.message) for w in gathered]
  numerics.assert_matches(got, ref, (q, k, v, bias), ct, dtype=jnp.float32, reduction=20)
  if layout not in ATTENTION_GATHERS:
    assert out.sharding.spec == spec


@pytest.mark.parametrize("causal,layout,impl", numerics.grid(
    [True, False], ["zigzag", "contiguous"], ["triton", None]))
def test_ring_attention_matches_unsplit(mesh, causal, layout, impl):
  """q's T and k's and v's S split over "model" (the batch over "data"): ring attention, the
  k/v blocks passed around the shards (collective-permutes, nothing gathered), on the Triton
  kernels (interpreted) or the reference (impl None on a CPU); GQA, the log-sum-exp returned;
  forward and every gradient (the lse's cotangent too) by the numerics rule against unsplit
  attention at the tokens' positions, which "zigzag" permutes."""
  from jaxkernels.ops.attention import reference as attention_reference
  from jaxkernels.ops.attention.common import Window

  gen = numerics.rng("sharding-ring", causal, layout, str(impl))
  b, t, n, kv, h = 4, 64, 4, 2, 16
  q = numerics.normal(gen, (b, t, n, h), jnp.float32)
  k, v = (numerics.normal(gen, (b, t, kv, h), jnp.float32) for _ in range(2))
  ct = (numerics.normal(gen, q.shape, jnp.float32), numerics.normal(gen, q.shape[:-1],
                                                                     jnp.float32))
  order = jk.zigzag(t, 2) if layout == "zigzag" else np.arange(t)
  undo = np.argsort(order)
  spec = P("data", "model", None, None)
  fn = jax.jit(lambda q, k, v: jk.flash_attention(q, k, v, causal=causal, return_lse=True,
                                                  sequence_layout=layout, implementation=impl))
  placed = [put(mesh, x[:, order], spec) for x in (q, k, v)]
  context = jk.interpret_mode("triton") if impl else contextlib.nullcontext()
  with context, warnings.catch_warnings():
    warnings.simplefilter("error", jk.ShardingWarning)
    warnings.simplefilter("ignore", jk.FallbackWarning)
    (out, lse), vjp = jax.vjp(fn, *placed)
    grads = vjp((ct[0][:, order], ct[1][:, order]))
    text = fn.lower(*placed).compile().as_text()
  assert out.sharding.spec == spec and lse.sharding.spec == P(*spec[:3])
  assert "collective-permute" in text and "all-gather" not in text
  whole = lambda x: jnp.asarray(np.asarray(x)[:, undo])  # back in position order
  got = ((whole(out), whole(lse)), tuple(map(whole, grads)))

  def ref(cd):
    return lambda q, k, v: attention_reference.attention(
        q, k, v, window=Window.of(causal, None), scale=h ** -0.5, return_lse=True,
        compute_dtype=cd)

  numerics.assert_matches(got, ref, (q, k, v), ct, dtype=jnp.float32, reduction=t)


def test_ring_attention_at_128k_holds_a_share_a_device():
  """T = 128K, causal, zig-zag, over 8 host devices, the Triton kernels interpreted (compiled,
  not run: the interpreter at 128K would take hours; the numbers are the small-T test's and
  the GPU runs'): what a device needs (its arguments, outputs and temporaries, forward and
  backward) is under a quarter of what one device running the whole sequence needs, where a
  gathered k and v would hold the whole sequence on each."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  t = 128 * 1024

  def step(q, k, v):
    return jax.grad(lambda q, k, v: jnp.sum(jk.flash_attention(
        q, k, v, causal=True, sequence_layout="zigzag").astype(jnp.float32)),
        argnums=(0, 1, 2))(q, k, v)

  def needs(n):
    ring = jax.make_mesh((n,), ("sequence",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:n])
    shard = NamedSharding(ring, P(None, "sequence"))
    q = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.bfloat16, sharding=shard)
    kv = jax.ShapeDtypeStruct((1, t, 1, 16), jnp.bfloat16, sharding=shard)
    with jax.set_mesh(ring), jk.interpret_mode("triton"):
      compiled = jax.jit(step).lower(q, kv, kv).compile()
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes, compiled

  split, compiled = needs(8)
  whole, _ = needs(1)
  assert "collective-permute" in compiled.as_text()
  assert "all-gather" not in compiled.as_text()
  assert split < whole / 4, (split, whole)


def test_ring_attention_bad_layout_names_itself(mesh):
  q = jnp.zeros((4, 12, 2, 16))
  with pytest.raises(ValueError, match="sequence_layout='zigzag' orders the positions for ring "
                     "attention.*window=\\(8, 0\\)"):
    jk.flash_attention(q, q, q, causal=True, local_window_size=8, sequence_layout="zigzag")
  with pytest.raises(ValueError, match="sequence_layout=.striped. is not one of"):
    jk.flash_attention(q, q, q, sequence_layout="striped")
  placed = put(mesh, jnp.zeros((4, 10, 2, 16)), P("data", "model"))
  with pytest.raises(ValueError, match="needs each of the 2 sequence shards to hold two equal "
                     "chunks: T=10 is not a multiple of 4"):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", jk.FallbackWarning)
      jk.flash_attention(placed, placed, placed, causal=True, sequence_layout="zigzag")


def test_decode_attention_splits_batch_and_heads(mesh):
  """decode_attention's cache split over the batch and the kv heads, lengths with the batch:
  the reference's numbers, the output split as q was, nothing gathered."""
  from jaxkernels.ops.attention import reference as attention_reference

  gen = numerics.rng("sharding-decode")
  q = numerics.normal(gen, (8, 1, 4, 16), jnp.float32)
  k = numerics.normal(gen, (8, 40, 2, 16), jnp.float32)
  v = numerics.normal(gen, (8, 40, 2, 16), jnp.float32)
  lengths = jnp.asarray(gen.integers(1, 41, (8,)), jnp.int32)
  spec = P("data", None, "model", None)
  with jk.interpret_mode("triton"), warnings.catch_warnings():
    warnings.simplefilter("error", jk.ShardingWarning)
    out = jax.jit(lambda q, k, v, n: jk.decode_attention(q, k, v, lengths=n))(
        put(mesh, q, spec), put(mesh, k, spec), put(mesh, v, spec),
        put(mesh, lengths, P("data")))
  assert out.sharding.spec == spec
  want = lambda cd: lambda q, k, v: attention_reference.decode(q, k, v, lengths, scale=0.25,
                                                               compute_dtype=cd)
  numerics.assert_matches(out, want, (q, k, v), dtype=jnp.float32, reduction=40)


ATTENTION_TPU_CASES = {
    # q (8, 1024, 8, H) against k/v (8, 1024, 2, H), causal GQA, forward and every gradient: H
    # 128 (heads in interleaved rows) and 64 (two heads side by side in a 128-lane group).
    "flash_attention": lambda q, k, v, n: jk.flash_attention(q, k, v, causal=True),
    # one query against a 4K cache, lengths split with the batch (no gradient: inference's op).
    "decode_attention": lambda q, k, v, n: jk.decode_attention(q[:, :1], k, v, lengths=n),
}


# v5e only: the bound holds there; v6e holds 13.4 MB of temporaries and v5p 37.5 MB against the
# ring's 12.6 MB, not yet understood (notes/contract.md structure-1).
@pytest.mark.parametrize("tpu4", ["v5e:2x2"], indirect=True)
def test_tpu_compile_ring_attention(tpu4):
  """Ring attention on 4 chips (the sequence of 8K split, zig-zag, causal, GQA), forward and
  every gradient compiled for the TPU: the Mosaic TPU kernels on each chip's blocks, the k/v
  blocks passed by collective permutes, nothing gathered; a chip holds a quarter of the
  arguments and outputs of one chip running the whole sequence, and besides them only the
  ring's buffers: its queries' float32 partial outputs and two sets of k/v blocks (the one in
  use, the one arriving)."""
  def step(q, k, v):
    return jax.grad(lambda q, k, v: jnp.sum(jk.flash_attention(
        q, k, v, causal=True, sequence_layout="zigzag").astype(jnp.float32)),
        argnums=(0, 1, 2))(q, k, v)

  def compiled(spec):
    shard = NamedSharding(tpu4, spec)
    q = jax.ShapeDtypeStruct((1, 8192, 8, 128), jnp.bfloat16, sharding=shard)
    kv = jax.ShapeDtypeStruct((1, 8192, 2, 128), jnp.bfloat16, sharding=shard)
    return tpu_compile(tpu4, step, q, kv, kv)

  split, whole = compiled(P(None, "data", None, None)), compiled(P())
  text = split.as_text()
  assert "jk_attention_fwd" in text and "collective-permute" in text
  assert "all-gather" not in text and "all-to-all" not in text
  held = lambda m: m.argument_size_in_bytes + m.output_size_in_bytes
  split, whole = split.memory_analysis(), whole.memory_analysis()
  assert held(split) <= held(whole) / 4 + 1024, (held(split), held(whole))
  queries_f32 = 8192 // 4 * 8 * 128 * 4
  kv_blocks = 2 * 8192 // 4 * 2 * 128 * 2  # k and v, a chip's share
  assert split.temp_size_in_bytes <= queries_f32 + 2 * kv_blocks, split.temp_size_in_bytes


@pytest.mark.parametrize("case,h", [("decode_attention", 128), ("flash_attention", 128),
                                    ("flash_attention", 64)])
def test_tpu_compile_keeps_attention_batch_split(tpu4, case, h):
  """The batch split over 4 chips: the Mosaic TPU attention kernels run on each chip's quarter,
  nothing is gathered, and a chip holds about a quarter of the unsharded call's arguments,
  outputs and temporaries."""
  op = ATTENTION_TPU_CASES[case]
  flash = case == "flash_attention"
  b, t, s = 8, 1024 if flash else 1, 1024 if flash else 4096

  def step(q, k, v, n):
    if case == "decode_attention":
      return op(q, k, v, n)
    return jax.value_and_grad(lambda q, k, v: jnp.sum(op(q, k, v, n).astype(jnp.float32)),
                              argnums=(0, 1, 2))(q, k, v)

  def compiled(spec):
    shard = NamedSharding(tpu4, spec)
    q = jax.ShapeDtypeStruct((b, t, 8, h), jnp.bfloat16, sharding=shard)
    kv = jax.ShapeDtypeStruct((b, s, 2, h), jnp.bfloat16, sharding=shard)
    n = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=NamedSharding(tpu4, P(spec[0])))
    return tpu_compile(tpu4, step, q, kv, kv, n)

  split = compiled(P("data", None, None, None))
  whole = compiled(P(None, None, None, None))
  text = split.as_text()
  assert "all-gather" not in text and "all-to-all" not in text
  # Flash attention's kernels are the in-place ones, at both head dims.
  assert ("jk_attention_fwd_in_place" if flash else "jk_decode_attention") in text
  per_chip = lambda c: (lambda m: m.argument_size_in_bytes + m.output_size_in_bytes +
                        m.temp_size_in_bytes)(c.memory_analysis())
  assert per_chip(split) <= 0.3 * per_chip(whole), (per_chip(split), per_chip(whole))


def test_cuda_lowering_splits_mosaic_gpu_attention(mesh):
  """flash_attention's Mosaic GPU kernels (forward, dq, dk/dv) on the (4, 2) mesh, the batch
  over one axis and the heads over the other: each runs in the manual computation on its
  shard, nothing gathered."""
  from jax import export

  shard = NamedSharding(mesh, P("data", None, "model", None))
  q = jax.ShapeDtypeStruct((8, 256, 8, 128), jnp.bfloat16, sharding=shard)
  kv = jax.ShapeDtypeStruct((8, 256, 2, 128), jnp.bfloat16, sharding=shard)

  text = export.export(jax.jit(mosaic_gpu_attention_grads), platforms=["cuda"])(
      q, kv, kv).mlir_module()
  assert "manual_computation" in text
  for name in MOSAIC_GPU_ATTENTION_KERNELS:
    assert name in text, name
  assert "all_gather" not in text and "all_to_all" not in text


def test_cuda_lowering_of_ring_attention_on_mosaic_gpu(mesh):
  """Ring attention (the sequence over "model", zig-zag, causal) exported for CUDA: each ring
  step's forward and backward on the Mosaic GPU kernels in the manual computation, the blocks
  passed by collective permutes, nothing gathered."""
  from jax import export

  shard = NamedSharding(mesh, P("data", "model", None, None))
  q = jax.ShapeDtypeStruct((8, 512, 8, 128), jnp.bfloat16, sharding=shard)
  kv = jax.ShapeDtypeStruct((8, 512, 2, 128), jnp.bfloat16, sharding=shard)
  grads = lambda q, k, v: jax.grad(lambda q, k, v: jnp.sum(jk.flash_attention(
      q, k, v, causal=True, sequence_layout="zigzag", implementation="mosaic_gpu").astype(
          jnp.float32)), argnums=(0, 1, 2))(q, k, v)
  text = export.export(jax.jit(grads), platforms=["cuda"])(q, kv, kv).mlir_module()
  assert "manual_computation" in text and "collective_permute" in text
  for name in MOSAIC_GPU_ATTENTION_KERNELS:
    assert name in text, name
  assert "all_gather" not in text and "all_to_all" not in text


def test_cuda_lowering_of_mosaic_gpu_attention_with_a_bias(mesh):
  """A (1, N, T, S) bias on the (4, 2) mesh, q's batch over "data" and the heads over "model"
  (the bias's heads with them): the four Mosaic GPU kernels (forward, dq, dk/dv, d(bias)) run
  in the manual computation on their shards, d(bias) summed over the batch's shards by an
  all-reduce, nothing gathered."""
  from jax import export

  shard = NamedSharding(mesh, P("data", None, "model", None))
  q = jax.ShapeDtypeStruct((8, 256, 8, 128), jnp.bfloat16, sharding=shard)
  kv = jax.ShapeDtypeStruct((8, 256, 2, 128), jnp.bfloat16, sharding=shard)
  bias = jax.ShapeDtypeStruct((1, 8, 256, 256), jnp.bfloat16,
                              sharding=NamedSharding(mesh, P(None, "model", None, None)))
  grads = jax.grad(lambda q, k, v, b: jnp.sum(jk.flash_attention(
      q, k, v, bias=b, causal=True, implementation="mosaic_gpu").astype(jnp.float32)),
      argnums=(0, 1, 2, 3))
  text = export.export(jax.jit(grads), platforms=["cuda"])(q, kv, kv, bias).mlir_module()
  assert "manual_computation" in text and "all_reduce" in text
  for name in (*MOSAIC_GPU_ATTENTION_KERNELS, "jk_attention_dbias_mgpu"):
    assert name in text, name
  assert "all_gather" not in text and "all_to_all" not in text


def test_cuda_lowering_of_mosaic_gpu_decode(mesh):
  """decode_attention's Mosaic GPU kernel on the (4, 2) mesh, the batch over "data" and the kv
  heads over "model" (the lengths with the batch): each shard runs it on its own, nothing
  gathered."""
  from jax import export

  q = jax.ShapeDtypeStruct((8, 1, 8, 128), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P("data", None, "model", None)))
  cache = jax.ShapeDtypeStruct((8, 1024, 2, 128), jnp.bfloat16,
                               sharding=NamedSharding(mesh, P("data", None, "model", None)))
  lengths = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=NamedSharding(mesh, P("data")))
  decode = lambda q, k, v, n: jk.decode_attention(q, k, v, lengths=n,
                                                  implementation="mosaic_gpu")
  text = export.export(jax.jit(decode), platforms=["cuda"])(q, cache, cache,
                                                            lengths).mlir_module()
  assert "manual_computation" in text and "jk_decode_attention_mgpu" in text
  assert "all_gather" not in text and "all_to_all" not in text and "all_reduce" not in text
