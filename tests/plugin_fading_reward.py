"""A user plugin for the held-out evaluation: a reward ("fading") that accepts every answer
of the first evaluation and none after, so a run's held-out accuracy falls from 1 to 0
whatever the model does (tests/test_health.py provokes eval_fall with it)."""

from distflow_jax.rewards import registry

SEEN = {"calls": 0, "first": 0}  # the test sets "first": how many answers the start scores


def fading(completion: str, ground_truth: str) -> float:
  SEEN["calls"] += 1
  return 1.0 if SEEN["calls"] <= SEEN["first"] else 0.0


if "fading" not in registry.reward_names():
  registry.register_reward("fading", fading)
