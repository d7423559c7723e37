"""The advantage estimators: one ``Estimator`` per ``advantage.<kind>`` DAG function.

An estimator is a function from a small typed input (``AdvantageInput``) to
``AdvantageOutput`` plus the facts the planner and the node need about it (group
statistics, batch whitening, which inputs it reads).  The registry derives each
estimator's ``FunctionSpec`` from its entry here (``dag.registry.estimator_spec``), and
``nodes.advantages`` runs it, so the two cannot disagree.

Adding a built-in estimator is one function and one entry of ``BUILTIN_ESTIMATORS``; a
plugin calls ``nodes.advantages.register_estimator(Estimator(...))`` instead.

This module does not import jax (the maths is imported when an estimator runs): the
registry reads the table, and the planner plans a workflow without jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
  import jax

  from distflow_jax.algos.advantages import AdvantageOutput


class AdvantageInput(NamedTuple):
  """What an estimator reads: this host's rows, whole prompt groups if it needs them."""
  rewards_B: jax.Array  # outcome reward per sample, float32
  mask_BxT: jax.Array  # response mask, float32 (1 = real token)
  group_size: int  # rollout.n; the samples of a prompt are contiguous rows
  algo: Any  # the node's ``algo`` config section (gamma, lam, norm_by_std, ...)
  # Per-token rewards (outcome reward on the last real token, minus the KL penalty when
  # actor.kl.in_reward); only for estimators with ``token_rewards``.
  token_rewards_BxT: jax.Array | None = None
  values_BxT: jax.Array | None = None  # the critic's values; only with ``values``
  # The reward of each sample's prompt's greedy response (generate.greedy, scored by the
  # rule rewards after it); only with ``baseline``.
  baseline_rewards_B: jax.Array | None = None
  # The old policy's log-probs and sum pi^2 per token (logprob.stats); only with
  # ``token_stats``.
  old_logprobs_BxT: jax.Array | None = None
  sum_pi_squared_BxT: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Estimator:
  """One advantage estimator, as a DAG function named ``name``."""
  name: str  # the registry name, "advantage.<kind>"
  fn: Callable[[AdvantageInput], AdvantageOutput]
  # Group statistics: every sample of a prompt on one host (planned for, checked on the
  # host, and rollout.n >= 2 is required).
  needs_groups: bool = False
  # The advantages are whitened over the whole batch of every host after ``fn``
  # (bitwise the same however samples are spread); ``fn`` must not whiten itself.
  whiten: bool = False
  # Reads per-token rewards, so a KL penalty in the reward (actor.kl.in_reward) applies.
  token_rewards: bool = False
  # Reads the critic's values and makes the returns that train.critic fits.
  values: bool = False
  # Reads the greedy baseline's rewards: the workflow needs a generate.greedy node before
  # its rule rewards (dag/rules.check_baseline_rewards).
  baseline: bool = False
  # Reads the old log-probs and sum pi^2 per token: needs a logprob.stats node.
  token_stats: bool = False
  doc: str = ""


def _maths():
  # Imported when an estimator runs, not with this module: see the module docstring.
  from distflow_jax.algos import advantages
  return advantages


def gae(x: AdvantageInput) -> AdvantageOutput:
  return _maths().gae_advantages(x.token_rewards_BxT, x.values_BxT, x.mask_BxT,
                                 gamma=x.algo.gamma, lam=x.algo.lam, whiten=False)


def grpo(x: AdvantageInput) -> AdvantageOutput:
  return _maths().grpo_advantages(x.rewards_B, x.mask_BxT, group_size=x.group_size,
                                  normalize_by_std=x.algo.norm_by_std)


def rloo(x: AdvantageInput) -> AdvantageOutput:
  return _maths().rloo_advantages(x.rewards_B, x.mask_BxT, group_size=x.group_size)


def reinforce_pp(x: AdvantageInput) -> AdvantageOutput:
  return _maths().reinforce_pp_advantages(x.token_rewards_BxT, x.mask_BxT,
                                          gamma=x.algo.gamma, whiten=False)


def reinforce_pp_baseline(x: AdvantageInput) -> AdvantageOutput:
  return _maths().reinforce_pp_baseline_advantages(x.rewards_B, x.mask_BxT,
                                                   group_size=x.group_size, whiten=False)


def opo(x: AdvantageInput) -> AdvantageOutput:
  return _maths().opo_advantages(x.rewards_B, x.mask_BxT, group_size=x.group_size)


def grpo_passk(x: AdvantageInput) -> AdvantageOutput:
  return _maths().grpo_passk_advantages(x.rewards_B, x.mask_BxT, group_size=x.group_size,
                                        normalize_by_std=x.algo.norm_by_std)


def _baselines():
  from distflow_jax.algos import token_baselines
  return token_baselines


def remax(x: AdvantageInput) -> AdvantageOutput:
  return _baselines().remax_advantages(x.token_rewards_BxT, x.baseline_rewards_B, x.mask_BxT)


def otb(x: AdvantageInput) -> AdvantageOutput:
  return _baselines().otb_advantages(x.token_rewards_BxT, x.old_logprobs_BxT,
                                 x.sum_pi_squared_BxT, x.mask_BxT, group_size=x.group_size)


BUILTIN_ESTIMATORS: tuple[Estimator, ...] = (
    Estimator("advantage.gae", gae, whiten=True, token_rewards=True, values=True,
              doc="GAE(gamma, lambda) per token"),
    Estimator("advantage.grpo", grpo, needs_groups=True,
              doc="group-normalised outcome reward (Dr.GRPO: no std)"),
    Estimator("advantage.rloo", rloo, needs_groups=True, doc="leave-one-out baseline"),
    Estimator("advantage.reinforce_pp", reinforce_pp, whiten=True, token_rewards=True,
              doc="REINFORCE++: discounted return, whitened over the batch"),
    Estimator("advantage.reinforce_pp_baseline", reinforce_pp_baseline, needs_groups=True,
              whiten=True, doc="REINFORCE++ with a group-mean baseline"),
    Estimator("advantage.opo", opo, needs_groups=True,
              doc="OPO: the group's length-weighted mean reward as the baseline"),
    Estimator("advantage.grpo_passk", grpo_passk, needs_groups=True,
              doc="GRPO pass@k: only the group's best sample learns, by its lead"),
    Estimator("advantage.remax", remax, token_rewards=True, baseline=True,
              doc="ReMax: the return minus the reward of the prompt's greedy response"),
    Estimator("advantage.otb", otb, needs_groups=True, token_rewards=True, token_stats=True,
              doc="optimal token baseline: per-position returns weighted by sum(1-2pi+pi^2)"),
)
