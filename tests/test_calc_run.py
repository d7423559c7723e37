"""The shipped ``grpo:calc`` config end to end at smoke size (episodes with the built-in
calculator, the environment's reward), and the periodic evaluation playing episodes when
``rollout.env`` is set (scoring the model's own tokens, never the observations)."""

import math

import pytest

from distflow_jax.config import loading
from distflow_jax.run import evaluate as eval_lib, trainer
from workflow_util import smoke_overrides

pytestmark = pytest.mark.timeout(600)


def _cfg(tmp_path, name, *extra):
  return loading.load(name, smoke_overrides(
      tmp_path, "data.prompts_per_step=8", "rollout.n=2", "actor.micro_batch_size=2",
      "trainer.total_steps=2", "trainer.eval_every=1", "rollout.prefill_buckets=(40,48)",
      "model.max_seq_len=48", *extra))


def test_shipped_calc_config_trains_on_episodes_and_evaluates_episodes(tmp_path):
  cfg = _cfg(tmp_path, "grpo:calc")
  assert cfg.rollout.env == "calc" and cfg.data.train == "builtin:calc:basic"
  assert [n["fn"] for n in cfg.dag].count("reward.env") == 1
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  rows = list(trainer.train(ctx, loaders))
  steps = [m for m in rows if "actor/loss" in m]
  evals = [m for m in rows if "eval/accuracy" in m]
  assert len(steps) == 2 and len(evals) == 3  # before step 1, after steps 1 and 2
  for m in steps:
    for key in ("env/turns_mean", "env/errors", "reward", "actor/loss"):
      assert key in m and math.isfinite(m[key]), (key, m)
    assert m["env/errors"] == 0.0
  for m in evals:  # the periodic evaluation played episodes
    for key in ("eval/accuracy", "eval/turns_mean", "eval/env_reward"):
      assert key in m and math.isfinite(m[key]), (key, m)
    assert m["eval/turns_mean"] >= 1.0


def test_the_baseline_config_is_the_same_run_without_the_tool():
  tool, plain = loading.load("grpo:calc", []), loading.load("grpo:calc_notool", [])
  assert plain.rollout.env == "" and "reward.math" in [n["fn"] for n in plain.dag]
  a, b = tool.to_dict(), plain.to_dict()
  differ = {k for k in a if a[k] != b[k]}
  assert differ == {"name", "run_dir", "rollout", "dag"}, differ
  ra, rb = a["rollout"], b["rollout"]
  assert {k for k in ra if ra[k] != rb[k]} == {"env"}


def test_eval_scores_the_models_tokens_not_the_observations(tmp_path):
  """An environment that shows the answer in its first observation: the single-turn
  scoring of the whole response would credit it; episodes' evaluation must not."""
  cfg = _cfg(tmp_path, "grpo:calc", "rollout.env=leaky", "rollout.max_new_tokens=24",
             "rollout.prefill_buckets=(40,64)", "model.max_seq_len=64")
  with cfg.unlocked():
    cfg.plugins = ("plugin_envs",)
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  kept = []
  m = eval_lib.evaluate(ctx, next(iter(loaders.eval)), samples=kept, num_samples=8)
  assert m["eval/turns_mean"] >= 1.0 and m["eval/accuracy"] == 0.0, m
  # The samples show the whole episode, the observation with the answer included.
  assert kept and all(r["answer"] in r["response"] for r in kept), kept


def test_the_scored_text_puts_each_turn_on_its_own_line():
  """The final turn's "#### N" is the scored text's last line (the format check reads it)."""
  import numpy as np
  from distflow_jax.models.tokenizer import Tokenizer
  from distflow_jax.rewards import math_answer
  tok = Tokenizer.builtin()
  call, obs, answer = "<tool>calc(1 * 2)</tool>", " = 2\n", "#### 2"
  ids = np.array(tok.encode(call + obs + answer) + [tok.pad_id] * 3)
  own = np.zeros(len(ids), bool)
  own[:len(call)] = own[len(call + obs):len(call + obs + answer)] = True
  text = eval_lib._own_text(tok, ids, own)  # pylint: disable=protected-access
  assert text == call + "\n" + answer and math_answer.format_reward(text) == 1.0
  assert eval_lib._own_text(tok, ids, np.zeros(len(ids), bool)) == ""  # pylint: disable=protected-access


def test_eval_episodes_take_the_episode_width_not_one_turns(tmp_path):
  """With rollout.max_episode_tokens set, an evaluated episode (the first observation, then
  the model's turn) may run past one turn's rollout.max_new_tokens, as a trained one does;
  it was cut at max_new_tokens."""
  cfg = _cfg(tmp_path, "grpo:calc", "rollout.env=scripted", "rollout.max_new_tokens=8",
             "rollout.max_episode_tokens=40", "rollout.max_turns=4",
             "rollout.prefill_buckets=(40,80)", "model.max_seq_len=128")
  with cfg.unlocked():
    cfg.plugins = ("plugin_envs",)
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  m = eval_lib.evaluate(ctx, next(iter(loaders.eval)))
  assert 8 < m["eval/response_length"] <= 40, m
