"""A measured, rejected prototype (bench/NOTES.md, run 12): rms_norm+residual forward as a
Mosaic GPU kernel. One warpgroup per SM, persistent; x and residual blocks of 4 rows come in by
TMA through a 2-3 slot ring, each warp normalises one row (a row reduction stays inside the warp,
no cross-warp barrier), y and h are written in place into the input slots and leave by TMA.
On an H200 it reached 3472 GB/s at best against 3664 for the Triton kernel in the same run, and
its no-arithmetic stream variant only 3380, so the loss is in the ring, not the math.
Why is not measured (candidates: loads refilled only after the previous step's store has
read its slot, whole-kernel ramp-up and drain at 32 steps a CTA).
Not part of the library; INTERP=1 runs it in the Mosaic GPU interpreter (whole blocks only).
"""
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

R = 4
import os
INTERP = {}
if os.environ.get("INTERP"):
  from jax._src.pallas.mosaic_gpu.interpret import params as _p
  INTERP = dict(interpret=_p.InterpretGPUParams())
def layout(cols, vec=8):
  return plgpu.Layout.TILED(plgpu.Tiling(((R, 32 * vec), (vec,))), warp_dims=(-3,), lane_dims=(-2,), vector_dim=-1)

def load(ref, layout, optimized=True):
  if INTERP:
    return ref[...]
  return plgpu.load(ref, (), layout=layout, optimized=optimized)

def cast(x, layout):
  return x if INTERP else plgpu.layout_cast(x, layout)

def fwd(x, r, s, eps=1e-6, steps=3, ncta=132, chunk=256, math=True, nobar=False, block_rows=R):
  """block_rows: rows a step; other than 4 (one a warp) only for the no-arithmetic stream."""
  assert block_rows == R or not math
  M, N = x.shape
  chunk = min(chunk, N)
  L = layout(chunk)
  nblk = pl.cdiv(M, block_rows)
  nchunks = N // chunk
  def kernel(x_g, r_g, s_g, y_g, h_g, xbuf, rbuf, sbuf, bars, sbar):
    cta = lax.axis_index("sm")
    plgpu.copy_gmem_to_smem(s_g, sbuf, sbar.at[0])
    my = (nblk - cta + ncta - 1) // ncta
    def rows(i):
      return pl.ds((cta + i * ncta) * block_rows, block_rows)
    def fetch(i, slot):
      plgpu.copy_gmem_to_smem(x_g.at[rows(i)], xbuf.at[slot], bars.at[slot])
      plgpu.copy_gmem_to_smem(r_g.at[rows(i)], rbuf.at[slot], bars.at[slot])
    for j in range(steps):
      @pl.when(j < my)
      def _():
        fetch(j, j)
    plgpu.barrier_wait(sbar.at[0])
    @pl.loop(0, my)
    def _(i):
      slot = lax.rem(i, steps)
      plgpu.barrier_wait(bars.at[slot])
      xs, rs = xbuf.at[slot], rbuf.at[slot]
      if math:
        compute(xs, rs, sbuf)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(xs, y_g.at[rows(i)])
      plgpu.copy_smem_to_gmem(rs, h_g.at[rows(i)])
      plgpu.commit_smem_to_gmem_group()
      prev = i - 1
      @pl.when((i >= 1) & (prev + steps < my))
      def _():
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        fetch(prev + steps, lax.rem(prev, steps))
    plgpu.wait_smem_to_gmem(0)

  def compute(xs, rs, sbuf):
      def h_chunk(c):
        return (load(xs.at[:, c], L).astype(jnp.float32)
                + load(rs.at[:, c], L).astype(jnp.float32))
      ss = None
      for c in range(nchunks):
        h = h_chunk(c)
        part = jnp.sum(h * h, axis=1)
        ss = part if ss is None else ss + part
      rstd = lax.rsqrt(ss / N + eps)
      rb = cast(lax.broadcast_in_dim(rstd, (R, chunk), (0,)), L)
      for c in range(nchunks):
        h = h_chunk(c)
        sv = load(sbuf.at[c], L.reduce(0), False)
        sb = cast(lax.broadcast_in_dim(sv, (R, chunk), (1,)), L)
        rs[:, c] = h.astype(rs.dtype)
        xs[:, c] = (h * rb * sb).astype(xs.dtype)
  x3 = x.reshape(M, N // 256, 256); r3 = r.reshape(M, N // 256, 256); s2 = s.reshape(N // 256, 256)
  y, h = plgpu.kernel(kernel, out_type=(jax.ShapeDtypeStruct(x3.shape, x.dtype),)*2,
      grid=(ncta,), grid_names=("sm",), **INTERP,
      compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=nobar),
      scratch_types=dict(xbuf=plgpu.SMEM((steps, block_rows, N // 256, 256), x.dtype), rbuf=plgpu.SMEM((steps, block_rows, N // 256, 256), r.dtype),
                          sbuf=plgpu.SMEM((N // 256, 256), jnp.float32),
                          bars=plgpu.Barrier(num_arrivals=2, num_barriers=steps), sbar=plgpu.Barrier(num_barriers=1)))(x3, r3, s2)
  return y.reshape(M, N), h.reshape(M, N)

if __name__ == "__main__":
  M, N = 16384, 4096
  x = jax.ShapeDtypeStruct((M, N), jnp.bfloat16)
  s = jax.ShapeDtypeStruct((N,), jnp.float32)
  exp = jax.export.export(jax.jit(fwd), platforms=["cuda"])(x, x, s)
  print("exported", len(exp.mlir_module()))

def check(M=40, N=512, ncta=3, steps=3):
  import numpy as np
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (M, N), jnp.float32).astype(jnp.bfloat16)
  r = jax.random.normal(k[1], (M, N), jnp.float32).astype(jnp.bfloat16)
  s = jax.random.normal(k[2], (N,), jnp.float32)
  y, h = fwd(x, r, s, ncta=ncta, steps=steps)
  h32 = x.astype(jnp.float32) + r.astype(jnp.float32)
  yr = h32 * lax.rsqrt(jnp.mean(h32 * h32, -1, keepdims=True) + 1e-6) * s
  print(np.abs(np.asarray(y, np.float32) - np.asarray(yr)).max(), np.abs(np.asarray(h, np.float32) - np.asarray(h32.astype(jnp.bfloat16), np.float32)).max())
