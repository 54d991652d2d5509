"""Gradient accuracy of each model variant against a float32 'truth' (XLA, highest precision)."""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from models import llama

preset = sys.argv[1]; B = int(sys.argv[2]); T = int(sys.argv[3])
changes = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
variants = [("xla", ()), ("jaxkernels", ())] + [("jaxkernels", tuple(o for o in llama.OPS if o != k)) for k in llama.OPS]

def grads(cfg, tokens):
  model = llama.Llama(cfg, rngs=nnx.Rngs(0))
  loss, g = nnx.jit(nnx.value_and_grad(llama.loss_fn))(model, tokens)
  leaves = jax.tree_util.tree_flatten_with_path(nnx.state(g))[0]
  return float(loss), {jax.tree_util.keystr(p): np.asarray(jnp.asarray(v, jnp.float32), np.float64) for p, v in leaves}

tokens = jax.random.randint(jax.random.key(1), (B, T + 1), 0, llama.preset(preset, **changes).vocab)
with jax.default_matmul_precision("highest"):
  tl, truth = grads(llama.preset(preset, dtype="float32", kernels="xla", **changes), tokens)
print(f"truth loss {tl:.6f}")
groups = {"embed": lambda k: "embed" in k, "head": lambda k: "head" in k or "out" in k and "layers" not in k,
          "attn": lambda k: any(s in k for s in ("q", "k", "v", "o")) and "mlp" not in k, "mlp": lambda k: "mlp" in k, "norm": lambda k: "norm" in k}
for kernels, ref in variants:
  name = kernels if not ref else "only-" + [o for o in llama.OPS if o not in ref][0]
  t0 = time.time()
  loss, g = grads(llama.preset(preset, kernels=kernels, reference_ops=ref, **changes), tokens)
  num = sum(np.sum((g[k] - truth[k]) ** 2) for k in truth); den = sum(np.sum(truth[k] ** 2) for k in truth)
  bias = sum(np.sum((g[k] - truth[k]) * truth[k]) for k in truth) / den
  worst = sorted(((np.linalg.norm(g[k] - truth[k]) / (np.linalg.norm(truth[k]) + 1e-30), k) for k in truth), reverse=True)[:4]
  print(f"{name:16s} loss {loss:.6f} ({loss - tl:+.2e}) grad rel err {np.sqrt(num / den):.3e} bias {bias:+.2e} "
        f"[{time.time() - t0:.0f}s] worst: " + ", ".join(f"{k.split('[')[-1] if False else k[-40:]}={e:.2e}" for e, k in worst), flush=True)
