"""A user plugin (loaded through config.plugins): a reward that raises on its input."""

from distflow_jax.nodes.rewards import register_rule_reward


def boom(completion: str, ground_truth: str) -> float:
  raise RuntimeError(f"cannot score {completion!r}")


register_rule_reward("boom", boom, "raises on its input")
