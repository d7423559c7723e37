"""Off-policy correction: the tokens were sampled by one policy and are trained under another.

Three log-probs of each sampled response token y_t:

* ``logp_mu``    the behaviour policy mu: the rollout engine's log-prob of the token as it
  recorded it (temperature 1, untruncated).  Its kernels differ from the trainer's
  (bfloat16, a decode cache, other attention), and in an asynchronous loop so may its
  weights (older versions);
* ``logp_old``   the proximal / old policy pi_old: the trainer's own recomputed log-prob
  before the update (the ``logprob`` node);
* ``logp``       pi_theta, the policy being trained.

Let l_t be the per-token policy loss (``losses.policy_loss``: the PPO clipped surrogate of
rho_t = pi_theta / pi_old, dual clip included) and

    r_t = pi_old(y_t) / mu(y_t) = exp(logp_old - logp_mu)

the behaviour importance ratio.  With C = ``actor.off_policy.tis_cap`` > 0 and sg the stop
gradient, a correction multiplies l_t by a weight w_t:

* ``none``:       w_t = 1 (the loss is not touched at all);
* ``tis``:        w_t = sg(min(r_t, C)) -- truncated importance sampling, verl's fix of the
  rollout/training mismatch (Yao et al. 2025): a token the trainer finds likelier than the
  engine did counts more, at most C times;
* ``decoupled``:  w_t = sg(r_t) if r_t <= C else 0 -- AReaL's decoupled PPO (Fu et al.
  2025): the clip bounds the update against the proximal policy pi_prox = pi_old, and the
  whole token term is weighted by pi_prox / mu; a token whose weight exceeds the cap is
  dropped from the loss, not truncated (AReaL's ``behav_imp_weight_cap``).

With pi_prox = pi_old the two share a shape and part only above C, where TIS keeps the
token at weight C and decoupled PPO drops it.  The weights depend on no parameter, so
they are fixed for every epoch and mini-batch of a step; ``weight_stats`` measures them
once per step: the mean and max of r_t, the fraction of tokens with r_t > C, and the
mean |logp_old - logp_mu| (the rollout-training log-prob gap), all over response tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from distflow_jax.algos.choice import Choice

# exp() of a larger log-ratio overflows float32 (e^88); the policy loss clamps likewise.
LOG_RATIO_CLAMP = 20.0


class OffPolicyCorrection(Choice):
  """off-policy correction"""
  NONE = "none"
  TIS = "tis"              # truncated importance sampling (verl)
  DECOUPLED = "decoupled"  # decoupled PPO (AReaL)


def check_cap(cap: float) -> None:
  """C must be a finite number > 0."""
  if not (isinstance(cap, (int, float)) and cap > 0 and cap != float("inf")):
    raise ValueError(f"the importance weight cap must be a finite number > 0, got {cap!r}")


def behaviour_ratio(old_logprobs_BxT: jax.Array, behaviour_logprobs_BxT: jax.Array,
                    response_mask_BxT: jax.Array) -> jax.Array:
  """r_t = exp(logp_old - logp_mu) on response tokens, 1 on padding (float32)."""
  m = response_mask_BxT > 0
  gap = jnp.where(m, old_logprobs_BxT.astype(jnp.float32)
                  - behaviour_logprobs_BxT.astype(jnp.float32), 0.0)
  return jnp.exp(jnp.clip(gap, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def token_weights(old_logprobs_BxT: jax.Array, behaviour_logprobs_BxT: jax.Array,
                  response_mask_BxT: jax.Array,
                  correction: "str | OffPolicyCorrection", cap: float) -> jax.Array:
  """w_t of the module docstring (stop-gradient, float32, 0 on padding)."""
  kind = OffPolicyCorrection.parse(correction)
  check_cap(cap)
  r = jax.lax.stop_gradient(behaviour_ratio(old_logprobs_BxT, behaviour_logprobs_BxT,
                                            response_mask_BxT))
  if kind is OffPolicyCorrection.NONE:
    w = jnp.ones_like(r)
  elif kind is OffPolicyCorrection.TIS:
    w = jnp.minimum(r, cap)
  else:
    w = jnp.where(r <= cap, r, 0.0)
  return jnp.where(response_mask_BxT > 0, w, 0.0)


def weight_stats(old_logprobs_BxT: jax.Array, behaviour_logprobs_BxT: jax.Array,
                 response_mask_BxT: jax.Array, cap: float) -> dict[str, jax.Array]:
  """Sums over response tokens, for means across hosts: ``tokens``, ``ratio_sum`` (of
  r_t), ``ratio_max``, ``above_cap`` (tokens with r_t > C) and ``gap_sum`` (of
  |logp_old - logp_mu|)."""
  m = response_mask_BxT > 0
  r = behaviour_ratio(old_logprobs_BxT, behaviour_logprobs_BxT, response_mask_BxT)
  gap = jnp.abs(old_logprobs_BxT.astype(jnp.float32) - behaviour_logprobs_BxT.astype(jnp.float32))
  zero = jnp.float32(0.0)
  return {
      "tokens": jnp.sum(m.astype(jnp.float32)),
      "ratio_sum": jnp.sum(jnp.where(m, r, zero)),
      "ratio_max": jnp.max(jnp.where(m, r, -jnp.inf), initial=-jnp.inf),
      "above_cap": jnp.sum((m & (r > cap)).astype(jnp.float32)),
      "gap_sum": jnp.sum(jnp.where(m, gap, zero)),
  }
