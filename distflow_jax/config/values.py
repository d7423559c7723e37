"""Value checks of a config's sections: ranges, finiteness and option names.

``check_values(cfg)`` runs on the global config and, through
``checks.plan_from_config``, on every DAG node's effective config (the global
one with the node's ``config=dict(...)`` overrides applied).  Each failure is
one ``ConfigError`` line naming the key, the bad value and what is valid; the
checks of one value (a range, an option name) are ``config.validators``'.
"""

from __future__ import annotations

import math

from distflow_jax.config import lora_checks, response, vision_checks
from distflow_jax.config.loading import ConfigError
from distflow_jax.config.validators import in_range, option, positive
from distflow_jax.observe import wandb_log
from distflow_jax.rewards import math_answer
from distflow_jax.tasks import registry as tasks

# Largest learning rate accepted: a step above 1 makes any of the optimizers in
# train.optim.OPTIMIZERS diverge on a transformer (adam's update is ~lr per weight).
MAX_LR = 1.0


def check_values(cfg) -> None:
  """Every value check of ``cfg`` that needs no cluster; raises the first failure."""
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
    section = cfg[role]
    positive(section.micro_batch_size, f"{role}.micro_batch_size")
    positive(section.ppo_epochs, f"{role}.ppo_epochs")
    check_optimizer(section.optimizer, f"{role}.optimizer")
  in_range(cfg.critic.value_clip, "critic.value_clip", 0)
  positive(cfg.critic.warmup_steps, "critic.warmup_steps", allow_zero=True,
           note=" (0 = the actor trains from the first step)")
  if cfg.critic.warmup_steps >= cfg.trainer.total_steps > 0:
    raise ConfigError(f"critic.warmup_steps={cfg.critic.warmup_steps} leaves no step for the "
                      f"actor (trainer.total_steps={cfg.trainer.total_steps})")
  _check_reward(cfg.reward)
  _check_algo(cfg.algo)
  _check_trainer(cfg.trainer)
  if "logging" in cfg:
    wandb_log.check(cfg)
    in_range(cfg.logging.get("heartbeat_s", 0.0), "logging.heartbeat_s", 0,
             note=" (seconds between the lines of a long phase; 0 = off)")
  if "sft" in cfg:
    _check_sft(cfg.sft)


def _check_rollout(r) -> None:
  positive(r.n, "rollout.n")
  positive(r.max_new_tokens, "rollout.max_new_tokens")
  positive(r.max_concurrent_decodes, "rollout.max_concurrent_decodes")
  positive(r.decode_chunk, "rollout.decode_chunk")
  positive(r.tensor_parallel, "rollout.tensor_parallel")
  in_range(r.temperature, "rollout.temperature", 0, note=" (0 = greedy)")
  in_range(r.top_p, "rollout.top_p", 0, 1, lo_open=True)
  positive(r.top_k, "rollout.top_k", allow_zero=True)
  option(r.get("backend", "engine"), "rollout.backend", "backend")
  option(r.get("lora_sync", "merged"), "rollout.lora_sync", "lora_sync")
  option(r.get("fuse_projections", "none"), "rollout.fuse_projections", "fuse_projections")
  option(r.get("cpu_compute", "float32"), "rollout.cpu_compute", "cpu_compute")
  buckets = list(r.prefill_buckets)
  if not buckets or buckets != sorted(set(buckets)) or buckets[0] <= 0:
    raise ConfigError(f"rollout.prefill_buckets={buckets} must be positive and strictly "
                      f"increasing")


def _check_data(d) -> None:
  positive(d.max_prompt_len, "data.max_prompt_len")
  positive(d.prompts_per_step, "data.prompts_per_step")
  positive(d.eval_size, "data.eval_size")
  option(d.on_bad_row, "data.on_bad_row", "on_bad_row")
  option(d.redistribute, "data.redistribute", "redistribute")
  positive(d.get("max_image_pixels", 1), "data.max_image_pixels")
  for split in ("train", "eval"):
    spec = d[split]
    if isinstance(spec, str) and tasks.is_builtin(spec):
      try:
        tasks.parse(spec)
      except tasks.UnknownTaskError as e:
        raise ConfigError(f"data.{split}={spec!r}: {e}") from None
  if not isinstance(d.get("image_root", ""), str):
    raise ConfigError(f"data.image_root={d.image_root!r} must be a folder path ('' = the data "
                      f"file's folder)")


