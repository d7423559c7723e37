"""A user plugin (loaded through config.plugins): rewards that return what a score must not
be: 1e300 (finite as a Python float, inf as the float32 the batch keeps) and the text "1.0"."""

import dataclasses

from distflow_jax.dag.registry import FUNCTIONS
from distflow_jax.nodes.rewards import rule_reward_node
from distflow_jax.rewards import registry


def huge_reward(completion: str, ground_truth: str) -> float:
  return 1e300


def text_reward(completion: str, ground_truth: str) -> str:
  return "1.0"


for _name, _fn in (("huge_reward", huge_reward), ("text_reward", text_reward)):
  if _name not in registry.reward_names():
    registry.register_reward(_name, _fn)
  node = "reward." + _name.split("_")[0]
  if node not in FUNCTIONS:
    FUNCTIONS.register(dataclasses.replace(FUNCTIONS.spec("reward.math"), name=node),
                       rule_reward_node(_name))
