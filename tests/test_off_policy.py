"""Off-policy correction (algos/off_policy.py): the weights and the corrected loss on
hand-made numbers, the train step with each correction, and one GRPO step of each."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from distflow_jax.algos import losses, off_policy
from distflow_jax.algos.off_policy import OffPolicyCorrection as OPC
from distflow_jax.train import steps
from loss_settings import actor_loss_settings
from test_train_steps import make_batch, model_and_params, with_old_logprobs
from test_algorithm_configs import shared_compiles  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(300)

# One row of five tokens, the last padding: r = pi_old / mu = 1, 1.5, 3, 0.5 (and padding).
R = np.array([[1.0, 1.5, 3.0, 0.5, 7.0]], np.float32)
MASK = np.array([[1, 1, 1, 1, 0]], bool)
MU = np.log(np.array([[0.5, 0.2, 0.1, 0.4, 0.1]], np.float32))
OLD = MU + np.log(R)


@pytest.mark.parametrize("correction, want", [
    (OPC.NONE, [1.0, 1.0, 1.0, 1.0, 0.0]),
    (OPC.TIS, [1.0, 1.5, 2.0, 0.5, 0.0]),        # min(r, C): 3 truncated at C = 2
    (OPC.DECOUPLED, [1.0, 1.5, 0.0, 0.5, 0.0]),  # r if r <= C else 0: 3 dropped
    (OPC.SEQ_TIS, [2.0, 2.0, 2.0, 2.0, 0.0]),    # min(1 x 1.5 x 3 x 0.5 = 2.25, C)
    (OPC.TOKEN_REJECT, [1.0, 1.0, 0.0, 1.0, 0.0]),  # 3 outside [0.4, 2]
    (OPC.SEQ_REJECT, [1.0, 1.0, 1.0, 1.0, 0.0]),  # geometric mean 2.25^(1/4) = 1.22 kept
])
def test_token_weights_on_hand_numbers(correction, want):
  w = off_policy.token_weights(OLD, MU, MASK, correction, 2.0, reject_low=0.4)
  np.testing.assert_allclose(w, [want], rtol=1e-6)
  assert OPC.parse(correction.value) is correction  # the config's spelling


def test_rejection_bounds_apply_to_the_token_or_the_sequence_s_geometric_mean():
  tight = dict(reject_low=0.9, reject_high=1.2)
  w = off_policy.token_weights(OLD, MU, MASK, OPC.SEQ_REJECT, 2.0, **tight)
  np.testing.assert_allclose(w, [[0.0] * 5])  # 1.22 > 1.2: the whole sequence goes
  w = off_policy.token_weights(OLD, MU, MASK, OPC.TOKEN_REJECT, 2.0, **tight)
  np.testing.assert_allclose(w, [[1.0, 0.0, 0.0, 0.0, 0.0]])
  s = jax.device_get(off_policy.weight_stats(OLD, MU, MASK, 2.0, OPC.TOKEN_REJECT, **tight))
  assert float(s["dropped"]) == 3.0
  np.testing.assert_allclose(s["gap_max"], np.log(3), rtol=1e-6)


@pytest.mark.parametrize("low, high", [(1.0, 2.0), (0.5, 1.0), (-0.1, 2.0), (0.5, float("inf"))])
def test_rejection_bounds_must_keep_ratio_one(low, high):
  with pytest.raises(ValueError, match="reject_(low|high)"):
    off_policy.token_weights(OLD, MU, MASK, OPC.TOKEN_REJECT, 2.0, low, high)


def test_bad_rejection_bounds_are_refused_by_plan_in_one_line(capsys):
  from distflow_jax import cli
  assert cli.main(["plan", "--config.actor.off_policy.correction=token_reject",
                   "--config.actor.off_policy.reject_high=0.9"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "actor.off_policy.reject_high=0.9" in err[0], err


def test_weights_carry_no_gradient():
  f = lambda old, mu: jnp.sum(off_policy.token_weights(old, mu, MASK, OPC.TIS, 2.0))  # noqa: E731
  g_old, g_mu = jax.grad(f, argnums=(0, 1))(jnp.asarray(OLD), jnp.asarray(MU))
  assert not np.any(g_old) and not np.any(g_mu)


def test_weight_stats_on_hand_numbers():
  s = jax.device_get(off_policy.weight_stats(OLD, MU, MASK, 2.0))
  assert float(s["tokens"]) == 4.0
  np.testing.assert_allclose(s["ratio_sum"], 1 + 1.5 + 3 + 0.5, rtol=1e-6)
  np.testing.assert_allclose(s["ratio_max"], 3.0, rtol=1e-6)  # padding's 7 not counted
  assert float(s["above_cap"]) == 1.0
  np.testing.assert_allclose(s["gap_sum"], np.log(1.5) + np.log(3) + np.log(2), rtol=1e-6)


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), float("nan")])
def test_cap_must_be_finite_and_positive(cap):
  with pytest.raises(ValueError, match="cap"):
    off_policy.token_weights(OLD, MU, MASK, OPC.TIS, cap)


def test_unknown_correction_is_named():
  with pytest.raises(ValueError, match="off-policy correction 'is'; valid: none, tis"):
    OPC.parse("is")


def _loss_and_grad(logp, adv, weights):
  def f(lp):
    out = losses.policy_loss(lp, OLD, adv, MASK, clip_ratio_low=0.2,
                             token_weights_BxT=weights)
    return out.total
  return f(logp), jax.grad(f)(logp)


@pytest.mark.parametrize("correction", [OPC.TIS, OPC.DECOUPLED])
def test_corrected_ppo_loss_and_gradient_on_hand_numbers(correction):
  """rho = pi_theta / pi_old = 1, 1.5, 1, 0.9 with A = 1, 1, -1, 1: token 1's clip is taken
  (A > 0, rho > 1.2: loss -1.2 A, no gradient), the others are unclipped (loss -A rho,
  d/dlogp = -A rho); each token's term times its weight w."""
  rho = np.array([[1.0, 1.5, 1.0, 0.9, 1.0]], np.float32)
  adv = np.array([[1.0, 1.0, -1.0, 1.0, 0.0]], np.float32)
  logp = jnp.asarray(OLD + np.log(rho))
  w = np.asarray(off_policy.token_weights(OLD, MU, MASK, correction, 2.0))[0]
  total, grad = _loss_and_grad(logp, adv, jnp.asarray(w[None]))
  per_token = [-1.0 * 1.0, -1.0 * 1.2, 1.0 * 1.0, -1.0 * 0.9]
  np.testing.assert_allclose(total, sum(w[i] * per_token[i] for i in range(4)), rtol=1e-6)
  want_grad = [-1.0 * w[0], 0.0, 1.0 * w[2], -0.9 * w[3], 0.0]
  np.testing.assert_allclose(grad[0], want_grad, rtol=1e-6, atol=1e-7)


