"""Value checks of a config that need no cluster: each key's own check, then the refusals
that span keys, in one table.

``check_values(cfg)`` runs on the global config and, through
``checks.plan_from_config``, on every DAG node's effective config (the global
one with the node's ``config=dict(...)`` overrides applied).  Each failure is
one ``ConfigError`` line naming the keys, the bad values and what to change.  The checks
of one key are declared beside it (config/sections.py, run_sections.py); a refusal over
several keys is a ``Spanning`` row of ``SPANNING`` here, or (where a module owns the
combination: images, LoRA, wandb, off-policy bounds) that module's check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from distflow_jax.config import declare, lora_checks, response, vision_checks
from distflow_jax.config.errors import ConfigError
from distflow_jax.config.run_sections import Config
from distflow_jax.config.validators import check_lr, option
from distflow_jax.observe import wandb_log
from distflow_jax.rewards import math_answer


@dataclasses.dataclass(frozen=True)
class Spanning:
  """A refusal over several keys: ``refuses(cfg)`` true means ``message(cfg)`` is raised."""
  keys: tuple[str, ...]
  refuses: Callable[[Any], bool]
  message: Callable[[Any], str]


def _budget_rows(role: str) -> tuple[Spanning, ...]:
  key = f"{role}.micro_batch_tokens"
  return (
      Spanning((key, "model.pack_sequences"),
               lambda c: c[role].micro_batch_tokens > 0 and not c.model.pack_sequences,
               lambda c: f"{key}={c[role].micro_batch_tokens} needs model.pack_sequences=True "
                         f"(a token budget fills packed rows); set it, or {key}=0"),
      Spanning((key, "trainer.deterministic"),
               lambda c: c[role].micro_batch_tokens > 0 and c.trainer.deterministic,
               lambda c: f"{key}={c[role].micro_batch_tokens} does not work with "
                         f"trainer.deterministic=True (its sums run over fixed units of "
                         f"{role}.micro_batch_size rows); set {key}=0"),
  )


SPANNING: tuple[Spanning, ...] = (
    Spanning(("rollout.prefill_buckets", "data.max_prompt_len"),
             lambda c: c.rollout.prefill_buckets[-1] < c.data.max_prompt_len,
             lambda c: f"rollout.prefill_buckets={list(c.rollout.prefill_buckets)}: the largest "
                       f"bucket is smaller than data.max_prompt_len={c.data.max_prompt_len}"),
    Spanning(("data.max_prompt_len", "rollout.max_new_tokens", "rollout.max_episode_tokens",
              "model.max_seq_len"),
             lambda c: response.row_tokens(c) > c.model.max_seq_len,
             lambda c: f"data.max_prompt_len + {response.response_width_key(c.rollout)} = "
                       f"{response.row_tokens(c)} exceeds model.max_seq_len={c.model.max_seq_len}"),
    *_budget_rows("actor"),
    *_budget_rows("critic"),
    Spanning(("model.pack_sequences", "trainer.deterministic"),
             lambda c: c.model.pack_sequences and c.trainer.deterministic,
             lambda c: "model.pack_sequences=True does not work with trainer.deterministic="
                       "True (its passes run unit by unit, padded); turn one of them off"),
    Spanning(("model.pack_len", "data.max_prompt_len", "rollout.max_new_tokens"),
             lambda c: (c.model.pack_sequences
                        and 0 < c.model.pack_len < response.longest_sample(c)),
             lambda c: f"model.pack_len={c.model.pack_len} is shorter than the longest "
                       f"sample, data.max_prompt_len + "
                       f"{response.response_width_key(c.rollout)} - 1 = "
                       f"{response.longest_sample(c)}; raise it or set model.pack_len=0 (the "
                       f"padded row's length)"),
    Spanning(("actor.kl.target", "actor.kl.in_reward"),
             lambda c: c.actor.kl.target > 0 and not c.actor.kl.in_reward,
             lambda c: "actor.kl.target > 0 (adaptive KL) needs actor.kl.in_reward=True: the "
                       "coefficient of a KL loss term is fixed at compile time"),
    Spanning(("critic.warmup_steps", "trainer.total_steps"),
             lambda c: c.critic.warmup_steps >= c.trainer.total_steps > 0,
             lambda c: f"critic.warmup_steps={c.critic.warmup_steps} leaves no step for the "
                       f"actor (trainer.total_steps={c.trainer.total_steps})"),
    Spanning(("sft.warmup_steps", "sft.steps"),
             lambda c: 0 < c.sft.warmup_steps >= c.sft.steps,
             lambda c: f"sft.warmup_steps={c.sft.warmup_steps} must be below "
                       f"sft.steps={c.sft.steps}"),
    Spanning(("model.path", "model.preset"),
             lambda c: not c.model.path and not _valid_option(c.model.preset, "preset"),
             lambda c: _option_message(c.model.preset, "model.preset", "preset")),
    Spanning(("actor.optimizer.name", "actor.optimizer.lr"),
             lambda c: _lr_message(c.actor.optimizer, "actor.optimizer") is not None,
             lambda c: _lr_message(c.actor.optimizer, "actor.optimizer")),
    Spanning(("critic.optimizer.name", "critic.optimizer.lr"),
             lambda c: _lr_message(c.critic.optimizer, "critic.optimizer") is not None,
             lambda c: _lr_message(c.critic.optimizer, "critic.optimizer")),
)


def check_values(cfg) -> None:
  """Every value check of ``cfg`` that needs no cluster; raises the first failure: each
  key's own check, the modules' checks of their combinations, then ``SPANNING``."""
  declare.check_fields(Config, cfg)
  vision_checks.check_images(cfg)  # which combinations take images
  lora_checks.check(cfg)
  _check_off_policy_bounds(cfg.actor.off_policy)
  if cfg.reward.match == "math_verify" and not math_answer.has_math_verify():
    raise ConfigError(math_answer.MATH_VERIFY_MISSING)
  wandb_log.check(cfg)
  for rule in SPANNING:
    if rule.refuses(cfg):
      raise ConfigError(rule.message(cfg))


def _check_off_policy_bounds(o) -> None:
  from distflow_jax.algos.off_policy import check_bounds  # keeps jax out of config loading
  try:
    check_bounds(o.reject_low, o.reject_high)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def _valid_option(value, name: str) -> bool:
  return _option_message(value, "", name) is None


def _option_message(value, key: str, name: str) -> str | None:
  try:
    option(value, key, name)
  except ConfigError as e:
    return str(e)
  return None


def _lr_message(o, key: str) -> str | None:
  """What is wrong with a ``<role>.optimizer`` section's learning rate (its note names the
  optimizer), else None."""
  try:
    check_lr(o.lr, f"{key}.lr", o.name)
  except ConfigError as e:
    return str(e)
  return None
