"""Output heads: chunked token log-probs / entropy, the critic, the reference copy.

`token_logprobs_and_entropy(hidden_BxTxD, unembed_DxV, targets_BxT)` computes
per-token `log p(target)` and the entropy of the (temperature-scaled)
next-token distribution without ever materialising the full float32
`[B, T, V]` logits: tokens are processed `chunk_size` at a time inside a
`lax.map` whose body is rematerialised (`jax.checkpoint`), so the backward
pass holds one chunk of logits too (a single chunk is neither mapped nor recomputed).

    hidden, _ = forward(graphdef, params, tokens, positions, mask, return_hidden=True)
    model = nnx.merge(graphdef, params)
    logp_BxT, ent_BxT = token_logprobs_and_entropy(hidden[:, :-1], model.unembed_matrix(),
                                                   tokens[:, 1:])

`Critic` is the same backbone plus a scalar value head (`values_BxT`, float32).
`RewardModel` is a backbone plus a bias-free scalar `score` head read at each
row's last real token, the layout of Hugging Face's `*ForSequenceClassification`
with `num_labels=1` (what trained reward models ship as).
`reference_params(params)` is a frozen copy of the actor's parameters (same
shardings, no optimizer state): its buffers survive donation of the actor's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from distflow_jax.models.config import ModelConfig
from distflow_jax.models.transformer import Transformer


def token_logprobs_and_entropy(hidden_BxTxD: jax.Array, unembed_DxV: jax.Array,
                               targets_BxT: jax.Array, *, temperature: float = 1.0,
                               chunk_size: int = 512) -> tuple[jax.Array, jax.Array]:
  """Returns float32 `(logp_BxT, entropy_BxT)` of `softmax(hidden @ unembed / temperature)`.

  logp = z[target] - logsumexp(z);  entropy = logsumexp(z) - sum softmax(z) * z,
  with z the float32 logits divided by `temperature`.  Peak extra memory is
  one `[chunk_size, V]` float32 block (forward and backward).
  """
  return _chunked(hidden_BxTxD, unembed_DxV, targets_BxT, temperature, chunk_size, False)


def token_logprobs_and_sum_pi_squared(hidden_BxTxD: jax.Array, unembed_DxV: jax.Array,
                                      targets_BxT: jax.Array, *, temperature: float = 1.0,
                                      chunk_size: int = 512) -> tuple[jax.Array, jax.Array]:
  """Returns float32 `(logp_BxT, sum_pi_squared_BxT)`: the log-probs as
  `token_logprobs_and_entropy`'s and sum_v softmax(z)_v^2 of each position (the optimal
  token baseline's variance proxy), from the same `[chunk_size, V]` blocks."""
  return _chunked(hidden_BxTxD, unembed_DxV, targets_BxT, temperature, chunk_size, True)


