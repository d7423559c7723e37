"""What a rollout section fixes for the training passes: the response width (the tokens
after the prompt in a training row) and the temperature the passes read the policy at.
Plain reads of the config (importing this module does not import jax).
"""

from __future__ import annotations

import ml_collections


def response_width(rollout: ml_collections.ConfigDict) -> int:
  """Tokens after the prompt in a training row (the passes' response width, the engine's
  cache beyond the longest prompt bucket): ``rollout.max_episode_tokens`` for multi-turn
  episodes (``rollout.env``) when set, else ``rollout.max_new_tokens``."""
  episode = int(rollout.max_episode_tokens or 0)
  return episode if rollout.env and episode else int(rollout.max_new_tokens)


def pass_temperature(rollout_temperature: float) -> float:
  """The temperature the training passes read the policy at, for a rollout sampling at
  ``rollout_temperature``: the same (config/temperature.py), 1 for greedy (0)."""
  t = float(rollout_temperature)
  return t if t > 0 else 1.0


def response_width_key(rollout: ml_collections.ConfigDict) -> str:
  """The key ``response_width`` reads (for messages)."""
  episode = rollout.env and rollout.max_episode_tokens
  return "rollout.max_episode_tokens" if episode else "rollout.max_new_tokens"


def row_tokens(cfg: ml_collections.ConfigDict) -> int:
  """A padded training row's tokens: the longest prompt plus the response width."""
  return int(cfg.data.max_prompt_len) + response_width(cfg.rollout)


def longest_sample(cfg: ml_collections.ConfigDict) -> int:
  """The tokens a pass feeds for the longest sample (its last token is only a target): what a
  packed row, a token budget or an episode's context must hold."""
  return row_tokens(cfg) - 1
