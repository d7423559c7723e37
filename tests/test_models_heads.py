"""Chunked log-probs / entropy against a naive reference; critic; reference copy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distflow_jax.models.config import ModelConfig
from distflow_jax.models.heads import (Critic, critic_values, reference_params,
                                       token_logprobs_and_entropy)
from distflow_jax.models.transformer import Transformer, forward


def np_logprobs_entropy(h, w, y, temperature):
  z = (np.asarray(h, np.float64) @ np.asarray(w, np.float64)) / temperature
  z = z - z.max(-1, keepdims=True)
  logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
  p = np.exp(logp_all)
  return (np.take_along_axis(logp_all, np.asarray(y)[..., None], -1)[..., 0],
          -(p * logp_all).sum(-1))


@pytest.mark.parametrize("chunk_size,temperature", [(4, 1.0), (7, 0.7), (1000, 1.3)])
def test_chunked_logprobs_and_entropy_match_numpy(chunk_size, temperature):
  kh, kw, ky = jax.random.split(jax.random.key(0), 3)
  h = jax.random.normal(kh, (3, 5, 16))
  w = jax.random.normal(kw, (16, 50)) * 0.5
  y = jax.random.randint(ky, (3, 5), 0, 50)
  logp, ent = jax.jit(token_logprobs_and_entropy, static_argnames=("chunk_size", "temperature"))(
      h, w, y, chunk_size=chunk_size, temperature=temperature)
  ref_logp, ref_ent = np_logprobs_entropy(h, w, y, temperature)
  assert logp.dtype == jnp.float32 and logp.shape == (3, 5)
  np.testing.assert_allclose(logp, ref_logp, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(ent, ref_ent, atol=1e-5, rtol=1e-5)
  # Entropy of a uniform distribution is log V.
  _, ent0 = token_logprobs_and_entropy(jnp.zeros((1, 2, 16)), w, y[:1, :2])
  np.testing.assert_allclose(ent0, np.log(50.0), rtol=1e-6)


@pytest.mark.parametrize("chunk_size", [4, 1000])  # mapped + recomputed chunks; one plain chunk
def test_chunked_gradient_matches_naive_and_bf16_upcasts(chunk_size):
  kh, kw, ky = jax.random.split(jax.random.key(1), 3)
  h = jax.random.normal(kh, (2, 9, 8))
  w = jax.random.normal(kw, (8, 30))
  y = jax.random.randint(ky, (2, 9), 0, 30)

  def naive(h, w):
    z = jnp.einsum("btd,dv->btv", h, w)
    lp = jax.nn.log_softmax(z)
    return (jnp.take_along_axis(lp, y[..., None], -1).sum()
            - 0.1 * (jnp.exp(lp) * lp).sum())

  def chunked(h, w):
    lp, ent = token_logprobs_and_entropy(h, w, y, chunk_size=chunk_size)
    return lp.sum() + 0.1 * ent.sum()

  g_ref = jax.grad(naive, argnums=(0, 1))(h, w)
  g = jax.jit(jax.grad(chunked, argnums=(0, 1)))(h, w)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
  lp16, _ = token_logprobs_and_entropy(h.astype(jnp.bfloat16), w.astype(jnp.bfloat16), y)
  assert lp16.dtype == jnp.float32
  with pytest.raises(ValueError, match="temperature"):
    token_logprobs_and_entropy(h, w, y, temperature=0.0)


def test_logprobs_from_model_hidden_equal_log_softmax_of_logits():
  cfg = ModelConfig.tiny(64, arch="llama").replace(tie_embeddings=False, num_layers=1)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  g, p = nnx.split(model)
  tok = jax.random.randint(jax.random.key(2), (2, 6), 0, 64)
  pos = jnp.broadcast_to(jnp.arange(6), (2, 6))

  @jax.jit
  def both(p):
    logits, _ = forward(g, p, tok, pos)
    hidden, _ = forward(g, p, tok, pos, return_hidden=True)
    lp, _ = token_logprobs_and_entropy(hidden[:, :-1], nnx.merge(g, p).unembed_matrix(),
                                       tok[:, 1:], chunk_size=3)
    ref = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tok[:, 1:, None], -1)[..., 0]
    return lp, ref

  lp, ref = both(p)
  np.testing.assert_allclose(lp, ref, atol=1e-5)


def test_critic_values_and_reference_copy():
  cfg = ModelConfig.tiny(64, arch="qwen3").replace(num_layers=1)
  actor = Transformer(cfg, rngs=nnx.Rngs(0))
  critic = Critic(cfg, rngs=nnx.Rngs(1), backbone=Transformer(cfg, rngs=nnx.Rngs(0)))
  g, p = nnx.split(critic)
  tok = jax.random.randint(jax.random.key(3), (2, 5), 0, 64)
  pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
  values = jax.jit(critic_values)(g, p, tok, pos)
  assert values.shape == (2, 5) and values.dtype == jnp.float32
  np.testing.assert_array_equal(values, 0.0)  # a fresh critic predicts zero
  critic.value_head.kernel.set_value(jax.random.normal(jax.random.key(4), (cfg.hidden_size, 1)))
  critic.value_head.bias.set_value(jnp.full((1,), 0.5))
  g, p = nnx.split(critic)
  values = jax.jit(critic_values)(g, p, tok, pos)
  hidden, _ = jax.jit(forward, static_argnames="return_hidden")(
      *nnx.split(actor), tok, pos, return_hidden=True)
  w = critic.value_head.kernel.get_value()
  b = critic.value_head.bias.get_value()
  np.testing.assert_allclose(values, np.asarray(hidden) @ np.asarray(w)[:, 0] + b[0], atol=1e-5)

  params = nnx.state(actor, nnx.Param)
  ref = reference_params(params)
  # Donating the actor's buffers (as a train step does) leaves the reference intact.
  bumped = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)(params)
  for r, b in zip(jax.tree.leaves(ref), jax.tree.leaves(bumped)):
    np.testing.assert_allclose(np.asarray(r) + 1, b, rtol=1e-6)
