"""Value checks of a config's sections: ranges, finiteness and option names.

``check_values(cfg)`` runs on the global config and, through
``checks.plan_from_config``, on every DAG node's effective config (the global
one with the node's ``config=dict(...)`` overrides applied).  Each failure is
one ``ConfigError`` line naming the key, the bad value and what is valid; the
checks of one value (a range, an option name) are ``config.validators``'.
"""

from __future__ import annotations

import math

from distflow_jax.config import declare, lora_checks, response, vision_checks
from distflow_jax.config.errors import ConfigError
from distflow_jax.config.run_sections import Config
from distflow_jax.config.validators import in_range, option, positive
from distflow_jax.observe import wandb_log
from distflow_jax.rewards import math_answer
from distflow_jax.tasks import registry as tasks

# Largest learning rate accepted: a step above 1 makes any of the optimizers in
# train.optim.OPTIMIZERS diverge on a transformer (adam's update is ~lr per weight).
MAX_LR = 1.0


def check_values(cfg) -> None:
  """Every value check of ``cfg`` that needs no cluster; raises the first failure: each
  key's own check (declared beside it, config/sections.py), then those of several keys."""
  declare.check_fields(Config, cfg)
  _check_rollout(cfg.rollout)
  _check_data(cfg.data)
  vision_checks.check_images(cfg)  # which combinations take images
  _check_model(cfg.model)
  lora_checks.check(cfg)
  r, d = cfg.rollout, cfg.data
  buckets = list(r.prefill_buckets)
  if buckets[-1] < d.max_prompt_len:
    raise ConfigError(f"rollout.prefill_buckets={buckets}: the largest bucket is smaller "
                      f"than data.max_prompt_len={d.max_prompt_len}")
  total = d.max_prompt_len + response.response_width(r)
  if total > cfg.model.max_seq_len:
    raise ConfigError(f"data.max_prompt_len + {response.response_width_key(r)} = {total} exceeds "
                      f"model.max_seq_len={cfg.model.max_seq_len}")
  _check_token_budget(cfg)
  _check_packing(cfg)
  _check_actor(cfg.actor)
  for role in ("actor", "critic"):
    check_optimizer(cfg[role].optimizer, f"{role}.optimizer")
  if cfg.critic.warmup_steps >= cfg.trainer.total_steps > 0:
    raise ConfigError(f"critic.warmup_steps={cfg.critic.warmup_steps} leaves no step for the "
                      f"actor (trainer.total_steps={cfg.trainer.total_steps})")
  _check_reward(cfg.reward)
  _check_trainer(cfg.trainer)
  wandb_log.check(cfg)
  _check_sft(cfg.sft)


def _check_rollout(r) -> None:
  buckets = list(r.prefill_buckets)
  if not buckets or buckets != sorted(set(buckets)) or buckets[0] <= 0:
    raise ConfigError(f"rollout.prefill_buckets={buckets} must be positive and strictly "
                      f"increasing")


def _check_data(d) -> None:
  for split in ("train", "eval"):
    spec = d[split]
    if isinstance(spec, str) and tasks.is_builtin(spec):
      try:
        tasks.parse(spec)
      except tasks.UnknownTaskError as e:
        raise ConfigError(f"data.{split}={spec!r}: {e}") from None
  if not isinstance(d.image_root, str):
    raise ConfigError(f"data.image_root={d.image_root!r} must be a folder path ('' = the data "
                      f"file's folder)")


def _check_model(m) -> None:
  if not m.path:  # the built-in architecture is used
    option(m.preset, "model.preset", "preset")
  block = m.attention_block
  if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
    raise ConfigError(f"model.attention_block={block!r} must be a positive whole number of "
                      f"tokens (blockwise attention's query and key block)")
  if not isinstance(m.scan_layers, bool) or not isinstance(m.master_weights, bool):
    raise ConfigError(f"model.scan_layers={m.scan_layers!r} and model.master_weights="
                      f"{m.master_weights!r} must be true or false")
  if not isinstance(m.pack_sequences, bool):
    raise ConfigError(f"model.pack_sequences={m.pack_sequences!r} must be true or false")
  w = m.warmstart
  check_lr(w.lr, "model.warmstart.lr", "adamw")


