"""Rule rewards (host-side, on strings): math answer verifiers and a registry."""

from distflow_jax.rewards.math_answer import (answers_match, extract_answer,
                                              format_reward, math_reward,
                                              parse_number)
from distflow_jax.rewards.registry import (RewardFn, RewardFunctionError,
                                           get_reward, register_reward,
                                           reward_names, score_batch,
                                           weighted_reward)

__all__ = [
    "RewardFn", "RewardFunctionError", "answers_match", "extract_answer",
    "format_reward", "get_reward", "math_reward", "parse_number",
    "register_reward", "reward_names", "score_batch", "weighted_reward",
]
