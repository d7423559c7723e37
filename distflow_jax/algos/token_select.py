"""Token selection by score, for the covariance losses (Clip-Cov, KL-Cov in
``policy_losses``): each token's centred covariance, how many tokens a share selects,
ranks, and a PRNG key drawn from the data.  Pure ``jax.numpy``, no gradient through any.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def centred_cov(advantages: jax.Array, logp: jax.Array, mask: jax.Array) -> jax.Array:
  """(A_t - mean A)(log pi_t - mean log pi), means over the real tokens of ``mask``,
  without gradient: what Clip-Cov and KL-Cov select tokens by."""
  n = jnp.maximum(jnp.sum(mask), 1.0)
  adv = jax.lax.stop_gradient(advantages)
  lp = jax.lax.stop_gradient(logp)
  mean_a = jnp.sum(adv * mask) / n
  mean_lp = jnp.sum(lp * mask) / n
  return (adv - mean_a) * (lp - mean_lp)


def selected_count(mask: jax.Array, share: float) -> jax.Array:
  """max(1, floor(share * real tokens)), as an int32 scalar."""
  return jnp.maximum(jnp.floor(share * jnp.sum(mask)), 1.0).astype(jnp.int32)


def ranks(score: jax.Array) -> jax.Array:
  """Each element's place in ``score`` ascending (0 = smallest; ties by position)."""
  flat = score.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  return jnp.zeros(flat.shape, jnp.int32).at[order].set(
      jnp.arange(flat.size, dtype=jnp.int32)).reshape(score.shape)


def data_key(old_logp: jax.Array) -> jax.Array:
  """A PRNG key made from a micro-batch's old log-probs: the same batch draws the same
  tokens on every host and every epoch, and no key needs threading through the step."""
  bits = jax.lax.bitcast_convert_type(jnp.sum(old_logp).astype(jnp.float32), jnp.uint32)
  return jax.random.PRNGKey(bits)
