"""A user plugin (loaded through config.plugins): a reward that returns NaN."""

import dataclasses

from distflow_jax.dag.registry import FUNCTIONS
from distflow_jax.nodes.rewards import rule_reward_node
from distflow_jax.rewards import registry


def nan_reward(completion: str, ground_truth: str) -> float:
  return float("nan")


if "nan_reward" not in registry.reward_names():
  registry.register_reward("nan_reward", nan_reward)
if "reward.nan" not in FUNCTIONS:
  FUNCTIONS.register(dataclasses.replace(FUNCTIONS.spec("reward.math"), name="reward.nan"),
                     rule_reward_node("nan_reward"))
