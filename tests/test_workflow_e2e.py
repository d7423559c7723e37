"""The whole RL workflow, end to end, on 8 simulated devices in one process."""

import json
import math

import jax
import numpy as np
import pytest

from distflow_jax.config import loading
from distflow_jax.dag.spec import DagError, Role
from distflow_jax.run import trainer
from workflow_util import smoke_overrides


def run(name, tmp_path, *extra, adjust=None):
  cfg = loading.load(name, smoke_overrides(tmp_path, "cluster.devices_per_process=8", *extra))
  if adjust is not None:
    with cfg.unlocked():
      adjust(cfg)
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  before = jax.tree.map(np.asarray, ctx.roles[Role.ACTOR].params)
  metrics = list(trainer.train(ctx, loaders))
  after = jax.tree.map(np.asarray, ctx.roles[Role.ACTOR].params)
  changed = any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                        jax.tree.leaves(after)))
  return cfg, ctx, metrics, changed


@pytest.fixture(scope="module")
def grpo_three_steps(tmp_path_factory):
  """Three GRPO steps (8 prompts x 2, micro-batches of 1) on plain prompts with prefill
  buckets (32, 40): the run of test_grpo_three_steps and of the prompt-width test."""
  tmp_path = tmp_path_factory.mktemp("grpo3")

  def buckets(cfg):
    cfg.rollout.prefill_buckets = (32, 40)
  cfg, ctx, metrics, changed = run("grpo:tiny", tmp_path, "data.prompts_per_step=8",
                                   "rollout.n=2", "actor.micro_batch_size=1",
                                   "data.chat_template=False", adjust=buckets)
  return tmp_path, metrics, changed


@pytest.mark.timeout(600)
def test_grpo_three_steps(grpo_three_steps):
  tmp_path, metrics, changed = grpo_three_steps
  assert [m["step"] for m in metrics] == [1, 2, 3]
  for m in metrics:
    for key in ("reward", "accuracy", "actor/loss", "actor/grad_norm", "response_length",
                "tokens_per_s", "time/generate", "time/train_actor", "actor/kl",
                "actor/entropy", "actor/pg_clipfrac"):
      assert key in m and math.isfinite(m[key]), (key, m)
    assert m["actor/skipped"] == 0.0
    assert m["tokens"] > 0
  assert changed
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2, 3]


