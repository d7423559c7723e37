"""Moved to the node catalogue ``distflow_jax.nodes``; re-exported for older importers."""
from distflow_jax.nodes import bind_builtins  # noqa: F401
from distflow_jax.nodes.advantages import global_whiten, register_estimator  # noqa: F401
from distflow_jax.nodes.rewards import reward_model, rule_reward_node  # noqa: F401
from distflow_jax.nodes.rollout import generate, prompt_width  # noqa: F401
