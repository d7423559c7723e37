"""The optimal token baseline (issue 54): sum pi^2 from the chunked head against a direct
softmax, the estimator against a NumPy port of verl's per-group loop (zero tail included),
the logprob.stats node in a workflow, and one RL step."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distflow_jax.algos import advantages as adv_lib, token_baselines
from distflow_jax.config import loading
from distflow_jax.config.checks import plan_from_config
from distflow_jax.dag import FUNCTIONS, Topology
from distflow_jax.dag.spec import DagError
from distflow_jax.models import heads
from test_algorithm_configs import one_step_config, shared_compiles  # noqa: F401

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("chunk", [5, 512])
def test_sum_pi_squared_is_the_softmax_s_and_logp_is_unchanged(chunk):
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(size=(3, 4, 8)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(8, 11)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 11, size=(3, 4)))
  logp, sq = heads.token_logprobs_and_sum_pi_squared(h, w, y, temperature=0.7, chunk_size=chunk)
  want_logp, _ = heads.token_logprobs_and_entropy(h, w, y, temperature=0.7, chunk_size=chunk)
  p = jax.nn.softmax(np.einsum("btd,dv->btv", h, w) / 0.7, axis=-1)
  np.testing.assert_allclose(np.asarray(sq), np.sum(np.asarray(p) ** 2, -1), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(logp), np.asarray(want_logp))


def _verl_otb(token_rewards, mask, index, old_logp, sum_sq, zero_tail=True, eps=1e-8):
  """verl's compute_optimal_token_baseline_advantage (core_algos.py), in NumPy."""
  returns = np.flip(np.cumsum(np.flip(token_rewards * mask, -1), -1), -1)
  w = 1 - 2 * np.exp(old_logp) + sum_sq
  W = np.cumsum(w * mask, -1)
  base = np.zeros_like(returns)
  for g in np.unique(index):
    idx = np.flatnonzero(index == g)
    if len(idx) == 1:
      continue
    num = (returns[idx] * W[idx] * mask[idx]).sum(0)
    den = (W[idx] * mask[idx]).sum(0) + eps
    base[idx] = num / den
    if zero_tail:
      lengths = mask[idx].sum(-1)
      s = np.sort(lengths)
      longest = np.flatnonzero(lengths == s[-1])
      if len(longest) == 1 and s[-1] > s[-2]:
        base[idx[longest[0]], int(s[-2]):] = 0.0
  return (returns - base) * mask, returns


@pytest.mark.parametrize("n", [2, 4])
def test_otb_matches_verl(n):
  rng = np.random.default_rng(n)
  groups, T = 3, 7
  B = groups * n
  lengths = rng.integers(1, T + 1, size=B)
  lengths[:n] = [T] + [2] * (n - 1)  # group 0: one longest response (the zero tail)
  lengths[n:2 * n] = 4               # group 1: all equal (no tail)
  mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
  rewards = rng.integers(0, 2, size=B).astype(np.float32)
  token_rewards = np.asarray(adv_lib.outcome_to_token_rewards(jnp.asarray(rewards),
                                                              jnp.asarray(mask)))
  token_rewards = token_rewards - 0.01 * rng.random((B, T)).astype(np.float32) * mask  # a KL
  old_logp = np.log(rng.uniform(0.05, 1.0, size=(B, T))).astype(np.float32) * mask
  sum_sq = rng.uniform(0.05, 1.0, size=(B, T)).astype(np.float32) * mask
  out = token_baselines.otb_advantages(jnp.asarray(token_rewards), jnp.asarray(old_logp),
                                       jnp.asarray(sum_sq), jnp.asarray(mask), group_size=n)
  want_adv, want_ret = _verl_otb(token_rewards, mask, np.repeat(np.arange(groups), n),
                                 old_logp, sum_sq)
  np.testing.assert_allclose(np.asarray(out.advantages_BxT), want_adv, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(out.returns_BxT), want_ret, rtol=1e-5, atol=1e-6)
  # the tail of group 0's longest response has no baseline: its advantage is its return
  tail = np.asarray(out.advantages_BxT)[0, 2:]
  np.testing.assert_allclose(tail, want_ret[0, 2:], rtol=1e-6)


def test_one_sample_groups_get_no_baseline():
  mask = jnp.ones((2, 3))
  out = token_baselines.otb_advantages(jnp.ones((2, 3)), jnp.zeros((2, 3)), jnp.ones((2, 3)),
                                       mask, group_size=1)
  np.testing.assert_array_equal(np.asarray(out.advantages_BxT), np.asarray(out.returns_BxT))


def test_the_variant_plans_with_logprob_stats_and_otb_needs_it():
  cfg = loading.load("algorithms:otb")
  fns = [s.node.fn for s in plan_from_config(cfg, Topology(1, 1), FUNCTIONS).steps]
  assert "logprob.stats" in fns and "logprob" not in fns and "advantage.otb" in fns
  cfg = loading.load("algorithms:otb")
  with cfg.unlocked():
    cfg.dag = [dict(d, fn="logprob") if d["fn"] == "logprob.stats" else d for d in cfg.dag]
  with pytest.raises(DagError, match="sum_pi_squared"):
    plan_from_config(cfg, Topology(1, 1), FUNCTIONS)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.usefixtures("shared_compiles")
def test_a_step_records_sum_pi_squared_and_trains(tmp_path):
  """One step: logprob.stats ran its pass (not the rollout's log-probs) and the step's
  sum pi^2 lies in (0, 1] on real tokens, the advantages train the actor."""
  from distflow_jax.dag.spec import Role
  from distflow_jax.run import trainer
  cfg = one_step_config("otb", tmp_path, "actor.entropy_coef=0.01")
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  seen = {}
  from distflow_jax.nodes import passes
  real = passes.logprob_stats_node

  def spy(ctx_, node, lay, batch):
    out = real(ctx_, node, lay, batch)
    seen.update({k: np.asarray(out.batch.data[k]) for k in ("sum_pi_squared", "response_mask",
                                                      "old_logprobs", "rollout_logprobs")})
    return out
  FUNCTIONS.bind("logprob.stats", spy)
  try:
    (m,) = list(trainer.train(ctx, loaders))
  finally:
    FUNCTIONS.bind("logprob.stats", real)
  assert "old_logprob_from_rollout" not in m
  mask = seen["response_mask"].astype(bool)
  sq = seen["sum_pi_squared"][mask]
  assert np.all(sq > 0) and np.all(sq <= 1 + 1e-6)
  # The pass's log-probs are the rollout's up to float32 rounding (the same policy).
  np.testing.assert_allclose(seen["old_logprobs"][mask], seen["rollout_logprobs"][mask],
                             atol=2e-3)
  assert math.isfinite(m["actor/loss"]) and m["actor/grad_norm"] > 0
  assert Role.ACTOR in ctx.roles
