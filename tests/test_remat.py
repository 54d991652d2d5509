"""jaxkernels.remat: each policy keeps the named tensors it says and recomputes the rest, and
no policy changes a gradient."""

from __future__ import annotations

import contextlib
import io
import re

import chex
import jax
import jax.numpy as jnp
import pytest
from absl.testing import parameterized

import jaxkernels as jk
from jaxkernels import remat
from tests import numerics


def _block(x, w, q, k, v):
  """A transformer block's shape of things: a projection into the residual stream, a norm, a
  batched product, and flash attention (a kernel, so that its output and LSE carry names)."""
  h = remat.tag(x @ w, remat.RESIDUAL)
  n = remat.tag(jnp.tanh(h), remat.NORM_OUT)
  scores = jnp.einsum("bij,bkj->bik", n[None], n[None])
  a = jk.flash_attention(q, k, v, causal=True, implementation="triton")
  return jnp.sum(n) + jnp.sum(jnp.sin(scores)) + jnp.sum(jnp.sin(a.astype(jnp.float32)))


def _inputs():
  keys = jax.random.split(jax.random.key(0), 5)
  x, w = jax.random.normal(keys[0], (8, 16)), jax.random.normal(keys[1], (16, 16))
  q, k, v = (jax.random.normal(key, (1, 24, 2, 16)) for key in keys[2:])
  return x, w, q, k, v


def _saved(policy: str) -> str:
  """What the backward of ``_block`` under ``policy`` reads from memory, as JAX prints it."""
  buffer = io.StringIO()
  with numerics.kernel_mode(), contextlib.redirect_stdout(buffer):
    jax.ad_checkpoint.print_saved_residuals(
        jax.checkpoint(_block, policy=remat.policy(policy)), *_inputs())
  return buffer.getvalue()


def _names(saved: str) -> set[str]:
  return set(re.findall(r"named '(\w+)'", saved))


class RematTest(parameterized.TestCase):

  def test_named_policies_keep_what_they_say(self):
    assert not _names(_saved("full"))
    assert _names(_saved("attention")) == {remat.ATTENTION_OUT, remat.ATTENTION_LSE}
    assert _names(_saved("minimal")) == {remat.RESIDUAL, remat.ATTENTION_OUT,
                                         remat.ATTENTION_LSE}
    # Nothing recomputed: more saved than under any other policy.
    assert _saved("none").count("\n") > max(_saved(p).count("\n") for p in remat.POLICIES
                                            if p != "none")

  def test_dots(self):
    dots, no_batch = _saved("dots"), _saved("dots_no_batch")
    assert "f32[8,16] output of dot_general" in dots and "f32[1,8,8]" in dots
    assert "f32[8,16] output of dot_general" in no_batch and "f32[1,8,8]" not in no_batch

  def test_offload_keeps_minimal_s_tensors_in_host_memory(self):
    saved = _saved("offload")
    assert not _names(saved)  # none left on the device
    # minimal's three (the residual, attention's output and LSE), each moved to the host; the
    # norm's output (also f32[8,16]) is recomputed.
    host = sorted(re.findall(r"f32<host>\[([\d,]+)\]", saved))
    assert host == ["1,24,2", "1,24,2,16", "8,16"], saved

  @parameterized.parameters(*remat.POLICIES)
  def test_gradients_do_not_depend_on_the_policy(self, policy):
    args = _inputs()
    with numerics.kernel_mode():
      want = jax.grad(_block, argnums=tuple(range(5)))(*args)
      got = jax.jit(jax.grad(jax.checkpoint(_block, policy=remat.policy(policy)),
                             argnums=tuple(range(5))))(*args)
    # The same operations, recomputed: only XLA's fusion may reassociate a float32 sum (a few
    # ulps of sums over a few hundred terms).
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)

  def test_unknown_names_say_what_is_accepted(self):
    with pytest.raises(ValueError, match=r"policy: name='dot'.*dots_no_batch"):
      remat.policy("dot")
    with pytest.raises(ValueError, match=r"tag: name='resid'.*residual"):
      remat.tag(jnp.ones(3), "resid")