def _step_grads(loss_cfg, batch):
  graphdef, params = model_and_params()
  loss_fn = lambda p, mb: steps.actor_loss(graphdef, p, mb, loss_cfg, 512)  # noqa: E731
  (out, grads) = jax.jit(jax.value_and_grad(lambda p: loss_fn(p, batch).total))(params)
  return out, grads


def _batch_with_mu(scale):
  graphdef, params = model_and_params()
  batch = with_old_logprobs(graphdef, params, make_batch())
  # Another engine's log-probs: the trainer's moved by up to +-scale on real tokens.
  rng = np.random.default_rng(3)
  noise = rng.uniform(-scale, scale, batch["old_logprobs"].shape).astype(np.float32)
  batch["rollout_logprobs"] = batch["old_logprobs"] + noise * batch["response_mask"]
  return batch


def _equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_none_is_today_s_loss_bitwise_whatever_mu_is():
  """correction=none: the loss and gradient of the call without any correction (today's),
  bit for bit, even with a rollout_logprobs far from the old log-probs in the batch."""
  batch = _batch_with_mu(1.0)
  graphdef, params = model_and_params()
  cfg = actor_loss_settings(kl_coef=0.1)

  def today(p):  # losses.actor_loss as train/steps.py called it before the correction
    logp, ent = steps.response_logprobs(graphdef, p, batch, chunk_size=512)
    return losses.actor_loss(
        logp, batch["old_logprobs"], batch["advantages"], batch["response_mask"],
        entropy_BxT=ent, ref_logprobs_BxT=batch["ref_logprobs"], kl_coef=0.1,
        clip_ratio_low=0.2, clip_ratio_high=0.2, norm_length=None).total
  want = jax.jit(jax.value_and_grad(today))(params)
  got = _step_grads(cfg, batch)
  _equal(got, want)


