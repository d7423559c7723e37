"""Estimators whose baseline is more than a group statistic: ReMax (the reward of the
prompt's greedy response, one more rollout) and the optimal token baseline (a baseline
per token position from the old policy's distribution).  Pure ``jax.numpy``, jittable;
shapes and masks as ``algos/advantages.py``'s, whose returns they share.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from distflow_jax.algos import advantages as adv_lib
from distflow_jax.algos.advantages import AdvantageOutput
from distflow_jax.algos.masked import real


def remax_advantages(token_rewards_BxT: jax.Array, baseline_rewards_B: jax.Array,
                     response_mask_BxT: jax.Array) -> AdvantageOutput:
  """ReMax (Li et al. 2024, "ReMax: A Simple, Effective, and Efficient Reinforcement
  Learning Method for Aligning Large Language Models"): the return minus the reward of
  the prompt's greedy response, no critic and no group:

    A_t = G_t - r(x, y_greedy),   G_t = sum_{s >= t} r_s   (undiscounted, as verl's)

  With an outcome reward G_t is the sample's reward at every token; a KL penalty in the
  reward (actor.kl.in_reward) makes it per token.  Returns are G_t.  Padding -> 0."""
  m = response_mask_BxT.astype(jnp.float32)
  adv_lib.check_rewards(baseline_rewards_B, m)
  ret = adv_lib.discounted_returns(token_rewards_BxT, m, gamma=1.0)
  adv = (ret - baseline_rewards_B.astype(jnp.float32)[:, None]) * m
  return AdvantageOutput(adv, ret)


def otb_advantages(token_rewards_BxT: jax.Array, old_logprobs_BxT: jax.Array,
                   sum_pi_squared_BxT: jax.Array, response_mask_BxT: jax.Array, *,
                   group_size: int, zero_tail: bool = True,
                   eps: float = 1e-8) -> AdvantageOutput:
  """The optimal token baseline (OTB; Li et al. 2026, arXiv 2602.07078, as verl's
  ``compute_optimal_token_baseline_advantage``): a baseline per token position, the
  group's returns weighted by each sample's accumulated variance proxy:

    w_t = 1 - 2 pi_t + sum_v pi_v^2,   W_t = sum_{j <= t} w_j          (real tokens)
    B_t = sum_i G_t^i W_t^i m_t^i / (sum_i W_t^i m_t^i + eps),   A_t = (G_t - B_t) m_t

  with G_t the undiscounted return, pi_t the sampled token's old probability and the sum
  over the group's samples at position t.  ``zero_tail``: the group's one longest
  response gets B = 0 past the second longest's length (no other sample to compare).
  Returns are G_t.  Padding -> 0."""
  m = response_mask_BxT.astype(jnp.float32)
  B, T = m.shape
  adv_lib.check_group_size(B, group_size)
  ret = adv_lib.discounted_returns(token_rewards_BxT, m, gamma=1.0)
  w = (1.0 - 2.0 * jnp.exp(real(old_logprobs_BxT, m)) + real(sum_pi_squared_BxT, m)) * m
  W = jnp.cumsum(w, axis=1)
  g = B // group_size
  num = jnp.sum((ret * W * m).reshape(g, group_size, T), axis=1)
  den = jnp.sum((W * m).reshape(g, group_size, T), axis=1) + eps
  base = jnp.broadcast_to((num / den)[:, None, :], (g, group_size, T))
  if group_size == 1:
    base = jnp.zeros_like(base)
  elif zero_tail:
    lengths = jnp.sum(m, axis=1).reshape(g, group_size)
    top2 = jax.lax.top_k(lengths, 2)[0]
    longest = lengths == top2[:, :1]
    alone = (jnp.sum(longest, axis=1, keepdims=True) == 1) & (top2[:, :1] > top2[:, 1:])
    tail = (jnp.arange(T)[None, None, :] >= top2[:, 1:, None]) & (longest & alone)[:, :, None]
    base = jnp.where(tail, 0.0, base)
  adv = (ret - base.reshape(B, T)) * m
  return AdvantageOutput(adv, ret)
