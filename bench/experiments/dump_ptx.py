"""Compile each memory-bound Triton kernel once at the headline shape so that XLA dumps its PTX.

The SASS then comes from ptxas on any machine (bench/NOTES.md matmul-24): per-element
instruction counts say whether a kernel is issue-, SFU- or memory-bound before timing it.

  XLA_FLAGS=--xla_dump_to=DIR python -m bench.experiments.dump_ptx
"""
import jax
import jax.numpy as jnp

import jaxkernels as jk

SHAPE = (16384, 4096)


def main():
  key = jax.random.split(jax.random.key(0), 4)
  x, r, g = (jax.random.normal(k, SHAPE, jnp.bfloat16) for k in key[:3])
  bias = jax.random.normal(key[3], SHAPE[-1:], jnp.bfloat16)
  scale = bias + 1
  programs = {}
  for act in ("gelu", "gelu_tanh", "silu"):
    f = lambda x, b, act=act: jk.bias_activation(x, b, activation=act, implementation="triton")
    programs[f"bias_{act}"] = (f, (x, bias))
  programs["glu_silu"] = (lambda g, u: jk.glu(g, u, activation="silu", implementation="triton"),
                          (g, x))
  programs["rms_res"] = (lambda x, r, s: jk.rms_norm(x, s, residual=r, implementation="triton"),
                         (x, r, scale))
  programs["layer_res"] = (lambda x, r, s, b: jk.layer_norm(x, s, b, residual=r,
                                                            implementation="triton"),
                           (x, r, scale, bias))
  for name, (f, args) in programs.items():
    def loss(*args, f=f):
      out = f(*args)
      out = out if isinstance(out, tuple) else (out,)
      return sum(jnp.sum(o.astype(jnp.float32) * o.astype(jnp.float32)) for o in out)
    fwd = jax.jit(f, donate_argnums=()).lower(*args).compile()
    grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))).lower(*args).compile()
    jax.block_until_ready(fwd(*args))
    jax.block_until_ready(grad(*args))
    print(name, "compiled", flush=True)


if __name__ == "__main__":
  main()