def test_tis_with_every_weight_below_the_cap_is_none_s_gradient():
  batch = _batch_with_mu(0.0)  # identical log-probs: every weight is exp(0) = 1 < C
  none = _step_grads(actor_loss_settings(), batch)
  _equal(_step_grads(actor_loss_settings(off_policy="tis", tis_cap=2.0), batch), none)
  # ... and a real mismatch changes it (the weights are applied).
  moved = _batch_with_mu(0.5)
  _, g = _step_grads(actor_loss_settings(off_policy="tis", tis_cap=2.0), moved)
  _, g0 = _step_grads(actor_loss_settings(), moved)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)))


@pytest.mark.parametrize("correction", ["tis", "decoupled", "seq_tis", "seq_reject"])
def test_train_step_micro_batches_give_the_full_batch_update(correction):
  """The weights are per token, so the corrected loss accumulates exactly over micro-batches."""
  graphdef, params = model_and_params()
  batch = _batch_with_mu(1.0)
  cfg = actor_loss_settings(off_policy=correction, tis_cap=1.5)
  loss_fn = lambda g, p, mb: steps.actor_loss(g, p, mb, cfg, 512)  # noqa: E731
  tx = optax.sgd(1.0)
  out = []
  for m in (1, 4):
    p = jax.tree.map(jnp.copy, params)
    new_p, _, stats = steps.make_train_step(loss_fn, graphdef, tx, m, "token-mean")(
        p, tx.init(p), batch)
    out.append((new_p, stats))
  for a, b in zip(jax.tree.leaves(out[0][0]), jax.tree.leaves(out[1][0])):
    np.testing.assert_allclose(a, b, atol=2e-6)
  assert int(out[0][1]["skipped"]) == 0 and math.isfinite(float(out[0][1]["total"]))




@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.usefixtures("shared_compiles")
@pytest.mark.parametrize("correction", ["none", "tis", "decoupled", "seq_tis", "token_reject",
                                        "seq_reject"])
def test_one_grpo_step_with_each_correction(correction, tmp_path):
  from distflow_jax.config import loading
  from distflow_jax.run import trainer
  from workflow_util import smoke_overrides
  # none recomputes the old log-probs only when asked; a correction always does.
  extra = ["actor.recompute_old_logprobs=True"] if correction == "none" else []
  cfg = loading.load("algorithms:grpo", smoke_overrides(
      tmp_path, "trainer.total_steps=1", "actor.micro_batch_size=4", "data.prompts_per_step=4",
      "rollout.n=2", f"actor.off_policy.correction={correction}", *extra,
      *[f"placement.{role}.devices=0:1" for role in ("actor", "reference", "reward")]))
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  (m,) = list(trainer.train(ctx, loaders))
  assert m["step"] == 1 and m["actor/skipped"] == 0.0
  assert "old_logprob_from_rollout" not in m  # the trainer's own old log-probs
  # The engine's log-probs and the trainer's differ a little (decode cache, kernels).
  assert 0.0 <= m["off_policy/logprob_gap"] < 0.5, m
  keys = ("off_policy/is_weight_mean", "off_policy/is_weight_max", "off_policy/clipped_frac")
  if correction == "none":
    assert not any(k in m for k in keys)
    return
  for key in ("actor/loss", "actor/grad_norm", *keys):
    assert math.isfinite(m[key]), (key, m)
  assert 0.0 < m["off_policy/is_weight_mean"] <= m["off_policy/is_weight_max"]
  assert 0.0 <= m["off_policy/clipped_frac"] <= 1.0
  assert 0.0 <= m["off_policy/dropped_frac"] <= 1.0
  assert m["off_policy/logprob_gap"] <= m["off_policy/logprob_gap_max"]