def _check_model(m) -> None:
  option(m.dtype, "model.dtype", "dtype")
  if not m.path:  # the built-in architecture is used
    option(m.preset, "model.preset", "preset")
  option(m.remat, "model.remat", "remat")
  option(m.attention_impl, "model.attention_impl", "attention_impl")
  block = m.get("attention_block", 512)
  if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
    raise ConfigError(f"model.attention_block={block!r} must be a positive whole number of "
                      f"tokens (blockwise attention's query and key block)")
  if not isinstance(m.scan_layers, bool) or not isinstance(m.master_weights, bool):
    raise ConfigError(f"model.scan_layers={m.scan_layers!r} and model.master_weights="
                      f"{m.master_weights!r} must be true or false")
  positive(m.max_seq_len, "model.max_seq_len")
  if not isinstance(m.get("pack_sequences", False), bool):
    raise ConfigError(f"model.pack_sequences={m.pack_sequences!r} must be true or false")
  positive(m.get("pack_len", 0), "model.pack_len", allow_zero=True)
  w = m.warmstart
  positive(w.steps, "model.warmstart.steps", allow_zero=True)
  check_lr(w.lr, "model.warmstart.lr", "adamw")
  positive(w.batch_size, "model.warmstart.batch_size")
  positive(w.examples, "model.warmstart.examples")
  in_range(w.plain_answer_prob, "model.warmstart.plain_answer_prob", 0, 1)


def _check_token_budget(cfg) -> None:
  """<role>.micro_batch_tokens: token-budget micro-batches are made of packed rows, so they
  need model.pack_sequences and exclude what packing excludes."""
  for role in ("actor", "critic"):
    key = f"{role}.micro_batch_tokens"
    budget = cfg[role].get("micro_batch_tokens", 0)
    if isinstance(budget, bool) or not isinstance(budget, int):
      raise ConfigError(f"{key}={budget!r} must be a whole number of tokens (0 = off)")
    positive(budget, key, allow_zero=True, note=" (0 = micro-batches of micro_batch_size rows)")
    if not budget:
      continue
    if not cfg.model.get("pack_sequences", False):
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
  if not m.get("pack_sequences", False):
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
  option(a.loss_agg, "actor.loss_agg", "loss_agg")
  option(a.ratio_level, "actor.ratio_level", "ratio_level")
  option(a.kl.estimator, "actor.kl.estimator", "kl_estimator")
  option(a.off_policy.correction, "actor.off_policy.correction", "off_policy")
  in_range(a.off_policy.tis_cap, "actor.off_policy.tis_cap", 0, lo_open=True)
  try:
    from distflow_jax.algos.off_policy import check_bounds
    check_bounds(a.off_policy.reject_low, a.off_policy.reject_high)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  in_range(a.clip_ratio_low, "actor.clip_ratio_low", 0); in_range(a.kl.k3_cap, "actor.kl.k3_cap", 0)
  in_range(a.clip_ratio_high, "actor.clip_ratio_high", 0)
  in_range(a.entropy_coef, "actor.entropy_coef")
  in_range(a.kl.coef, "actor.kl.coef", 0)
  in_range(a.kl.target, "actor.kl.target", 0, note=" (0 = a fixed coefficient)")
  positive(a.kl.horizon, "actor.kl.horizon")
  if a.kl.target > 0 and not a.kl.in_reward:
    raise ConfigError("actor.kl.target > 0 (adaptive KL) needs actor.kl.in_reward=True: the "
                      "coefficient of a KL loss term is fixed at compile time")
  if a.dual_clip and not (math.isfinite(a.dual_clip) and a.dual_clip > 1.0):
    raise ConfigError(f"actor.dual_clip={a.dual_clip} must be 0 (off) or > 1")
  positive(a.mini_batches, "actor.mini_batches")


def check_lr(lr, key: str, optimizer: str) -> None:
  """A finite learning rate in (0, MAX_LR]."""
  too_big = isinstance(lr, (int, float)) and math.isfinite(lr) and lr > MAX_LR
  in_range(lr, key, 0, MAX_LR, lo_open=True,
           note=f" (a step above {MAX_LR:g} diverges with {optimizer})" if too_big else "")