def _chunked(hidden_BxTxD, unembed_DxV, targets_BxT, temperature, chunk_size, squares):
  if temperature <= 0:
    raise ValueError(f"temperature={temperature} must be > 0")
  if chunk_size <= 0:
    raise ValueError(f"chunk_size={chunk_size} must be > 0")
  b, t, d = hidden_BxTxD.shape
  n = b * t
  chunk = min(chunk_size, n)
  num_chunks = -(-n // chunk)
  pad = num_chunks * chunk - n

  def one_chunk(args):
    h_CxD, y_C = args
    z_CxV = jnp.einsum("cd,dv->cv", h_CxD, unembed_DxV,
                       preferred_element_type=jnp.float32) / temperature
    lse_C = jax.nn.logsumexp(z_CxV, axis=-1)
    z_y_C = jnp.take_along_axis(z_CxV, y_C[:, None], axis=-1)[:, 0]
    p_CxV = jnp.exp(z_CxV - lse_C[:, None])
    second = jnp.sum(p_CxV * p_CxV, axis=-1) if squares else (
        lse_C - jnp.sum(p_CxV * z_CxV, axis=-1))
    return z_y_C - lse_C, second

  h_NxD, y_N = hidden_BxTxD.reshape(n, d), targets_BxT.reshape(n).astype(jnp.int32)
  if num_chunks == 1:  # nothing to save by recomputing: the backward holds this block anyway
    logp, second = one_chunk((h_NxD, y_N))
    return logp.reshape(b, t), second.reshape(b, t)
  h_NxD, y_N = jnp.pad(h_NxD, ((0, pad), (0, 0))), jnp.pad(y_N, (0, pad))
  logp, second = jax.lax.map(jax.checkpoint(one_chunk), (h_NxD.reshape(num_chunks, chunk, d),
                                                         y_N.reshape(num_chunks, chunk)))
  return logp.reshape(-1)[:n].reshape(b, t), second.reshape(-1)[:n].reshape(b, t)


class Critic(nnx.Module):
  """Transformer backbone + scalar value head: `values_BxT = head(hidden_BxTxD)`.

  The head starts at zero, so a fresh critic predicts 0 for every token: the first
  advantages are the returns themselves, not the noise of a random head (whose values
  scale with the hidden state's norm, ~sqrt(D)).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs,
               backbone: Transformer | None = None):
    self.backbone = backbone if backbone is not None else Transformer(cfg, rngs=rngs)
    self.value_head = nnx.Linear(cfg.hidden_size, 1, dtype=jnp.float32, param_dtype=jnp.float32,
                                 kernel_init=nnx.initializers.zeros_init(), rngs=rngs)

  def __call__(self, tokens_BxT: jax.Array, positions_BxT: jax.Array,
               mask_BxT: jax.Array | None = None,
               segment_ids_BxT: jax.Array | None = None) -> jax.Array:
    hidden_BxTxD, _ = self.backbone(tokens_BxT, positions_BxT, mask_BxT, return_hidden=True,
                                    segment_ids_BxT=segment_ids_BxT)
    return self.value_head(hidden_BxTxD.astype(jnp.float32))[..., 0]


def critic_values(graphdef: nnx.GraphDef, params: nnx.State, tokens_BxT: jax.Array,
                  positions_BxT: jax.Array, mask_BxT: jax.Array | None = None,
                  segment_ids_BxT: jax.Array | None = None) -> jax.Array:
  """Pure form of `Critic.__call__` over `nnx.split(critic)` (`segment_ids_BxT`: packed rows)."""
  return nnx.merge(graphdef, params)(tokens_BxT, positions_BxT, mask_BxT, segment_ids_BxT)


class RewardModel(nnx.Module):
  """A sequence-level scalar reward: `score(hidden at the last real token)`.

  The backbone is built with tied embeddings so it has no unused `lm_head`
  (a classification checkpoint has none); only its hidden states are read.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = dataclasses.replace(cfg, tie_embeddings=True)
    self.backbone = Transformer(self.cfg, rngs=rngs)
    self.score = nnx.Linear(cfg.hidden_size, 1, use_bias=False, dtype=jnp.float32,
                            param_dtype=jnp.float32,
                            kernel_init=nnx.initializers.normal(0.02), rngs=rngs)

  def __call__(self, tokens_BxT: jax.Array, positions_BxT: jax.Array,
               mask_BxT: jax.Array) -> jax.Array:
    """`scores_B`: the head on the hidden state of each row's last `True` in `mask_BxT`."""
    hidden_BxTxD, _ = self.backbone(tokens_BxT, positions_BxT, mask_BxT, return_hidden=True)
    t = tokens_BxT.shape[1]
    last_B = jnp.max(jnp.where(mask_BxT, jnp.arange(t)[None, :], 0), axis=1)
    h_BxD = jnp.take_along_axis(hidden_BxTxD, last_B[:, None, None], axis=1)[:, 0]
    return self.score(h_BxD.astype(jnp.float32))[:, 0]


def reward_scores(graphdef: nnx.GraphDef, params: nnx.State, tokens_BxT: jax.Array,
                  positions_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
  """Pure form of `RewardModel.__call__` over `nnx.split(reward_model)`."""
  return nnx.merge(graphdef, params)(tokens_BxT, positions_BxT, mask_BxT)


def reference_params(params: nnx.State) -> nnx.State:
  """A frozen copy of the actor's parameters: new buffers, same shardings, no optimizer."""
  return jax.tree.map(lambda x: x.copy(), params)
