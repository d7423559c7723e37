"""A GRPO step on multi-turn episodes (rollout.env) through the trainer: the scripted
environment's observation tokens are in the responses and out of the loss."""

import math

import numpy as np

import pytest

from distflow_jax.config import loading
from distflow_jax.run import trainer
from workflow_util import smoke_overrides

pytestmark = pytest.mark.timeout(600)


def _cfg(tmp_path, *extra, name="grpo:tiny"):
  cfg = loading.load(name, smoke_overrides(
      tmp_path, "cluster.devices_per_process=8", "data.prompts_per_step=8", "rollout.n=2",
      "actor.micro_batch_size=1", "trainer.total_steps=1", "rollout.env=scripted",
      "rollout.max_new_tokens=16", "model.max_seq_len=64", *extra))
  with cfg.unlocked():
    cfg.rollout.prefill_buckets = (40, 56)
    cfg.plugins = ("plugin_envs",)
    # the environment's reward, not the math verifier's
    cfg.dag = [dict(d, fn="reward.env") if d["fn"] == "reward.math" else dict(d)
               for d in cfg.dag]
  return cfg


def test_grpo_step_on_episodes_trains_generated_tokens_only(tmp_path):
  cfg = _cfg(tmp_path)
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  (m,) = list(trainer.train(ctx, loaders))
  for key in ("env/turns_mean", "env/errors", "env/truncated", "actor/loss", "reward"):
    assert key in m and math.isfinite(m[key]), (key, m)
  assert m["actor/skipped"] == 0.0 and m["env/errors"] == 0.0 and m["env/turns_mean"] >= 1
  samples = 8 * 2
  # Every episode starts with reset's observation (" obs0 "): at least one token per
  # sample is in the responses (response_length) but not among the trained tokens.
  assert m["actor/token_count"] <= m["response_length"] * samples - samples, m
  assert m["actor/token_count"] > 0


def test_ppo_step_on_episodes_with_a_critic(tmp_path):
  """GAE over episodes: per-turn rewards (placed_rewards) and the loss mask reach the
  critic's advantages and both train steps."""
  cfg = _cfg(tmp_path, "critic.micro_batch_size=1", name="ppo:tiny")
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  (m,) = list(trainer.train(ctx, loaders))
  for key in ("env/turns_mean", "actor/loss", "critic/loss"):
    assert key in m and math.isfinite(m[key]), (key, m)
  samples = 8 * 2
  assert m["critic/token_count"] <= m["response_length"] * samples - samples, m


def test_max_episode_tokens_is_the_response_width_and_max_new_tokens_each_turns(
    tmp_path, monkeypatch):
  """rollout.max_episode_tokens bounds an episode's response (the width the training
  passes read); rollout.max_new_tokens bounds each of its turns."""
  from distflow_jax.rollout import episodes
  seen = []
  run = episodes.run_episodes
  monkeypatch.setattr(episodes, "run_episodes",
                      lambda *a, **k: seen.append(run(*a, **k)) or seen[-1])
  cfg = _cfg(tmp_path, "rollout.max_new_tokens=6", "rollout.max_episode_tokens=16")
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  (m,) = list(trainer.train(ctx, loaders))
  (ep,) = seen
  ro, gen = ep.rollout, ep.loss_mask_RxN
  assert ro.tokens_RxN.shape[1] == 16 and m["actor/skipped"] == 0.0
  assert ro.lengths_R.max() > 6, ro.lengths_R  # an episode longer than one turn's cap
  for r in range(len(gen)):  # each turn (a run of generated tokens) at most 6 tokens
    runs = np.diff(np.flatnonzero(np.diff(np.r_[0, gen[r].astype(int), 0])))[::2]
    assert runs.size and runs.max() <= 6, gen[r]
  assert math.isfinite(m["env/truncated"]) and m["response_length"] <= 16


def test_reset_gets_the_rows_own_fields(tmp_path):
  """reset(row) sees the data row's own columns (per-row metadata), not only prompt and
  answer: a JSONL with a number, a nested dict and a list beside them."""
  import json

  import plugin_envs
  rows = [{"prompt": f"What is {i} + 2?", "answer": f"#### {i + 2}", "level": i % 3,
           "meta": {"id": f"q{i}", "tags": ["add", "small"]}} for i in range(16)]
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  from workflow_util import tiny_model_folder
  tiny_model_folder(tmp_path)
  cfg = _cfg(tmp_path, f"data.train={path}", "data.eval=", "trainer.eval_every=0",
             f"model.path={tmp_path / 'model'}")
  plugin_envs.Scripted.log.clear()
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  list(trainer.train(ctx, loaders))
  seen = [row for kind, row in plugin_envs.Scripted.log if kind == "reset"]
  assert len(seen) == 8 * 2
  by_prompt = {r["prompt"]: r for r in rows}
  for row in seen:
    want = by_prompt[row["prompt"]]
    assert row["level"] == want["level"] and row["meta"] == want["meta"], row
    assert row["answer"] == want["answer"] and "record" in row


def test_the_engine_plays_episodes_past_the_largest_prefill_bucket(tmp_path, monkeypatch):
  """The engine backend appends each turn to its slot's cache, so an episode's context may
  outgrow every prefill bucket (it was refused: "add a bucket >= 55"); the round backends,
  which re-prefill each turn, are still held to it."""
  from distflow_jax.config import env_checks
  from distflow_jax.rollout import episodes
  from distflow_jax.rollout.engine_backend import EngineBackend
  played = []
  real = episodes.CONTINUOUS[EngineBackend]
  monkeypatch.setitem(episodes.CONTINUOUS, EngineBackend,
                      lambda backend, params, eps, *a: real(backend, params, eps, *a)
                      or played.append(eps))
  cfg = _cfg(tmp_path, "rollout.max_new_tokens=8", "rollout.max_episode_tokens=24",
             "data.max_prompt_len=32")
  with cfg.unlocked():
    cfg.rollout.prefill_buckets = (32,)  # < data.max_prompt_len + 24 - 1 = 55
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  (m,) = list(trainer.train(ctx, loaders))
  assert played and m["actor/skipped"] == 0.0 and m["env/errors"] == 0.0
  longest = max(len(ep.context) for eps in played for ep in eps)
  assert longest > 32, longest  # an episode's context past the largest bucket (32)
  env_checks.check(cfg)  # (the plugin is imported now)
  with cfg.unlocked():
    cfg.rollout.backend = "reference"
  with pytest.raises(loading.ConfigError, match="re-prefills.*add a bucket >= 55"):
    env_checks.check(cfg)
