"""Policy losses by name (``actor.policy_loss``): one function each, registered where it
is defined.

A policy loss maps the response tokens' log-probs under the policy being trained and under
the rollout's (old) policy, the advantages and the importance ratio to a per-token loss
and per-token metrics; ``losses.policy_loss`` computes the ratio (token level, or GSPO's
sequence level: ``actor.ratio_level``), applies the off-policy weights, aggregates the
loss by ``actor.loss_agg`` and token-sums the metrics, adding the generic ones (``ppo_kl``,
``ratio``, ``pg_loss``).  A new loss is this one function and its name in the config:

    from distflow_jax.algos import policy_losses

    @policy_losses.register("reinforce")     # in a module listed in config.plugins
    def reinforce(x: policy_losses.PolicyInput) -> policy_losses.PolicyTerms:
      return policy_losses.PolicyTerms(-x.advantages * x.logp, {})

    # distflow-jax train --config.plugins='("my_losses",)' --config.actor.policy_loss=reinforce

A name is registered once (a second registration is refused, naming the first's module);
an unknown ``actor.policy_loss`` is refused at start-up, listing the registered names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class PolicyInput:
  """``[B, T]`` float32 arrays, 0 at masked positions, and the actor's clip settings.

  ``ratio`` is pi / pi_old at the run's ratio level (exp of the clamped ``log_ratio``);
  ``clip_ratio_high`` is ``clip_ratio_low`` where not set; ``clip_ratio_c`` is None where
  dual clip is off."""
  logp: jax.Array
  old_logp: jax.Array
  advantages: jax.Array
  mask: jax.Array
  log_ratio: jax.Array
  ratio: jax.Array
  clip_ratio_low: float
  clip_ratio_high: float
  clip_ratio_c: float | None


@dataclasses.dataclass(frozen=True)
class PolicyTerms:
  """The per-token loss ``[B, T]`` and per-token metrics (token-summed by the caller, so
  a metric's mean is its share of real tokens)."""
  loss: jax.Array
  metrics: Mapping[str, jax.Array]


PolicyLoss = Callable[[PolicyInput], PolicyTerms]
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
  """Registers the decorated function as policy loss ``name``; a taken name is refused."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"a policy loss needs a non-empty name, got {name!r}")

  def add(fn: PolicyLoss) -> PolicyLoss:
    if name in POLICY_LOSSES:
      first = POLICY_LOSSES[name]
      raise ValueError(f"policy loss {name!r} is registered already (by "
                       f"{first.__module__}.{first.__qualname__}); pick another name")
    POLICY_LOSSES[name] = fn
    return fn
  return add


def names() -> list[str]:
  return sorted(POLICY_LOSSES)


def get(name: str) -> PolicyLoss:
  if name not in POLICY_LOSSES:
    raise ValueError(f"actor.policy_loss={name!r} is not a registered policy loss; "
                     f"registered: {names()} (a plugin registers one with "
                     f"policy_losses.register)")
  return POLICY_LOSSES[name]


@register("ppo")
def ppo_clip(x: PolicyInput) -> PolicyTerms:
  """PPO's clipped surrogate, with DAPO's clip-higher and dual clip.

  l = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)); with dual clip (Ye et al.
  2020, c > 1) l = min(l, -A c) where A < 0.  Metrics: ``pg_clipfrac`` (the clipped
  branch was taken), ``pg_clipfrac_lower`` (the dual clip was)."""
  adv, ratio = x.advantages, x.ratio
  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1.0 - x.clip_ratio_low, 1.0 + x.clip_ratio_high)
  loss = jnp.maximum(unclipped, clipped)
  clip_taken = (clipped > unclipped).astype(jnp.float32)
  if x.clip_ratio_c is not None:
    bound = -adv * x.clip_ratio_c
    dual_taken = ((adv < 0) & (loss > bound)).astype(jnp.float32)
    loss = jnp.where(adv < 0, jnp.minimum(loss, bound), loss)
  else:
    dual_taken = jnp.zeros_like(loss)
  return PolicyTerms(loss, {"pg_clipfrac": clip_taken, "pg_clipfrac_lower": dual_taken})


@register("gpg")
def gpg(x: PolicyInput) -> PolicyTerms:
  """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline"): the
  plain policy gradient of the (group-normalized) advantages, no ratio, no clip, no KL:

    l_t = -A_t log pi(y_t)

  Its gradient at the rollout's policy equals PPO's unclipped one; it differs once the
  policy has moved (later mini-batches or epochs), where nothing bounds the step."""
  return PolicyTerms(-x.advantages * x.logp, {})


@register("cispo")
def cispo(x: PolicyInput) -> PolicyTerms:
  """CISPO (MiniMax-M1, 2025): clip the importance weight, not the update, so every token
  keeps a gradient:

    l_t = -sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) A_t log pi(y_t)

  with eps_low = ``actor.clip_ratio_low`` and eps_high = ``actor.clip_ratio_high``
  (the paper leaves the lower bound open: a clip_ratio_low near 1).  Metric
  ``pg_clipfrac``: tokens whose weight the clip changed."""
  lo, hi = 1.0 - x.clip_ratio_low, 1.0 + x.clip_ratio_high
  weight = jax.lax.stop_gradient(jnp.clip(x.ratio, lo, hi))
  clipped = ((x.ratio < lo) | (x.ratio > hi)).astype(jnp.float32)
  return PolicyTerms(-weight * x.advantages * x.logp, {"pg_clipfrac": clipped})