def test_prompt_width_is_the_smallest_bucket_that_fits():
  from distflow_jax.nodes.rollout import prompt_width
  assert prompt_width(10, (16, 32, 64), 64) == 16
  assert prompt_width(16, (16, 32, 64), 64) == 16
  assert prompt_width(17, (16, 32, 64), 64) == 32
  assert prompt_width(40, (16, 32, 64), 48) == 48  # no bucket fits below max_prompt_len
  assert prompt_width(5, (64,), 48) == 48


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_short_prompts_are_not_padded_to_max_prompt_len(grpo_three_steps):
  _, metrics, _ = grpo_three_steps
  assert len(metrics) == 3
  for m in metrics:  # "What is 3 + 4 - 1?" prompts are < 32 characters
    assert m["prompt_width"] == 32 and m["prompt_length"] < 32
    assert math.isfinite(m["actor/loss"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ppo_three_steps_trains_actor_and_critic(tmp_path):
  cfg, ctx, metrics, changed = run("ppo:tiny", tmp_path, "data.prompts_per_step=16",
                                   "actor.micro_batch_size=1", "critic.micro_batch_size=1",
                                   "actor.kl.target=1.0", "actor.kl.horizon=100")
  assert changed
  # Adaptive KL: the observed KL is far below the target, so the coefficient shrinks
  # by the clipped factor 1 - 0.2 * (16 samples / horizon 100) each step.
  coefs = [m["kl_coef"] for m in metrics]
  assert coefs[0] == pytest.approx(0.001)
  assert coefs[1] == pytest.approx(0.001 * (1 - 0.2 * 16 / 100), rel=1e-5)
  assert coefs[2] < coefs[1]
  for m in metrics:
    assert math.isfinite(m["critic/loss"]) and math.isfinite(m["actor/loss"])
    assert "kl_penalty" in m  # PPO puts the KL in the reward
  assert ctx.plan.order == ["generate", "reward", "old_logprob", "ref_logprob", "values",
                            "advantage", "train_critic", "train_actor"]


@pytest.mark.timeout(600)
def test_config_only_two_reward_dag_trains(tmp_path):
  cfg, ctx, metrics, changed = run("reinforce_pp_two_rewards", tmp_path,
                                   "data.prompts_per_step=8", "rollout.n=2",
                                   "actor.micro_batch_size=1", "trainer.total_steps=1")
  assert changed
  m = metrics[-1]
  assert "reward/reward_math" in m and "reward/reward_format" in m
  # The advantage node saw the weighted sum of both reward nodes.
  assert m["reward"] == pytest.approx(m["reward/reward_math"] + 0.2 * m["reward/reward_format"],
                                      abs=1e-6)


@pytest.fixture(scope="module")
def repartitioned_mini_batches(tmp_path_factory):
  """One step of 16 prompts x 2 (32 rows), rollout replicas of 2 devices, 2 mini-batches
  of micro-batches of 2: the run of the re-partition and the mini-batch tests."""
  return run("grpo:tiny", tmp_path_factory.mktemp("repart"), "data.prompts_per_step=16",
             "rollout.n=2", "actor.micro_batch_size=2", "actor.mini_batches=2",
             "rollout.tensor_parallel=2", "trainer.total_steps=1",
             "actor.entropy_coef=0.01")  # a gradient even if all rewards tie


@pytest.mark.timeout(600)
def test_repartition_between_rollout_and_training_layouts(repartitioned_mini_batches):
  # Rollout replicas of 2 devices (dp 4) -> FSDP over 8 (dp 8): one all-to-all per step.
  cfg, ctx, metrics, changed = repartitioned_mini_batches
  assert ctx.plan.repartitions() == [("advantage", "old_logprob")]
  assert "time/move_to/old_logprob" in metrics[0]
  # The re-partition kept each prompt's 2 samples together, so the passes share prompts.
  assert metrics[0]["prompt_group/ref_logprob"] == 2.0
  assert metrics[0]["prompt_group/train_actor"] == 2.0
  assert changed


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_mini_batches_of_whole_groups(repartitioned_mini_batches):
  # 32 rows on 8 devices, 2 mini-batches: each shard's part of a mini-batch is one group.
  cfg, ctx, metrics, changed = repartitioned_mini_batches
  assert cfg.actor.mini_batches == 2 and cfg.data.prompts_per_step * cfg.rollout.n == 32
  [m] = metrics
  assert m["prompt_group/train_actor"] == 2.0
  assert math.isfinite(m["actor/loss"]) and m["actor/skipped"] == 0.0
  assert changed


@pytest.mark.timeout(300)
def test_raising_reward_plugin_names_the_sample(tmp_path):
  cfg = loading.load("grpo:tiny", smoke_overrides(
      tmp_path, "cluster.devices_per_process=8", "data.prompts_per_step=8", "rollout.n=2",
      "actor.micro_batch_size=1", "trainer.total_steps=1",
      "plugins=('plugin_boom_reward',)"))
  with cfg.unlocked():
    cfg.dag[1] = dict(id="reward", fn="reward.boom", deps=["generate"])
  with pytest.raises(Exception, match=r"reward function 'boom'.*sample"):
    ctx, loaders = trainer.setup(cfg, log=lambda m: None)
    list(trainer.train(ctx, loaders))


@pytest.mark.timeout(300)
def test_ungrouped_rows_take_the_per_row_pass(tmp_path):
  cfg = loading.load("grpo:tiny", smoke_overrides(
      tmp_path, "cluster.devices_per_process=8", "data.prompts_per_step=8", "rollout.n=2",
      "trainer.total_steps=1", "actor.kl.coef=0.1", "actor.micro_batch_size=2",
      "plugins=('plugin_roll_rows',)"))
  assert cfg.model.share_prompt_prefix
  with cfg.unlocked():
    cfg.dag = [
        dict(id="generate", fn="generate"),
        dict(id="reward", fn="reward.math", deps=["generate"]),
        dict(id="advantage", fn="advantage.grpo", deps=["reward"]),
        dict(id="roll", fn="rows.roll", deps=["advantage"]),
        dict(id="ref", fn="ref_logprob", deps=["roll"]),
        dict(id="train_actor", fn="train.actor", deps=["ref"]),
    ]
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  [m] = list(trainer.train(ctx, loaders))
  # 16 rows on 8 shards hold whole groups of 2, but the plugin broke them up.
  assert m["prompt_group/ref"] == 1.0 and m["prompt_group/train_actor"] == 1.0
  assert math.isfinite(m["actor/loss"]) and m["actor/skipped"] == 0.0


def _rm_dag(cfg, model_path=None):
  with cfg.unlocked():
    cfg.dag = [
        dict(id="generate", fn="generate"),
        dict(id="reward_math", fn="reward.math", deps=["generate"]),
        dict(id="rm", fn="reward.model", deps=["reward_math"],
             config=dict(weight=0.5)),
        dict(id="advantage", fn="advantage.grpo", deps=["rm"]),
        dict(id="train_actor", fn="train.actor", deps=["advantage"]),
    ]
    cfg.actor.kl.coef = 0.0
    if model_path is not None:
      cfg.reward.model_path = str(model_path)
  return cfg


def _save_rm(path, vocab_size, tokenizer):
  from flax import nnx
  from distflow_jax.models.config import ModelConfig
  from distflow_jax.models.heads import RewardModel
  from distflow_jax.models.hf_io import save_reward_model
  cfg = ModelConfig(arch="qwen2", vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                    num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True)
  save_reward_model(path, RewardModel(cfg, rngs=nnx.Rngs(7)), tokenizer)


def test_reward_model_node_needs_a_checkpoint(tmp_path):
  cfg = _rm_dag(loading.load("grpo:tiny", smoke_overrides(tmp_path,
                                                          "cluster.devices_per_process=8")))
  with pytest.raises(Exception, match=r"reward.model_path"):
    trainer.setup(cfg, log=lambda m: None)


def test_reward_model_with_another_tokenizer_is_refused(tmp_path):
  from distflow_jax.models.tokenizer import Tokenizer
  tok = Tokenizer.builtin()
  _save_rm(tmp_path / "rm", tok.vocab_size + 8, None)
  import shutil
  # A tokenizer with an extra token: same ids for the rest, but not the same vocabulary.
  tok.tok.add_tokens(["<extra_token>"])
  tok.save(tmp_path / "rm")
  cfg = _rm_dag(loading.load("grpo:tiny", smoke_overrides(
      tmp_path / "run", "cluster.devices_per_process=8")), tmp_path / "rm")
  with pytest.raises(Exception, match=r"tokenizer differs"):
    trainer.setup(cfg, log=lambda m: None)
  shutil.rmtree(tmp_path / "rm")
  _save_rm(tmp_path / "rm", 16, None)
  with pytest.raises(Exception, match=r"vocabulary \(16\) is smaller"):
    trainer.setup(cfg, log=lambda m: None)


@pytest.mark.timeout(600)
def test_reward_model_node_adds_its_score_to_the_rule_reward(tmp_path):
  from distflow_jax.models.tokenizer import Tokenizer
  tok = Tokenizer.builtin()
  _save_rm(tmp_path / "rm", tok.vocab_size, tok)
  cfg = _rm_dag(loading.load("grpo:tiny", smoke_overrides(
      tmp_path / "run", "cluster.devices_per_process=8", "data.prompts_per_step=8",
      "rollout.n=2", "actor.micro_batch_size=1", "trainer.total_steps=1")), tmp_path / "rm")
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  assert Role.REWARD in ctx.roles
  metrics = list(trainer.train(ctx, loaders))
  for m in metrics:
    assert math.isfinite(m["reward/rm"]) and m["reward/rm"] != 0.0
    assert m["reward"] == pytest.approx(m["reward/reward_math"] + 0.5 * m["reward/rm"],
                                        abs=1e-5)


@pytest.mark.timeout(600)
def test_critic_warmup_trains_the_critic_alone_first(tmp_path):
  """critic.warmup_steps=1: step 1 updates the critic only; step 2 the actor too.  The
  value head starts at zero, and the rollout's NLL (the entropy signal) is reported."""
  cfg = loading.load("ppo:tiny", smoke_overrides(
      tmp_path, "cluster.devices_per_process=8", "data.prompts_per_step=16",
      "actor.micro_batch_size=1", "critic.micro_batch_size=1", "critic.warmup_steps=1",
      "trainer.total_steps=2"))
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  snap = lambda role: jax.tree.map(np.asarray, ctx.roles[role].params)  # noqa: E731
  same = lambda a, b: all(np.array_equal(x, y) for x, y in  # noqa: E731
                          zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  actor0, critic0 = snap(Role.ACTOR), snap(Role.CRITIC)
  steps = trainer.train(ctx, loaders)
  m1 = next(steps)
  actor1, critic1 = snap(Role.ACTOR), snap(Role.CRITIC)
  assert same(actor0, actor1) and not same(critic0, critic1)
  assert m1["actor/critic_warmup"] == 1.0 and "actor/loss" not in m1
  assert m1["rollout_nll"] > 0 and math.isfinite(m1["critic/loss"])
  m2 = next(steps)
  assert not same(actor1, snap(Role.ACTOR)) and "actor/critic_warmup" not in m2
  assert math.isfinite(m2["actor/loss"])


def test_critic_warmup_needs_a_critic_and_a_step_left(tmp_path):
  from distflow_jax.config.loading import ConfigError
  with pytest.raises(ConfigError, match="no train.critic node"):
    plan_of("grpo:tiny", tmp_path, "critic.warmup_steps=2")
  with pytest.raises(ConfigError, match="leaves no step for the actor"):
    plan_of("ppo:tiny", tmp_path, "critic.warmup_steps=3")


def plan_of(name, tmp_path, *extra):
  from distflow_jax.config import checks
  from distflow_jax.dag import FUNCTIONS
  cfg = loading.load(name, smoke_overrides(tmp_path, "cluster.devices_per_process=8", *extra))
  return checks.plan_from_config(cfg, checks.topology(cfg, 1, 8), FUNCTIONS)
