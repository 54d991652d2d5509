"""Compile each memory-bound Triton kernel at the headline shape and save the executables.

XLA's dump holds no PTX for Pallas Triton kernels, but a serialized executable holds their
cubins: `python -m bench.experiments.dump_ptx OUT.pkl` here, then on any machine with
cuobjdump `python -m bench.experiments.dump_ptx --sass OUT.pkl DIR` writes each kernel's SASS.
Per-element instruction counts say whether a kernel is issue-, SFU- or memory-bound before
timing it.
"""
import os
import pickle
import struct
import sys

import jax
import jax.numpy as jnp

import jaxkernels as jk

SHAPE = (16384, 4096)


def save(executables, path):
  """Pickles {name: compiled executable} as ``--sass`` reads it (serialized executables)."""
  from jax.experimental.serialize_executable import serialize
  with open(path, "wb") as f:
    pickle.dump({name: serialize(c)[0] for name, c in executables.items()}, f)


def main(out):
  executables = {}
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
    fwd = jax.jit(f).lower(*args).compile()
    grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))).lower(*args).compile()
    jax.block_until_ready(fwd(*args))
    jax.block_until_ready(grad(*args))
    executables[f"{name}_fwd"], executables[f"{name}_grad"] = fwd, grad
    print(name, "compiled", flush=True)
  save(executables, out)


def _varint(b, i):
  value = shift = 0
  while True:
    c = b[i]
    i += 1
    value |= (c & 0x7f) << shift
    shift += 7
    if not c & 0x80:
      return value, i


def _unsnappy(b, i):
  """One raw snappy block starting at b[i] -> (end, bytes); ValueError/IndexError if not one."""
  n, i = _varint(b, i)
  out = bytearray()
  while len(out) < n:
    tag, i = b[i], i + 1
    if tag & 3 == 0:  # literal
      length = tag >> 2
      if length >= 60:
        k = length - 59
        length = int.from_bytes(b[i:i + k], "little")
        i += k
      length += 1
      if i + length > len(b):
        raise ValueError("literal past the end")
      out += b[i:i + length]
      i += length
      continue
    if tag & 3 == 1:
      length, offset = ((tag >> 2) & 7) + 4, ((tag >> 5) << 8) | b[i]
      i += 1
    else:
      k = 2 if tag & 3 == 2 else 4
      length, offset = (tag >> 2) + 1, int.from_bytes(b[i:i + k], "little")
      i += k
    if not 0 < offset <= len(out):
      raise ValueError("copy before the start")
    for _ in range(length):
      out.append(out[-offset])
  return i, bytes(out)


def _cuda_elfs(data):
  """Complete CUDA ELFs (e_machine 190) in data."""
  found, j = [], 0
  while (j := data.find(b"\x7fELF", j)) >= 0:
    e = data[j:]
    if len(e) > 64 and e[0x12] == 0xbe:
      shoff, = struct.unpack_from("<Q", e, 0x28)
      phoff, = struct.unpack_from("<Q", e, 0x20)
      phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", e, 0x36)
      size = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
      if size <= len(e):
        found.append(e[:size])
    j += 4
  return found


def _cubins(data):
  """The cubins of a serialized executable: its kernels sit in snappy blocks nested in snappy
  blocks, so every block that decodes is searched in turn."""
  found = _cuda_elfs(data)
  i = 0
  while not found and i < len(data) - 10:
    try:
      n, _ = _varint(data, i)
      if 2000 < n < 10**8:
        end, block = _unsnappy(data, i)
        found += _cubins(block)
        i = end
        continue
    except (ValueError, IndexError):
      pass
    i += 1
  return found


def sass(path, out_dir):
  """Each kernel's cubin inside each saved executable -> OUT_DIR/<program>_<i>.cubin, for
  `cuobjdump -sass` (NVIDIA's nvidia-cuda-cuobjdump wheel runs on a CPU machine)."""
  os.makedirs(out_dir, exist_ok=True)
  with open(path, "rb") as f:
    payloads = pickle.load(f)
  for name, blob in payloads.items():
    cubins = _cubins(blob)
    for k, cubin in enumerate(cubins):
      with open(os.path.join(out_dir, f"{name}_{k}.cubin"), "wb") as f:
        f.write(cubin)
    print(name, len(cubins), "cubins")


if __name__ == "__main__":
  if sys.argv[1] == "--sass":
    sass(*sys.argv[2:])
  else:
    main(sys.argv[1])
