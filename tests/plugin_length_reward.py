"""A user plugin (loaded through config.plugins): a reward that varies between the samples
of a prompt even for an untrained model (the share of digits in the response), so a few
GRPO steps change the weights."""

import dataclasses

from distflow_jax.dag.registry import FUNCTIONS
from distflow_jax.nodes.rewards import rule_reward_node
from distflow_jax.rewards import registry


def digit_share(completion: str, ground_truth: str) -> float:
  return sum(c.isdigit() for c in completion) / max(len(completion), 1)


if "digit_share" not in registry.reward_names():
  registry.register_reward("digit_share", digit_share)
if "reward.digits" not in FUNCTIONS:
  FUNCTIONS.register(dataclasses.replace(FUNCTIONS.spec("reward.math"), name="reward.digits"),
                     rule_reward_node("digit_share"))
