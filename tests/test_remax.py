"""ReMax (issue 54): the estimator against verl's formula, the workflow rules that keep the
greedy baseline's rewards the samples' rewards, and one RL step whose baseline is
subtracted (a constant reward gives exactly zero advantages, so zero gradients)."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from distflow_jax.algos import advantages as adv_lib, token_baselines
from distflow_jax.config import loading
from distflow_jax.config.checks import plan_from_config
from distflow_jax.dag import FUNCTIONS, Topology
from distflow_jax.dag.spec import DagError
from test_algorithm_configs import one_step_config, shared_compiles  # noqa: F401

pytestmark = pytest.mark.timeout(120)


def _verl_remax(token_rewards, baselines, mask):
  """verl's compute_remax_outcome_advantage (core_algos.py), in NumPy: the reverse
  cumulative sum of the masked token rewards, minus the baseline on real tokens."""
  r = token_rewards * mask
  returns = np.flip(np.cumsum(np.flip(r, -1), -1), -1)
  return returns - baselines[:, None] * mask, returns


def test_remax_matches_verl_on_real_tokens_and_is_zero_on_padding():
  rng = np.random.default_rng(0)
  B, T = 6, 9
  mask = (rng.random((B, T)) < 0.8).astype(np.float32)
  mask[0] = 0.0                     # an empty response
  mask[1, 3] = 0.0                  # a masked gap inside a response
  token_rewards = rng.normal(size=(B, T)).astype(np.float32)  # a KL penalty per token
  token_rewards[mask == 0] = np.nan  # padding garbage never leaks
  baselines = rng.normal(size=B).astype(np.float32)
  out = token_baselines.remax_advantages(jnp.asarray(token_rewards), jnp.asarray(baselines),
                                 jnp.asarray(mask))
  want_adv, want_ret = _verl_remax(np.nan_to_num(token_rewards), baselines, mask)
  adv, ret = np.asarray(out.advantages_BxT), np.asarray(out.returns_BxT)
  real = mask > 0
  np.testing.assert_allclose(adv[real], want_adv[real], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(ret[real], want_ret[real], rtol=1e-6, atol=1e-6)
  assert np.all(adv[~real] == 0) and np.all(np.isfinite(adv))


def test_outcome_reward_minus_greedy_reward_on_every_token():
  mask = jnp.asarray([[1, 1, 1, 0], [1, 1, 0, 0]], jnp.float32)
  rewards = adv_lib.outcome_to_token_rewards(jnp.asarray([1.0, 0.0]), mask)
  out = token_baselines.remax_advantages(rewards, jnp.asarray([0.0, 1.0]), mask)
  np.testing.assert_array_equal(np.asarray(out.advantages_BxT),
                                [[1, 1, 1, 0], [-1, -1, 0, 0]])


def _plan(variant_dag_edit=None, *overrides):
  cfg = loading.load("algorithms:remax", list(overrides))
  if variant_dag_edit is not None:
    with cfg.unlocked():
      cfg.dag = variant_dag_edit([dict(d) for d in cfg.dag])
  return plan_from_config(cfg, Topology(1, 1), FUNCTIONS)


def test_the_shipped_variant_plans_the_greedy_node_before_its_reward():
  fns = [s.node.fn for s in _plan().steps]
  assert fns.index("generate") < fns.index("generate.greedy") < fns.index("reward.math") < (
      fns.index("advantage.remax"))


def test_remax_without_a_greedy_node_is_refused():
  def drop(dag):
    dag = [d for d in dag if d["fn"] != "generate.greedy"]
    return [dict(d, deps=["generate" if x == "baseline" else x for x in d.get("deps", [])])
            for d in dag]
  with pytest.raises(DagError, match="baseline_tokens"):
    _plan(drop)


def test_a_reward_before_the_greedy_node_is_refused():
  def early(dag):
    return [dict(d, deps=["generate"]) if d["fn"] == "reward.math" else
            dict(d, deps=["reward"]) if d["fn"] == "generate.greedy" else
            dict(d, deps=["baseline"]) if d["fn"] == "advantage.remax" else d for d in dag]
  with pytest.raises(DagError, match=r"reward node 'reward' runs before the generate.greedy"):
    _plan(early)


def test_a_reward_that_cannot_score_the_baseline_is_refused():
  def with_model(dag):
    out = []
    for d in dag:
      out.append(d)
      if d["fn"] == "reward.math":
        out.append(dict(id="rm", fn="reward.model", deps=["reward"]))
    return [dict(d, deps=["rm"]) if d["fn"] == "advantage.remax" else d for d in out]
  with pytest.raises(DagError, match=r"reward node 'rm' \(reward.model\) does not score"):
    _plan(with_model)


def test_the_greedy_baseline_with_episodes_is_refused():
  """Episodes need the environment's reward, which scores no baseline."""
  def with_env(dag):
    out = []
    for d in dag:
      out.append(d)
      if d["fn"] == "reward.math":
        out.append(dict(id="env_reward", fn="reward.env", deps=["reward"]))
    return [dict(d, deps=["env_reward"]) if d["fn"] == "advantage.remax" else d for d in out]
  with pytest.raises(DagError, match=r"'env_reward' \(reward.env\) does not score"):
    _plan(with_env, "rollout.env=calc")


def _one(completion: str, ground_truth: str) -> float:
  return 1.0


@pytest.fixture
def constant_reward():
  from distflow_jax.nodes.rewards import rule_reward_node
  from distflow_jax.rewards import registry
  if "test_one" not in registry.reward_names():
    registry.register_reward("test_one", _one)
  FUNCTIONS.register(dataclasses.replace(FUNCTIONS.spec("reward.math"), name="reward.test_one"),
                     rule_reward_node("test_one"))
  yield "reward.test_one"
  FUNCTIONS.unregister("reward.test_one")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.usefixtures("shared_compiles")
def test_a_step_subtracts_the_greedy_reward(tmp_path, constant_reward):
  """Every response scores 1, the greedy one too: A = 1 - 1 = 0 on every token, so with no
  KL and no entropy term the actor's gradient is exactly 0 (were the baseline not
  subtracted, A = 1 and the gradient would not vanish)."""
  from distflow_jax.run import trainer
  cfg = one_step_config("remax", tmp_path, "actor.kl.coef=0.0")
  with cfg.unlocked():
    cfg.dag = [dict(d, fn=constant_reward) if d["fn"] == "reward.math" else d for d in cfg.dag]
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  (m,) = list(trainer.train(ctx, loaders))
  assert m["reward"] == 1.0 and m["reward/reward_baseline"] == 1.0, m
  assert m["baseline_length"] > 0
  assert m["actor/grad_norm"] == 0.0, m
  assert math.isfinite(m["actor/loss"])