def _check_token_budget(cfg) -> None:
  """<role>.micro_batch_tokens: token-budget micro-batches are made of packed rows, so they
  need model.pack_sequences and exclude what packing excludes."""
  for role in ("actor", "critic"):
    key = f"{role}.micro_batch_tokens"
    budget = cfg[role].micro_batch_tokens
    if isinstance(budget, bool) or not isinstance(budget, int):
      raise ConfigError(f"{key}={budget!r} must be a whole number of tokens (0 = off)")
    positive(budget, key, allow_zero=True, note=" (0 = micro-batches of micro_batch_size rows)")
    if not budget:
      continue
    if not cfg.model.pack_sequences:
      raise ConfigError(f"{key}={budget} needs model.pack_sequences=True (a token budget fills "
                        f"packed rows); set it, or {key}=0")
    if cfg.trainer.deterministic:
      raise ConfigError(f"{key}={budget} does not work with trainer.deterministic=True (its "
                        f"sums run over fixed units of {role}.micro_batch_size rows); set "
                        f"{key}=0")


def _check_packing(cfg) -> None:
  """model.pack_sequences: the deterministic mode does not pack (yet); shared prompts do
  (train/packing_shared.py)."""
  m = cfg.model
  if not m.pack_sequences:
    return
  if cfg.trainer.deterministic:
    raise ConfigError("model.pack_sequences=True does not work with trainer.deterministic="
                      "True (its passes run unit by unit, padded); turn one of them off")
  total = cfg.data.max_prompt_len + response.response_width(cfg.rollout)
  if m.pack_len and m.pack_len < total - 1:
    raise ConfigError(f"model.pack_len={m.pack_len} is shorter than the longest sample, "
                      f"data.max_prompt_len + {response.response_width_key(cfg.rollout)} - 1 "
                      f"= {total - 1}; raise "
                      f"it or set model.pack_len=0 (the padded row's length)")


def _check_actor(a) -> None:
  try:
    from distflow_jax.algos.off_policy import check_bounds
    check_bounds(a.off_policy.reject_low, a.off_policy.reject_high)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if a.kl.target > 0 and not a.kl.in_reward:
    raise ConfigError("actor.kl.target > 0 (adaptive KL) needs actor.kl.in_reward=True: the "
                      "coefficient of a KL loss term is fixed at compile time")
  if a.dual_clip and not (math.isfinite(a.dual_clip) and a.dual_clip > 1.0):
    raise ConfigError(f"actor.dual_clip={a.dual_clip} must be 0 (off) or > 1")


def check_lr(lr, key: str, optimizer: str) -> None:
  """A finite learning rate in (0, MAX_LR]."""
  too_big = isinstance(lr, (int, float)) and math.isfinite(lr) and lr > MAX_LR
  in_range(lr, key, 0, MAX_LR, lo_open=True,
           note=f" (a step above {MAX_LR:g} diverges with {optimizer})" if too_big else "")


def check_optimizer(o, key: str) -> None:
  """A ``<role>.optimizer`` section (see ``defaults.optimizer``)."""
  check_lr(o.lr, f"{key}.lr", o.name)


def _check_reward(r) -> None:
  big = 3.4028234663852886e38  # float32 max: rewards are float32, a larger value is inf there
  for name in ("weight", "correct", "wrong"):
    in_range(r[name], f"reward.{name}")
    if abs(r[name]) > big:
      raise ConfigError(f"reward.{name}={r[name]!r} is beyond float32's range (|x| <= "
                        f"{big:.4g}), which rewards are kept in")
  if r.match == "math_verify":
    if not math_answer.has_math_verify():
      raise ConfigError(math_answer.MATH_VERIFY_MISSING)


def _check_trainer(t) -> None:
  if isinstance(t.log_samples, bool) or not isinstance(t.log_samples, int):
    raise ConfigError(f"trainer.log_samples={t.log_samples!r} must be an integer >= 0 "
                      f"(0 = no samples)")
  positive(t.log_samples, "trainer.log_samples", allow_zero=True, note=" (0 = no samples)")
  if "compile_cache_dir" in t and not isinstance(t.compile_cache_dir, str):
    raise ConfigError(f"trainer.compile_cache_dir={t.compile_cache_dir!r} must be a folder "
                      f"path (\"\" = no compile cache)")


def _check_sft(s) -> None:
  check_lr(s.lr, "sft.lr", "adamw")
  if s.warmup_steps and s.warmup_steps >= s.steps:
    raise ConfigError(f"sft.warmup_steps={s.warmup_steps} must be below sft.steps={s.steps}")
