"""The temperature the training passes read the policy at: the rollout's.

    t = train_temperature(cfg, nodes, registry)   # rollout.temperature; 1 for greedy
    check_training(cfg, plan, registry)           # what training needs of the sampling

The samples come from softmax(logits / T), so the policy gradient, the PPO ratio, the KL
to the reference and the entropy are those of that distribution: every training pass
(old log-probs, reference log-probs, the actor's loss) divides the logits by T, as verl
and TRL do.  The rollout records its tokens' log-probs at the same T, untruncated
(``rollout.sampling``), so they stand in for the old log-probs at any temperature
(``nodes/pass_plan.on_policy``) and are the behaviour policy of an off-policy correction.
At T = 1 nothing changes.
"""

from __future__ import annotations

from distflow_jax.config import checks
from distflow_jax.config.response import pass_temperature


def check_training(cfg, plan, registry) -> None:
  """What only training needs of the sampling (eval and generate may decode greedily or at
  any temperature): sampled groups (checks.check_group_sampling)."""
  checks.check_group_sampling(cfg, plan, registry)


def rollout_temperatures(cfg, nodes, registry) -> dict[str, float]:
  """Each rollout node's effective temperature (its own override, else the global one)."""
  return {n.id: float(checks.node_section(cfg, n, registry).temperature) for n in nodes
          if registry.spec(n.fn).section == "rollout"}


def train_temperature(cfg, nodes, registry) -> float:
  """The rollout node's temperature (a DAG has one: two producers of its tokens are
  refused), or the global one; 1 for greedy."""
  temps = list(rollout_temperatures(cfg, nodes, registry).values())
  return pass_temperature(temps[0] if temps else cfg.rollout.temperature)
