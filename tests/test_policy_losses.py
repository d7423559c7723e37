"""Policy losses by name (algos/policy_losses.py): PPO's clipped surrogate is one entry; a
plugin file registers another with one function and trains with it by naming it in the
config; a name is registered once; an unknown one is refused in one line."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from distflow_jax.algos import losses, policy_losses
from distflow_jax.config import loading
from distflow_jax.run import trainer
from workflow_util import smoke_overrides

PLUGIN = '''
from distflow_jax.algos import policy_losses

@policy_losses.register("plain_pg")
def plain_pg(x):
  """REINFORCE: -A log pi, no ratio, no clip."""
  return policy_losses.PolicyTerms(-x.advantages * x.logp, {"negative_adv": x.advantages < 0})
'''


def test_a_name_is_registered_once_and_an_unknown_one_is_refused():
  with pytest.raises(ValueError, match="'ppo' is registered already .*ppo_clip"):
    policy_losses.register("ppo")(lambda x: None)
  with pytest.raises(ValueError, match="registered: .*'ppo'"):
    policy_losses.get("nope")
  assert "ppo" in policy_losses.names()


def test_the_default_is_ppo_s_clipped_surrogate_by_hand():
  logp = jnp.asarray([[-1.0, -0.5, -2.0]])
  old = jnp.asarray([[-1.2, -0.2, -2.0]])
  adv = jnp.asarray([[1.0, -1.0, 0.5]])
  mask = jnp.asarray([[1.0, 1.0, 0.0]])
  out = losses.policy_loss(logp, old, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.1)
  r = np.exp(np.asarray(logp - old))[0, :2]
  a = np.asarray(adv)[0, :2]
  per = np.maximum(-a * r, -a * np.clip(r, 0.9, 1.1))
  assert float(out.total / out.count) == pytest.approx(per.mean(), rel=1e-6)
  clipped = (-a * np.clip(r, 0.9, 1.1) > -a * r).sum()
  assert float(out.metrics["pg_clipfrac"]) == clipped


@pytest.mark.timeout(600)
def test_a_plugin_loss_trains_two_steps_by_name(tmp_path, capsys):
  plugin = tmp_path / "my_losses.py"
  plugin.write_text(PLUGIN)
  try:
    cfg = loading.load("grpo:tiny", smoke_overrides(
        tmp_path / "run", "data.prompts_per_step=8", "rollout.n=2", "actor.micro_batch_size=2",
        "trainer.total_steps=2", "trainer.eval_every=0", "actor.policy_loss=plain_pg",
        f"plugins=('plugin_length_reward', '{plugin}')"))
    with cfg.unlocked():  # a reward that varies within a group even for this untrained model
      cfg.dag = [dict(d, fn="reward.digits") if d["fn"] == "reward.math" else dict(d)
                 for d in cfg.dag]
    ctx, loaders = trainer.setup(cfg, log=lambda m: None)
    rows = list(trainer.train(ctx, loaders))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
      assert r["actor/skipped"] == 0.0 and math.isfinite(r["actor/loss"]), r
      assert "actor/negative_adv" in r and "actor/pg_clipfrac" not in r, sorted(r)
    # The plugin's loss ran (its own metric, none of PPO's), and it moved the weights.
    assert all(abs(r["actor/pg_loss"]) > 1e-3 and r["actor/grad_norm"] > 0 for r in rows), rows
  finally:
    policy_losses.POLICY_LOSSES.pop("plain_pg", None)


def test_an_unknown_policy_loss_is_refused_by_plan_in_one_line(capsys):
  from distflow_jax import cli
  assert cli.main(["plan", "--config.actor.policy_loss=nope"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "actor.policy_loss" in err[0] and "ppo" in err[0], err


def test_vf_clipfrac_counts_only_tokens_the_clip_changed():
  """The outside check's case: V, V_old, R with |V - V_old| = 0.427 < clip 0.5, so nothing
  is clipped; old + clip(V - old) differs from V in float32 and counted it (1.0, verl 0)."""
  v = jnp.asarray([[0.05311260372400284]], jnp.float32)
  old = jnp.asarray([[0.4799060523509979]], jnp.float32)
  ret = jnp.asarray([[0.10049091279506683]], jnp.float32)
  m = jnp.ones((1, 1), jnp.float32)
  out = losses.value_loss(v, old, ret, m, clip_range=0.5)
  assert float(out.metrics["vf_clipfrac"]) == 0.0
  assert float(out.total) == pytest.approx(0.5 * (0.05311260372400284 - 0.10049091279506683) ** 2)
  # V moved 1.48 toward R = -2: clamped to old - 0.5, whose loss is the larger.
  far = losses.value_loss(jnp.asarray([[-1.0]]), old, jnp.asarray([[-2.0]]), m, clip_range=0.5)
  assert float(far.metrics["vf_clipfrac"]) == 1.0


def test_k3_is_capped_in_the_loss_and_the_reward_penalty():
  from distflow_jax.algos import kl as kl_lib
  logp = jnp.asarray([[-1.0, -20.0, -1.0]])
  ref = jnp.asarray([[-1.1, -5.0, -1.0]])  # a log-ratio of 15 on the second token
  raw = kl_lib.kl_divergence(logp, ref, "k3", k3_cap=0)
  assert float(raw[0, 1]) > 3e6  # what it was: one token swamps the step
  capped = kl_lib.kl_divergence(logp, ref, "k3")
  assert float(capped[0, 1]) == 10.0
  assert float(capped[0, 0]) == pytest.approx(float(raw[0, 0]))
  out = losses.kl_loss(logp, ref, jnp.ones((1, 3)), k3_cap=10.0)
  assert float(out.metrics["kl"]) == pytest.approx(10.0 + float(raw[0, 0]), rel=1e-6)
  import jax
  g = jax.grad(lambda lp: losses.kl_loss(lp, ref, jnp.ones((1, 3))).total)(logp)
  assert float(g[0, 1]) == 0.0  # a capped token adds no gradient


def test_k3_cap_out_of_range_is_refused():
  from distflow_jax.config import values
  cfg = loading.load("grpo:tiny", ["actor.kl.k3_cap=-1"])
  with pytest.raises(loading.ConfigError, match="actor.kl.k3_cap"):
    values.check_values(cfg)


def _case():
  rs = np.random.RandomState(0)
  logp = jnp.asarray(-rs.rand(3, 5) * 2, jnp.float32)
  old = logp + jnp.asarray(rs.randn(3, 5) * 0.4, jnp.float32)
  adv = jnp.asarray(rs.randn(3, 5), jnp.float32)
  mask = jnp.asarray((rs.rand(3, 5) > 0.2).astype(np.float32))
  return logp, old, adv, mask


def _numpy_total(per_token, mask):  # token-mean
  return float((np.asarray(per_token) * np.asarray(mask)).sum() / np.asarray(mask).sum())


def test_gpg_is_minus_a_log_pi_and_its_gradient():
  import jax
  logp, old, adv, mask = _case()
  out = losses.policy_loss(logp, old, adv, mask, loss="gpg")
  assert float(out.total / out.count) == pytest.approx(_numpy_total(-adv * logp, mask), rel=1e-6)
  g = jax.grad(lambda lp: losses.policy_loss(lp, old, adv, mask, loss="gpg").total)(logp)
  np.testing.assert_allclose(np.asarray(g), -np.asarray(adv * mask), rtol=1e-6)


def test_cispo_clips_the_weight_and_keeps_every_token_s_gradient():
  import jax
  logp, old, adv, mask = _case()
  out = losses.policy_loss(logp, old, adv, mask, loss="cispo", clip_ratio_low=0.2,
                           clip_ratio_high=0.28)
  r = np.exp(np.asarray(logp - old))
  w = np.clip(r, 0.8, 1.28)
  assert float(out.total / out.count) == pytest.approx(
      _numpy_total(-w * np.asarray(adv * logp), mask), rel=1e-5)
  m = np.asarray(mask)
  assert float(out.metrics["pg_clipfrac"]) == float((((r < 0.8) | (r > 1.28)) * m).sum())
  g = jax.grad(lambda lp: losses.policy_loss(lp, old, adv, mask, loss="cispo",
                                             clip_ratio_low=0.2, clip_ratio_high=0.28).total)(logp)
  np.testing.assert_allclose(np.asarray(g), -w * np.asarray(adv) * m, rtol=1e-5)
  assert (np.abs(np.asarray(g))[m > 0] > 0).all()  # clipped tokens too (PPO zeroes them)
