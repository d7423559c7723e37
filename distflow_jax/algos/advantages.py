"""Advantage estimators: GAE, GRPO (and Dr.GRPO), RLOO, REINFORCE++ (+ baseline), OPO,
GRPO pass@k (ReMax and the optimal token baseline: ``algos/token_baselines.py``).

All functions are pure ``jax.numpy`` and jittable.  Token-level tensors are
``[B, T]`` over the *response* tokens with a ``response_mask_BxT`` (float or
bool, 1 = real token).  Sequence-level rewards are ``[B]``.

Group structure (the ``n`` samples of one prompt) is given either as a fixed
``group_size`` with the samples of a prompt contiguous (``B % group_size == 0``)
or as ``group_ids_B`` (int, values in ``[0, num_groups)``) plus a static
``num_groups``.  In DistFlow these run on the host that generated the group,
before any re-partition, so group statistics need no communication.  Batch
whitening (GAE, REINFORCE++) is likewise over the arrays passed in, i.e. the
local batch.

Every estimator returns ``AdvantageOutput(advantages_BxT, returns_BxT)``, both
zero on padding.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from distflow_jax.algos.masked import masked_whiten, real


_STD_EPS = 1e-6


class AdvantageOutput(NamedTuple):
  advantages_BxT: jax.Array
  returns_BxT: jax.Array


# --------------------------------------------------------------------------
# Group statistics.


def check_group_size(batch_size: int, group_size: int) -> None:
  if group_size < 1:
    raise ValueError(f"group_size must be >= 1, got {group_size}")
  if batch_size % group_size:
    raise ValueError(
        f"batch size {batch_size} is not a multiple of group_size {group_size}: "
        "the samples of each prompt must be contiguous groups of equal size")


def _group_stats(x_B: jax.Array, group_size: int | None,
                 group_ids_B: jax.Array | None, num_groups: int | None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-sample (group mean, group sum of squared deviations, group count)."""
  (B,) = x_B.shape
  if (group_size is None) == (group_ids_B is None):
    raise ValueError("give exactly one of group_size or group_ids_B "
                     f"(got group_size={group_size}, group_ids_B="
                     f"{'None' if group_ids_B is None else 'array'})")
  if group_size is not None:
    check_group_size(B, group_size)
    x_GxN = x_B.reshape(B // group_size, group_size)
    mean_G = jnp.mean(x_GxN, axis=1)
    ss_G = jnp.sum(jnp.square(x_GxN - mean_G[:, None]), axis=1)
    cnt = jnp.full((B,), group_size, x_B.dtype)
    return jnp.repeat(mean_G, group_size), jnp.repeat(ss_G, group_size), cnt
  if num_groups is None:
    raise ValueError("group_ids_B needs a static num_groups (an int)")
  if group_ids_B.shape != (B,):
    raise ValueError(f"group_ids_B has shape {group_ids_B.shape}, rewards have "
                     f"shape {(B,)}")
  seg = lambda v: jax.ops.segment_sum(v, group_ids_B, num_segments=num_groups)
  cnt_G = seg(jnp.ones_like(x_B))
  mean_G = seg(x_B) / jnp.maximum(cnt_G, 1.0)
  mean_B = mean_G[group_ids_B]
  ss_G = seg(jnp.square(x_B - mean_B))
  return mean_B, ss_G[group_ids_B], cnt_G[group_ids_B]


def _broadcast(a_B: jax.Array, response_mask_BxT: jax.Array) -> jax.Array:
  return a_B[:, None] * response_mask_BxT.astype(a_B.dtype)


def check_rewards(rewards_B: jax.Array, response_mask_BxT: jax.Array) -> None:
  if rewards_B.ndim != 1 or response_mask_BxT.ndim != 2 or (
      rewards_B.shape[0] != response_mask_BxT.shape[0]):
    raise ValueError(f"rewards_B shape {rewards_B.shape} and response_mask_BxT "
                     f"shape {response_mask_BxT.shape} must be [B] and [B, T]")


# --------------------------------------------------------------------------
# Outcome-reward estimators.


def grpo_advantages(rewards_B: jax.Array, response_mask_BxT: jax.Array, *,
                    group_size: int | None = None,
                    group_ids_B: jax.Array | None = None,
                    num_groups: int | None = None,
                    normalize_by_std: bool = True,
                    eps: float = _STD_EPS) -> AdvantageOutput:
  """GRPO (Shao et al. 2024): A_i = (r_i - mean_g(r)) / (std_g(r) + eps).

  ``std_g`` is the unbiased (n-1) sample standard deviation of the group.
  ``normalize_by_std=False`` is Dr.GRPO (Liu et al. 2025): A_i = r_i - mean_g.
  A group of one sample has no baseline and gets advantage 0.  The
  sequence advantage is broadcast to every response token.
  """
  check_rewards(rewards_B, response_mask_BxT)
  r = rewards_B.astype(jnp.float32)
  mean, ss, cnt = _group_stats(r, group_size, group_ids_B, num_groups)
  adv = r - mean
  if normalize_by_std:
    std = jnp.sqrt(ss / jnp.maximum(cnt - 1.0, 1.0))
    adv = adv / (std + eps)
  adv = jnp.where(cnt > 1, adv, 0.0)
  a = _broadcast(adv, response_mask_BxT)
  return AdvantageOutput(a, a)


def rloo_advantages(rewards_B: jax.Array, response_mask_BxT: jax.Array, *,
                    group_size: int | None = None,
                    group_ids_B: jax.Array | None = None,
                    num_groups: int | None = None) -> AdvantageOutput:
  """RLOO (Ahmadian et al. 2024): A_i = r_i - mean_{j != i, j in g} r_j.

  Equivalently n / (n - 1) * (r_i - mean_g).  Groups of one sample get 0.
  """
  check_rewards(rewards_B, response_mask_BxT)
  r = rewards_B.astype(jnp.float32)
  mean, _, cnt = _group_stats(r, group_size, group_ids_B, num_groups)
  adv = jnp.where(cnt > 1, (r - mean) * cnt / jnp.maximum(cnt - 1.0, 1.0), 0.0)
  a = _broadcast(adv, response_mask_BxT)
  return AdvantageOutput(a, a)


def opo_advantages(rewards_B: jax.Array, response_mask_BxT: jax.Array, *,
                   group_size: int) -> AdvantageOutput:
  """OPO (Hao et al. 2025, "On-Policy RL with Optimal reward baseline"): the group's
  length-weighted mean reward as the baseline, no std division:

    b_g = sum_j |y_j| r_j / sum_j |y_j|,   A_i = r_i - b_g

  (|y_j| = real response tokens; the baseline that minimises the gradient's variance
  when every token's gradient has the same size).  A group whose responses are all empty
  has no baseline: its advantages are 0 (verl divides by zero there).  Groups of one
  sample (not planned: rollout.n >= 2 is required) would get b = r, so A = 0."""
  check_rewards(rewards_B, response_mask_BxT)
  (B,) = rewards_B.shape
  check_group_size(B, group_size)
  r = rewards_B.astype(jnp.float32).reshape(B // group_size, group_size)
  n = jnp.sum(response_mask_BxT.astype(jnp.float32), axis=1).reshape(r.shape)
  total = jnp.sum(n, axis=1, keepdims=True)
  base = jnp.sum(n * r, axis=1, keepdims=True) / jnp.maximum(total, 1.0)
  adv = jnp.where(total > 0, r - base, 0.0).reshape(B)
  a = _broadcast(adv, response_mask_BxT)
  return AdvantageOutput(a, a)


def grpo_passk_advantages(rewards_B: jax.Array, response_mask_BxT: jax.Array, *,
                          group_size: int, normalize_by_std: bool = True,
                          eps: float = _STD_EPS) -> AdvantageOutput:
  """GRPO for pass@k (Chen et al. 2025, arXiv 2503.19595): only each group's best sample
  learns, by how much it beats the runner-up:

    A_best = (r_(1) - r_(2)) / (std_g(r) + eps),   A_other = 0

  with r_(1) >= r_(2) the group's two largest rewards and std_g the unbiased sample std
  (``algo.norm_by_std=False``: no division).  On ties for the best the first sample in the
  group is the best, and r_(1) - r_(2) = 0 anyway.  Needs groups of at least 2."""
  check_rewards(rewards_B, response_mask_BxT)
  (B,) = rewards_B.shape
  check_group_size(B, group_size)
  if group_size < 2:
    raise ValueError(f"GRPO pass@k needs at least 2 samples a group, got {group_size}")
  r = rewards_B.astype(jnp.float32).reshape(B // group_size, group_size)
  top2, _ = jax.lax.top_k(r, 2)
  gap = top2[:, 0] - top2[:, 1]
  if normalize_by_std:
    gap = gap / (jnp.std(r, axis=1, ddof=1) + eps)
  best = jnp.argmax(r, axis=1)
  adv = jnp.where(jnp.arange(group_size)[None, :] == best[:, None], gap[:, None], 0.0)
  a = _broadcast(adv.reshape(B), response_mask_BxT)
  return AdvantageOutput(a, a)


def outcome_to_token_rewards(rewards_B: jax.Array,
                             response_mask_BxT: jax.Array) -> jax.Array:
  """Places each sequence reward on its last real response token ([B, T]).

  An empty response (all-zero mask) gets no reward anywhere.
  """
  check_rewards(rewards_B, response_mask_BxT)
  m = response_mask_BxT.astype(jnp.float32)
  T = m.shape[1]
  # Index of the last real token: the largest t with m[t] > 0.
  last_B = jnp.max(jnp.where(m > 0, jnp.arange(T)[None, :], -1), axis=1)
  onehot = (jnp.arange(T)[None, :] == last_B[:, None]).astype(jnp.float32)
  return onehot * rewards_B.astype(jnp.float32)[:, None]


def _reverse_masked_scan(step: Callable, init, xs_TxB: tuple) -> jax.Array:
  _, out_TxB = jax.lax.scan(step, init, xs_TxB, reverse=True)
  return out_TxB.T


# The scans are jitted with their coefficients static: an eager lax.scan traces its body
# anew on every call and compiles it again, once per RL step.
@functools.partial(jax.jit, static_argnames=("gamma",))
def discounted_returns(token_rewards_BxT: jax.Array, response_mask_BxT: jax.Array,
                       gamma: float) -> jax.Array:
  """G_t = r_t + gamma * G_{t'} with t' the next real token; padding -> 0.

  Padding is skipped, not counted as a time step, so interior padding does not
  add extra discounting and nothing leaks from padding into real tokens.
  """
  m = response_mask_BxT.astype(jnp.float32)
  r = real(token_rewards_BxT, m)

  def step(next_ret_B, xs):
    r_B, m_B = xs
    ret = r_B + gamma * next_ret_B
    valid = m_B > 0
    return jnp.where(valid, ret, next_ret_B), jnp.where(valid, ret, 0.0)

  return _reverse_masked_scan(step, jnp.zeros(r.shape[:1]), (r.T, m.T))


def reinforce_pp_advantages(token_rewards_BxT: jax.Array,
                            response_mask_BxT: jax.Array, *,
                            gamma: float = 1.0,
                            whiten: bool = True) -> AdvantageOutput:
  """REINFORCE++ (Hu 2025): returns-to-go, whitened over the batch.

  ``token_rewards_BxT`` usually holds the outcome reward on the last token
  (``outcome_to_token_rewards``) minus a per-token KL penalty
  (``kl.apply_kl_penalty``).  A_t = whiten(G_t) with
  G_t = sum_{s >= t} gamma^(s - t) r_s; the returns are the unwhitened G_t.
  """
  m = response_mask_BxT.astype(jnp.float32)
  ret = discounted_returns(token_rewards_BxT, m, gamma)
  adv = masked_whiten(ret, m) if whiten else ret
  return AdvantageOutput(adv, ret)


def reinforce_pp_baseline_advantages(rewards_B: jax.Array,
                                     response_mask_BxT: jax.Array, *,
                                     group_size: int | None = None,
                                     group_ids_B: jax.Array | None = None,
                                     num_groups: int | None = None,
                                     whiten: bool = True) -> AdvantageOutput:
  """REINFORCE++-baseline: subtract the group mean, then whiten over the batch.

  a_i = r_i - mean_g(r), broadcast to the response tokens, then
  A = masked_whiten(a) over every real token of the batch (global, not
  per-group, scale: the difference from GRPO).  Returns are the unwhitened a.
  """
  check_rewards(rewards_B, response_mask_BxT)
  r = rewards_B.astype(jnp.float32)
  mean, _, _ = _group_stats(r, group_size, group_ids_B, num_groups)
  m = response_mask_BxT.astype(jnp.float32)
  centred = _broadcast(r - mean, m)
  adv = masked_whiten(centred, m) if whiten else centred
  return AdvantageOutput(adv, centred)


# --------------------------------------------------------------------------
# Critic-based estimator.


def gae_advantages(token_rewards_BxT: jax.Array, values_BxT: jax.Array,
                   response_mask_BxT: jax.Array, *, gamma: float = 1.0,
                   lam: float = 1.0, whiten: bool = True) -> AdvantageOutput:
  """Generalised advantage estimation (Schulman et al. 2016).

  Over the real tokens t_1 < t_2 < ... of a sequence (padding is skipped):
    delta_t = r_t + gamma * V_{next(t)} - V_t,   V after the last token = 0
    A_t     = delta_t + gamma * lam * A_{next(t)}
    R_t     = A_t + V_t                           (the critic's target)
  computed with a reverse ``lax.scan``.  The response ends with the episode,
  so the last real token bootstraps from 0.  Padding values and rewards never
  reach a real token.  ``whiten`` normalises A over the batch's real tokens;
  the returns are always from the unwhitened A.
  """
  if not (token_rewards_BxT.shape == values_BxT.shape == response_mask_BxT.shape):
    raise ValueError(
        f"token_rewards_BxT {token_rewards_BxT.shape}, values_BxT "
        f"{values_BxT.shape} and response_mask_BxT {response_mask_BxT.shape} "
        "must have the same [B, T] shape")
  adv, ret = _gae_scan(token_rewards_BxT, values_BxT, response_mask_BxT, gamma, lam)
  if whiten:
    adv = masked_whiten(adv, response_mask_BxT.astype(jnp.float32))
  return AdvantageOutput(adv, ret)


@functools.partial(jax.jit, static_argnames=("gamma", "lam"))
def _gae_scan(token_rewards_BxT: jax.Array, values_BxT: jax.Array,
              response_mask_BxT: jax.Array, gamma: float, lam: float
              ) -> tuple[jax.Array, jax.Array]:
  """GAE's (advantages, returns), unwhitened."""
  m = response_mask_BxT.astype(jnp.float32)
  r = real(token_rewards_BxT, m)
  v = real(values_BxT, m)

  def step(carry, xs):
    next_v_B, next_a_B = carry
    r_B, v_B, m_B = xs
    a = r_B + gamma * next_v_B - v_B + gamma * lam * next_a_B
    valid = m_B > 0
    carry = (jnp.where(valid, v_B, next_v_B), jnp.where(valid, a, next_a_B))
    return carry, jnp.where(valid, a, 0.0)

  zeros = jnp.zeros(r.shape[:1])
  adv = _reverse_masked_scan(step, (zeros, zeros), (r.T, v.T, m.T))
  return adv, (adv + v) * m
