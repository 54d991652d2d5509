"""Compile each memory-bound Triton kernel at the headline shape and save the executables.

XLA's dump holds no PTX for Pallas Triton kernels, but a serialized executable holds their
cubins: `python -m bench.experiments.dump_ptx OUT.pkl` here, then on any machine with
cuobjdump `python -m bench.experiments.dump_ptx --sass OUT.pkl DIR` writes each kernel's SASS.
Per-element instruction counts say whether a kernel is issue-, SFU- or memory-bound before
timing it.
"""
import pickle
import sys

import jax
import jax.numpy as jnp

import jaxkernels as jk

SHAPE = (16384, 4096)


def main(out):
  payloads = {}
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
    for suffix, compiled in (("fwd", fwd), ("grad", grad)):
      payloads[f"{name}_{suffix}"] = serialize(compiled)[0]
    print(name, "compiled", flush=True)
  with open(out, "wb") as f:
    pickle.dump(payloads, f)


def sass(path, out_dir):
  """Each ELF (cubin) inside each saved executable -> OUT_DIR/<program>_<i>.cubin."""
  import os
  os.makedirs(out_dir, exist_ok=True)
  with open(path, "rb") as f:
    payloads = pickle.load(f)
  for name, blob in payloads.items():
    starts = [i for i in range(len(blob)) if blob.startswith(b"\x7fELF", i)]
    for k, (a, b) in enumerate(zip(starts, starts[1:] + [len(blob)])):
      with open(os.path.join(out_dir, f"{name}_{k}.cubin"), "wb") as f:
        f.write(blob[a:b])
    print(name, len(starts), "cubins")


if __name__ == "__main__":
  if sys.argv[1] == "--sass":
    sass(*sys.argv[2:])
  else:
    from jax.experimental.serialize_executable import serialize
    main(sys.argv[1])
