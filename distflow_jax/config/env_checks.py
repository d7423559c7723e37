"""Checks of the multi-turn episode keys (``rollout.env``, ``tool_parser``, ``max_turns``,
``env_timeout_s``, ``on_env_error``; see rollout/episodes.py): one ConfigError line each."""

from __future__ import annotations

from distflow_jax.config.loading import ConfigError
from distflow_jax.config.values import in_range, one_of, positive
from distflow_jax.envs import base as env_base, guard as env_guard, parsers


def check(cfg) -> None:
  """Raises the first failure of ``cfg``'s episode keys (after config.plugins loaded)."""
  r = cfg.rollout
  if "env" not in r:
    return
  one_of(r.tool_parser, parsers.ToolParser, "rollout.tool_parser")
  one_of(r.on_env_error, env_guard.OnEnvError, "rollout.on_env_error")
  positive(r.max_turns, "rollout.max_turns")
  in_range(r.env_timeout_s, "rollout.env_timeout_s", 0, lo_open=True,
           note=" (seconds each reset / step call may take)")
  if not r.env:
    readers = [n.get("id") for n in (cfg.dag or []) if hasattr(n, "get")
               and n.get("fn") == "reward.env"]
    if readers:
      raise ConfigError(f"DAG node {readers[0]!r} (reward.env) reads the environment's rewards "
                        f"of multi-turn episodes, but rollout.env is not set; set it to an "
                        f"environment or use another reward")
    return
  env_base.env_factory(r.env)  # resolves the name / imports module:Class, or one line
  context = cfg.data.max_prompt_len + r.max_new_tokens - 1
  if max(r.prefill_buckets) < context:
    raise ConfigError(
        f"rollout.env={r.env!r}: each turn re-prefills the prompt and the episode so far, up "
        f"to data.max_prompt_len + rollout.max_new_tokens - 1 = {context} tokens, but the "
        f"largest of rollout.prefill_buckets={list(r.prefill_buckets)} is smaller; add a "
        f"bucket >= {context}")
  if cfg.data.get("image_key", ""):
    raise ConfigError(f"rollout.env={r.env!r} does not take images yet; unset data.image_key "
                      f"or rollout.env")
