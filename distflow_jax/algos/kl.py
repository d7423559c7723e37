"""KL to the reference policy: per-token estimators, reward penalty, controller.

Per-token estimators of KL(pi || pi_ref) from samples y_t ~ pi, with
log r = log pi_ref(y_t) - log pi(y_t) (Schulman, "Approximating KL
divergence", 2020):

  k1 = -log r                       unbiased, can be negative
  k2 = (log r)^2 / 2                biased, low variance, >= 0
  k3 = (r - 1) - log r              unbiased, low variance, >= 0

The KL can enter training as a loss term (``losses.kl_loss``) or as a
penalty on the token rewards before the advantage (``apply_kl_penalty``) with
a fixed or adaptive coefficient (``adaptive_kl_coef``).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from distflow_jax.algos.choice import Choice

# exp() of a log-ratio beyond this overflows float32 or dominates the batch;
# clamping only touches samples that are already pathological.
_LOG_RATIO_CLAMP = 20.0


class KLEstimator(Choice):
  """KL estimator"""
  K1 = "k1"
  K2 = "k2"
  K3 = "k3"


# verl's bound on a token's k3 estimate (actor.kl.k3_cap's default).
K3_CAP = 10.0


def kl_divergence(logprobs_BxT: jax.Array, ref_logprobs_BxT: jax.Array,
                  estimator: "str | KLEstimator" = KLEstimator.K3,
                  k3_cap: float = K3_CAP) -> jax.Array:
  """Per-token KL estimate [B, T] (see the module docstring for the maths).

  k3 is capped at ``k3_cap`` (``actor.kl.k3_cap``, 0 = no cap), as verl caps it at 10:
  exp(log r) - 1 - log r grows exponentially, 3.2e6 per token at a log-ratio of 15, so one
  stale or degenerate token would swamp a step's loss and gradient (a capped token adds
  the cap and no gradient)."""
  est = KLEstimator.parse(estimator)
  if logprobs_BxT.shape != ref_logprobs_BxT.shape:
    raise ValueError(f"logprobs_BxT {logprobs_BxT.shape} and ref_logprobs_BxT "
                     f"{ref_logprobs_BxT.shape} differ in shape")
  log_r = (ref_logprobs_BxT.astype(jnp.float32)
           - logprobs_BxT.astype(jnp.float32))
  if est is KLEstimator.K1:
    return -log_r
  if est is KLEstimator.K2:
    return 0.5 * jnp.square(log_r)
  log_r = jnp.clip(log_r, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
  k3 = jnp.expm1(log_r) - log_r
  return jnp.minimum(k3, k3_cap) if k3_cap else k3


def apply_kl_penalty(token_rewards_BxT: jax.Array, kl_BxT: jax.Array,
                     response_mask_BxT: jax.Array, coef: float | jax.Array
                     ) -> jax.Array:
  """r'_t = r_t - coef * kl_t on real tokens; padding stays 0."""
  m = response_mask_BxT.astype(jnp.float32)
  return (token_rewards_BxT.astype(jnp.float32) - coef * kl_BxT) * m


def adaptive_kl_coef(coef: float | jax.Array, observed_kl: float | jax.Array,
                     target: float, horizon: float, n_steps: int | jax.Array
                     ) -> jax.Array:
  """Adaptive KL coefficient (Ziegler et al. 2019), one update.

    e     = clip(observed_kl / target - 1, -0.2, 0.2)
    coef' = coef * (1 + e * n_steps / horizon)

  ``observed_kl`` is the mean per-token (or per-sequence) KL of the batch just
  seen, ``n_steps`` the number of samples (or steps) it covers.  A fixed
  coefficient is simply not updating.  ``coef``, ``observed_kl`` and
  ``n_steps`` may be traced; ``target`` and ``horizon`` are config numbers.
  """
  if target <= 0 or horizon <= 0:
    raise ValueError(f"target ({target}) and horizon ({horizon}) must be > 0")
  err = jnp.clip(jnp.asarray(observed_kl, jnp.float32) / target - 1.0, -0.2, 0.2)
  return jnp.asarray(coef, jnp.float32) * (1.0 + err * n_steps / horizon)
