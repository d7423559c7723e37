"""A user plugin (loaded through config.plugins): a reward that raises on its input."""

import dataclasses

from distflow_jax.dag.registry import FUNCTIONS
from distflow_jax.nodes.rewards import rule_reward_node
from distflow_jax.rewards import registry


def boom(completion: str, ground_truth: str) -> float:
  raise RuntimeError(f"cannot score {completion!r}")


if "boom" not in registry.reward_names():
  registry.register_reward("boom", boom)
FUNCTIONS.register(dataclasses.replace(FUNCTIONS.spec("reward.math"), name="reward.boom"),
                   rule_reward_node("boom"))
