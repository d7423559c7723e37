"""A user plugin (loaded through config.plugins): a reward that raises on its input."""

import dataclasses

from distflow_jax.dag.registry import FUNCTIONS
from distflow_jax.rewards import registry
from distflow_jax.workflow import nodes


def boom(completion: str, ground_truth: str) -> float:
  raise RuntimeError(f"cannot score {completion!r}")


if "boom" not in registry.reward_names():
  registry.register_reward("boom", boom)
FUNCTIONS.register(dataclasses.replace(FUNCTIONS.spec("reward.math"), name="reward.boom"),
                   nodes.rule_reward_node("boom"))
