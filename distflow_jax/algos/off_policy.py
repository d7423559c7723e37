"""Off-policy correction: the tokens were sampled by one policy and are trained under another.

Three log-probs of each sampled response token y_t:

* ``logp_mu``    the behaviour policy mu: the rollout engine's log-prob of the token as it
  recorded it (untruncated, at the sampling temperature, as the trainer's passes read it).  Its kernels differ from the trainer's
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

* ``seq_tis``:    w_t = sg(min(prod_s r_s, C)) for every token of the sequence -- the
  sequence-level importance weight (the whole response's likelihood ratio), truncated at
  C: unbiased for sequence-level rewards where the token product is, at the price of a
  variance that grows with length (verl's sequence-level rollout IS);
* ``token_reject``: w_t = 1 if L <= r_t <= H else 0 -- rejection of the tokens whose
  engine and trainer probabilities disagree by more than the bounds (L, H =
  ``actor.off_policy.reject_low`` / ``reject_high``), the rest untouched;
* ``seq_reject``: w_t = 1 if L <= exp(mean_s log r_s) <= H else 0 for every token of the
  sequence -- rejection of whole sequences by the geometric mean of their token ratios
  (the product itself would reject nearly every long response).

With pi_prox = pi_old the two share a shape and part only above C, where TIS keeps the
token at weight C and decoupled PPO drops it.  The weights depend on no parameter, so
they are fixed for every epoch and mini-batch of a step; ``weight_stats`` measures them
once per step: the mean and max of r_t, the fraction of tokens with r_t > C, the fraction
a rejection (or decoupled PPO's cap) drops, and the mean and max |logp_old - logp_mu| (the
rollout-training log-prob gap), all over response tokens.
"""

from __future__ import annotations

import math

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
  SEQ_TIS = "seq_tis"      # the sequence's truncated likelihood ratio
  TOKEN_REJECT = "token_reject"  # tokens with r outside [L, H] dropped
  SEQ_REJECT = "seq_reject"      # sequences whose geometric-mean r is outside [L, H] dropped


def check_bounds(low: float, high: float) -> None:
  """0 <= L < 1 < H, finite: the rejection bounds keep r = 1 (engine and trainer agree)."""
  for key, v in (("reject_low", low), ("reject_high", high)):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
      raise ValueError(f"actor.off_policy.{key}={v!r} must be a finite number")
  if not 0 <= low < 1:
    raise ValueError(f"actor.off_policy.reject_low={low!r} must be in [0, 1): a token or "
                     f"sequence whose ratio pi_old / mu lies below it is dropped")
  if not high > 1:
    raise ValueError(f"actor.off_policy.reject_high={high!r} must be > 1: a token or "
                     f"sequence whose ratio pi_old / mu lies above it is dropped")


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
                  correction: "str | OffPolicyCorrection", cap: float,
                  reject_low: float = 0.5, reject_high: float = 2.0) -> jax.Array:
  """w_t of the module docstring (stop-gradient, float32, 0 on padding)."""
  kind = OffPolicyCorrection.parse(correction)
  check_cap(cap)
  check_bounds(reject_low, reject_high)
  m = response_mask_BxT > 0
  r = jax.lax.stop_gradient(behaviour_ratio(old_logprobs_BxT, behaviour_logprobs_BxT,
                                            response_mask_BxT))
  log_r = jnp.where(m, jnp.log(r), 0.0)
  if kind is OffPolicyCorrection.NONE:
    w = jnp.ones_like(r)
  elif kind is OffPolicyCorrection.TIS:
    w = jnp.minimum(r, cap)
  elif kind is OffPolicyCorrection.DECOUPLED:
    w = jnp.where(r <= cap, r, 0.0)
  elif kind is OffPolicyCorrection.SEQ_TIS:
    seq = jnp.exp(jnp.clip(jnp.sum(log_r, axis=1), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    w = jnp.broadcast_to(jnp.minimum(seq, cap)[:, None], r.shape)
  elif kind is OffPolicyCorrection.TOKEN_REJECT:
    w = ((r >= reject_low) & (r <= reject_high)).astype(jnp.float32)
  else:
    n = jnp.maximum(jnp.sum(m.astype(jnp.float32), axis=1), 1.0)
    geo = jnp.exp(jnp.sum(log_r, axis=1) / n)
    keep = (geo >= reject_low) & (geo <= reject_high)
    w = jnp.broadcast_to(keep.astype(jnp.float32)[:, None], r.shape)
  return jnp.where(m, w, 0.0)


def weight_stats(old_logprobs_BxT: jax.Array, behaviour_logprobs_BxT: jax.Array,
                 response_mask_BxT: jax.Array, cap: float,
                 correction: "str | OffPolicyCorrection" = OffPolicyCorrection.NONE,
                 reject_low: float = 0.5, reject_high: float = 2.0) -> dict[str, jax.Array]:
  """Sums over response tokens, for means across hosts: ``tokens``, ``ratio_sum`` (of
  r_t), ``ratio_max``, ``above_cap`` (tokens with r_t > C), ``dropped`` (tokens the
  correction gives weight 0), ``gap_sum`` and ``gap_max`` (of |logp_old - logp_mu|)."""
  m = response_mask_BxT > 0
  r = behaviour_ratio(old_logprobs_BxT, behaviour_logprobs_BxT, response_mask_BxT)
  gap = jnp.abs(old_logprobs_BxT.astype(jnp.float32) - behaviour_logprobs_BxT.astype(jnp.float32))
  w = token_weights(old_logprobs_BxT, behaviour_logprobs_BxT, response_mask_BxT, correction,
                    cap, reject_low, reject_high)
  zero = jnp.float32(0.0)
  return {
      "tokens": jnp.sum(m.astype(jnp.float32)),
      "ratio_sum": jnp.sum(jnp.where(m, r, zero)),
      "ratio_max": jnp.max(jnp.where(m, r, -jnp.inf), initial=-jnp.inf),
      "above_cap": jnp.sum((m & (r > cap)).astype(jnp.float32)),
      "dropped": jnp.sum((m & (w == 0)).astype(jnp.float32)),
      "gap_sum": jnp.sum(jnp.where(m, gap, zero)),
      "gap_max": jnp.max(jnp.where(m, gap, zero), initial=0.0),
  }
