"""Checks of the multi-turn episode keys (``rollout.env``, ``tool_parser``, ``max_turns``,
``env_timeout_s``, ``on_env_error``, ``max_episode_tokens``; see rollout/episodes.py): one
ConfigError line each."""

from __future__ import annotations

from distflow_jax.config.response import longest_sample
from distflow_jax.config.errors import ConfigError
from distflow_jax.config.validators import in_range, one_of, positive
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
  episode = r.max_episode_tokens
  if not isinstance(episode, int) or isinstance(episode, bool) or episode < 0:
    raise ConfigError(f"rollout.max_episode_tokens={episode!r} must be an int >= 0 (0: an "
                      f"episode's response is at most rollout.max_new_tokens)")
  if episode and not r.env:
    raise ConfigError(f"rollout.max_episode_tokens={episode} limits multi-turn episodes, but "
                      f"rollout.env is not set; set rollout.env or leave it at 0 (single "
                      f"turns are at most rollout.max_new_tokens)")
  if episode and episode < r.max_new_tokens:
    raise ConfigError(f"rollout.max_episode_tokens={episode} is less than one turn's "
                      f"rollout.max_new_tokens={r.max_new_tokens}; raise it to at least "
                      f"{r.max_new_tokens} (or 0: the same)")
  if not r.env:
    readers = [n.get("id") for n in (cfg.dag or []) if hasattr(n, "get")
               and n.get("fn") == "reward.env"]
    if readers:
      raise ConfigError(f"DAG node {readers[0]!r} (reward.env) reads the environment's rewards "
                        f"of multi-turn episodes, but rollout.env is not set; set it to an "
                        f"environment or use another reward")
    return
  env_base.env_factory(r.env)  # resolves the name / imports module:Class, or one line
  nodes = [n for n in (cfg.dag or []) if hasattr(n, "get")]
  if not any(n.get("fn") == "reward.env" for n in nodes):
    gen = next((n.get("id") for n in nodes if n.get("fn") == "generate"), "generate")
    raise ConfigError(
        f"rollout.env={r.env!r} plays episodes, but no DAG node reads the environment's "
        f"rewards (reward.env), so they would be dropped; use --config=grpo:tiny_env, or add "
        f"dict(id='env_reward', fn='reward.env', deps=[{gen!r}]) to the DAG beside or "
        f"instead of the other reward (configs/grpo.py:calc)")
  width = "rollout.max_episode_tokens" if episode else "rollout.max_new_tokens"
  context = longest_sample(cfg)
  # The engine backend appends each turn to its slot's cache (rollout/episode_engine.py,
  # whose cache the episode width sizes); the round backends re-prefill every turn.
  if r.backend != "engine" and max(r.prefill_buckets) < context:
    raise ConfigError(
        f"rollout.env={r.env!r} with rollout.backend={r.backend!r}: each turn re-prefills "
        f"the prompt and the episode so far, up to data.max_prompt_len + {width} - 1 = "
        f"{context} tokens, but the largest of rollout.prefill_buckets="
        f"{list(r.prefill_buckets)} is smaller; add a bucket >= {context}, or use "
        f"rollout.backend=engine (it appends each turn to its cache instead)")
  if cfg.data.image_key:
    raise ConfigError(f"rollout.env={r.env!r} does not take images yet; unset data.image_key "
                      f"or rollout.env")