def check_optimizer(o, key: str) -> None:
  """A ``<role>.optimizer`` section (see ``defaults.optimizer``)."""
  option(o.name, f"{key}.name", "optimizer")
  option(o.schedule, f"{key}.schedule", "schedule")
  check_lr(o.lr, f"{key}.lr", o.name)
  in_range(o.weight_decay, f"{key}.weight_decay", 0)
  in_range(o.grad_clip, f"{key}.grad_clip", 0, note=" (0 = no clipping)")
  in_range(o.b1, f"{key}.b1", 0, 1, hi_open=True)
  in_range(o.b2, f"{key}.b2", 0, 1, hi_open=True)
  in_range(o.eps, f"{key}.eps", 0, lo_open=True)
  positive(o.warmup_steps, f"{key}.warmup_steps", allow_zero=True)


def _check_reward(r) -> None:
  big = 3.4028234663852886e38  # float32 max: rewards are float32, a larger value is inf there
  for name in ("weight", "correct", "wrong"):
    in_range(r[name], f"reward.{name}")
    if abs(r[name]) > big:
      raise ConfigError(f"reward.{name}={r[name]!r} is beyond float32's range (|x| <= "
                        f"{big:.4g}), which rewards are kept in")
  in_range(r.tolerance, "reward.tolerance", 0)
  option(r.match, "reward.match", "match")
  if r.match == "math_verify":
    if not math_answer.has_math_verify():
      raise ConfigError(math_answer.MATH_VERIFY_MISSING)


def _check_algo(a) -> None:
  in_range(a.gamma, "algo.gamma", 0, 1)
  in_range(a.lam, "algo.lam", 0, 1)
  positive(a.dynamic_sampling_tries, "algo.dynamic_sampling_tries", allow_zero=True,
           note=" (0 = off)")


def _check_trainer(t) -> None:
  positive(t.total_steps, "trainer.total_steps")
  positive(t.eval_every, "trainer.eval_every", allow_zero=True, note=" (0 = no evaluation)")
  if isinstance(t.log_samples, bool) or not isinstance(t.log_samples, int):
    raise ConfigError(f"trainer.log_samples={t.log_samples!r} must be an integer >= 0 "
                      f"(0 = no samples)")
  positive(t.log_samples, "trainer.log_samples", allow_zero=True, note=" (0 = no samples)")
  positive(t.save_every, "trainer.save_every", allow_zero=True,
           note=" (0 = a checkpoint only at the end)")
  positive(t.keep, "trainer.keep", allow_zero=True, note=" (0 = keep every checkpoint)")
  if "compile_cache_dir" in t and not isinstance(t.compile_cache_dir, str):
    raise ConfigError(f"trainer.compile_cache_dir={t.compile_cache_dir!r} must be a folder "
                      f"path (\"\" = no compile cache)")
  if "compile_ahead" in t:
    option(t.compile_ahead, "trainer.compile_ahead", "compile_ahead")
  if "max_staleness" in t:
    positive(t.max_staleness, "trainer.max_staleness", allow_zero=True,
             note=" (0 = the synchronous loop)")


def _check_sft(s) -> None:
  positive(s.steps, "sft.steps")
  check_lr(s.lr, "sft.lr", "adamw")
  positive(s.batch_size, "sft.batch_size")
  positive(s.warmup_steps, "sft.warmup_steps", allow_zero=True, note=" (0 = no warm-up)")
  if s.warmup_steps and s.warmup_steps >= s.steps:
    raise ConfigError(f"sft.warmup_steps={s.warmup_steps} must be below sft.steps={s.steps}")
  in_range(s.weight_decay, "sft.weight_decay", 0)
  in_range(s.grad_clip, "sft.grad_clip", 0, note=" (0 = no clipping)")
  positive(s.eval_every, "sft.eval_every", allow_zero=True, note=" (0 = no evaluation)")
  positive(s.eval_size, "sft.eval_size", allow_zero=True, note=" (0 = no held-out rows)")
  positive(s.save_every, "sft.save_every", allow_zero=True,
           note=" (0 = a checkpoint only at the end)")
  positive(s.keep, "sft.keep", allow_zero=True, note=" (0 = keep every checkpoint)")
