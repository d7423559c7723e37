"""A user plugin (loaded through config.plugins): a reward that varies between the samples
of a prompt even for an untrained model (the share of digits in the response), so a few
GRPO steps change the weights.  One call makes it the DAG function ``reward.digits``."""

from distflow_jax.nodes.rewards import register_rule_reward


def digit_share(completion: str, ground_truth: str) -> float:
  return sum(c.isdigit() for c in completion) / max(len(completion), 1)


register_rule_reward("digits", digit_share, "the share of digits in the response")
