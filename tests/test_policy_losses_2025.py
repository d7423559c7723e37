"""The 2025 objectives on the policy-loss registry (GMPO, SAPO, Clip-Cov, KL-Cov) and the
estimators OPO and GRPO pass@k, each against a NumPy reference written from its paper's
formula (and verl's reading of it) on a small case with padding, an empty response and
mixed-sign advantages; their settings' refusals, one line each."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distflow_jax.algos import advantages as adv_lib, losses, policy_losses

ARGS = dict(sapo_tau_pos=1.0, sapo_tau_neg=1.05, clip_cov_ratio=2e-4, clip_cov_lb=1.0,
            clip_cov_ub=5.0, kl_cov_ratio=2e-4, kl_cov_coef=1.0)


def _case(seed=0, B=6, T=7, spread=0.3):
  rs = np.random.RandomState(seed)
  logp = (-rs.rand(B, T) * 3).astype(np.float32)
  old = (logp + rs.randn(B, T) * spread).astype(np.float32)
  # A sequence advantage on every token (the group estimators'), signs mixed, one zero.
  a = rs.randn(B).astype(np.float32)
  a[2] = 0.0
  adv = np.repeat(a[:, None], T, 1)
  lengths = np.array([7, 5, 3, 0, 6, 2])[:B]
  mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
  return logp, old, adv, mask


def _loss(name, logp, old, adv, mask, **kw):
  kw.setdefault("loss_args", ARGS)
  return losses.policy_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv),
                            jnp.asarray(mask), loss=name, **kw)


def _terms(name, logp, old, adv, mask, low=0.2, high=0.2, args=ARGS):
  """The registered function's per-token loss and metrics, given what policy_loss gives it."""
  lr = np.where(mask > 0, logp - old, 0.0).astype(np.float32)
  x = policy_losses.PolicyInput(
      logp=jnp.asarray(logp * mask), old_logp=jnp.asarray(old * mask),
      advantages=jnp.asarray(adv * mask), mask=jnp.asarray(mask), log_ratio=jnp.asarray(lr),
      ratio=jnp.exp(jnp.asarray(lr)), clip_ratio_low=low, clip_ratio_high=high,
      clip_ratio_c=None, args=args)
  return policy_losses.get(name)(x)


# --------------------------------------------------------------------------- GMPO


def _gmpo_numpy(logp, old, adv, mask, lo, hi):
  per_seq, clip_pos, clip_neg = [], 0, 0
  for i in range(mask.shape[0]):
    real = mask[i] > 0
    if not real.any():
      continue
    lr = (logp[i] - old[i])[real].astype(np.float64)
    a = adv[i][real].astype(np.float64)
    lr_c = np.clip(lr, -lo, hi)
    s = np.sign(a)
    d = s * np.minimum(s * lr, s * lr_c)
    per_seq.append(-a.mean() * np.exp(d.mean()))
    clip_pos += int(((lr != lr_c) & (a > 0)).sum())
    clip_neg += int(((lr != lr_c) & (a < 0)).sum())
  return np.mean(per_seq), clip_pos, clip_neg


def test_gmpo_is_the_geometric_mean_of_the_clipped_token_ratios():
  logp, old, adv, mask = _case(spread=0.5)
  out = _loss("gmpo", logp, old, adv, mask, clip_ratio_low=0.4, clip_ratio_high=0.4,
              agg_mode="seq-mean-token-mean")
  want, pos, neg = _gmpo_numpy(logp, old, adv, mask, 0.4, 0.4)
  assert float(out.total / out.count) == pytest.approx(want, rel=1e-5)
  assert float(out.count) == 5  # the empty response counts nowhere
  assert (float(out.metrics["pg_clipfrac"]), float(out.metrics["pg_clipfrac_lower"])) == (
      pos, neg)
  assert pos + neg > 0  # the case exercises the clip


def test_gmpo_gradient_is_zero_where_the_clip_binds_on_the_advantage_s_side():
  logp, old, adv, mask = _case(spread=0.5)
  g = np.asarray(jax.grad(lambda lp: _loss(
      "gmpo", lp, old, adv, mask, clip_ratio_low=0.4, clip_ratio_high=0.4,
      agg_mode="seq-mean-token-mean").total)(jnp.asarray(logp)))
  lr = logp - old
  real = mask > 0
  # A > 0 and log ratio above 0.4, or A < 0 and below -0.4: the clipped branch, no gradient.
  binding = real & (((adv > 0) & (lr > 0.4)) | ((adv < 0) & (lr < -0.4)))
  free = real & ~binding & (adv != 0)
  assert binding.any() and free.any()
  assert np.all(g[binding] == 0) and np.all(np.abs(g[free]) > 0)
  assert np.all(g[~real] == 0)


# --------------------------------------------------------------------------- SAPO


def test_sapo_is_the_soft_gate_with_the_sign_s_temperature():
  logp, old, adv, mask = _case(spread=0.5)
  out = _loss("sapo", logp, old, adv, mask, agg_mode="seq-mean-token-mean")
  r = np.exp((logp - old).astype(np.float64))
  tau = np.where(adv > 0, 1.0, 1.05)
  gate = 1.0 / (1.0 + np.exp(-tau * (r - 1.0))) * (4.0 / tau)
  per = -gate * adv
  rows = [per[i][mask[i] > 0].mean() for i in range(len(mask)) if mask[i].any()]
  assert float(out.total / out.count) == pytest.approx(np.mean(rows), rel=1e-5)
  assert float(out.metrics["sapo_gate"]) == pytest.approx((gate * mask).sum(), rel=1e-5)
  # Other temperatures are read from actor.loss_args.
  hot = _loss("sapo", logp, old, adv, mask, agg_mode="seq-mean-token-mean",
              loss_args=dict(ARGS, sapo_tau_pos=3.0, sapo_tau_neg=3.0))
  assert float(hot.total) != pytest.approx(float(out.total), rel=1e-3)


def test_sapo_on_policy_gradient_is_the_plain_policy_gradient():
  """f'(1) = 1: at rho = 1 SAPO's gradient is -A d log pi, whatever tau."""
  logp, _, adv, mask = _case()
  g = np.asarray(jax.grad(lambda lp: _loss("sapo", lp, logp, adv, mask).total)(
      jnp.asarray(logp)))
  np.testing.assert_allclose(g, -adv * mask, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- Clip-Cov


def _cov_numpy(logp, adv, mask):
  real = mask > 0
  n = real.sum()
  a_mean = (adv * mask).sum() / n
  lp_mean = (logp * mask).sum() / n
  return (adv - a_mean) * (logp - lp_mean)


def test_clip_cov_detaches_a_random_few_of_the_band_s_unclipped_tokens():
  B, T = 16, 40
  rs = np.random.RandomState(3)
  logp = (-rs.rand(B, T) * 4).astype(np.float32)
  old = (logp + rs.randn(B, T) * 0.2).astype(np.float32)
  adv = np.repeat(rs.randn(B, 1) * 2, T, 1).astype(np.float32)
  mask = (np.arange(T)[None, :] < rs.randint(1, T + 1, B)[:, None]).astype(np.float32)
  args = dict(ARGS, clip_cov_ratio=0.02)
  terms = _terms("clip_cov", logp, old, adv, mask, args=args)
  cut = np.asarray(terms.metrics["pg_clipfrac"]) > 0
  r = np.exp(logp - old)
  pg1, pg2 = -adv * r, -adv * np.clip(r, 0.8, 1.2)
  ppo = np.maximum(pg1, pg2)
  cov = _cov_numpy(logp, adv, mask)
  candidate = (mask > 0) & ~(pg2 > pg1) & (cov > 1.0) & (cov < 5.0)
  k = max(int(np.floor(0.02 * mask.sum())), 1)
  assert candidate.sum() > k  # the draw has a choice to make
  assert cut.sum() == k and not (cut & ~candidate).any()
  np.testing.assert_allclose(np.asarray(terms.loss) * mask, np.where(cut, 0.0, ppo) * mask,
                             rtol=1e-5, atol=1e-6)
  # PPO's own clip is still reported, beside the share cut.
  assert np.asarray(terms.metrics["pg_clipfrac_ppo"]).sum() == ((pg2 > pg1) & (mask > 0)).sum()
  # The draw is a function of the batch: the same batch draws the same tokens, another
  # batch's old log-probs another draw.
  again = np.asarray(_terms("clip_cov", logp, old, adv, mask, args=args).metrics["pg_clipfrac"])
  assert (again > 0).tolist() == cut.tolist()
  draws = {tuple(np.flatnonzero(np.asarray(_terms(
      "clip_cov", logp, old + np.float32(1e-3 * s), adv, mask,
      args=args).metrics["pg_clipfrac"]) > 0)) for s in range(4)}
  assert len(draws) > 1
  # A cut token has no gradient; PPO's other tokens keep theirs.
  g = np.asarray(jax.grad(lambda lp: _loss("clip_cov", lp, old, adv, mask,
                                           loss_args=args).total)(jnp.asarray(logp)))
  assert np.all(g[cut] == 0)
  assert np.all(np.abs(g[candidate & ~cut]) > 0)


def test_clip_cov_cuts_at_least_one_token_and_none_without_candidates():
  logp, old, adv, mask = _case()
  # Default 2e-4 of 23 tokens floors to 0: one token is cut, if any is in the band.
  terms = _terms("clip_cov", logp, old, adv, mask, args=dict(ARGS, clip_cov_lb=-1e9,
                                                             clip_cov_ub=1e9))
  assert float(np.asarray(terms.metrics["pg_clipfrac"]).sum()) == 1.0
  none = _terms("clip_cov", logp, old, adv, mask, args=dict(ARGS, clip_cov_lb=1e8,
                                                            clip_cov_ub=1e9))
  assert float(np.asarray(none.metrics["pg_clipfrac"]).sum()) == 0.0


# --------------------------------------------------------------------------- KL-Cov


def test_kl_cov_penalizes_the_top_covariance_tokens():
  logp, old, adv, mask = _case(spread=0.4)
  args = dict(ARGS, kl_cov_ratio=0.2, kl_cov_coef=0.7)
  out = _loss("kl_cov", logp, old, adv, mask, loss_args=args)
  lr = (logp - old).astype(np.float64)
  cov = _cov_numpy(logp.astype(np.float64), adv.astype(np.float64), mask)
  real = np.flatnonzero(mask.reshape(-1) > 0)
  k = max(int(np.floor(0.2 * len(real))), 1)
  top = real[np.argsort(-cov.reshape(-1)[real], kind="stable")[:k]]
  pen = np.zeros(mask.size)
  pen[top] = 0.7 * np.abs(lr.reshape(-1)[top])
  per = -adv * np.exp(lr) + pen.reshape(mask.shape)
  assert float(out.total / out.count) == pytest.approx((per * mask).sum() / mask.sum(),
                                                       rel=1e-5)
  assert float(out.metrics["kl_cov_share"]) == k
  # Without the penalty it is the unclipped surrogate -A rho.
  plain = _loss("kl_cov", logp, old, adv, mask, loss_args=dict(args, kl_cov_coef=0.0))
  assert float(plain.total / plain.count) == pytest.approx(
      (-adv * np.exp(lr) * mask).sum() / mask.sum(), rel=1e-5)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("loss, key, value, needle", [
    ("gmpo", "actor.ratio_level", "sequence", "actor.ratio_level=token"),
    ("clip_cov", "actor.ratio_level", "sequence", "actor.ratio_level=token"),
    ("kl_cov", "actor.ratio_level", "sequence", "actor.ratio_level=token"),
    ("sapo", "actor.loss_args.sapo_tau_pos", "0.0", "actor.loss_args.sapo_tau_pos"),
    ("sapo", "actor.loss_args.sapo_tau_neg", "-1.0", "actor.loss_args.sapo_tau_neg"),
    ("clip_cov", "actor.loss_args.clip_cov_ratio", "0.0", "actor.loss_args.clip_cov_ratio"),
    ("clip_cov", "actor.loss_args.clip_cov_lb", "6.0", "clip_cov_lb"),
    ("kl_cov", "actor.loss_args.kl_cov_ratio", "1.5", "actor.loss_args.kl_cov_ratio"),
    ("kl_cov", "actor.loss_args.kl_cov_coef", "-0.1", "actor.loss_args.kl_cov_coef"),
    ("sapo", "actor.loss_args.sapo_tau_pos", "inf", "finite"),
])
def test_out_of_range_settings_are_refused_by_plan_in_one_line(loss, key, value, needle,
                                                                capsys):
  from distflow_jax import cli
  assert cli.main(["plan", f"--config.actor.policy_loss={loss}",
                   f"--config.{key}={value}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and needle in err[0], err


def test_the_settings_are_checked_when_the_loss_is_traced_too():
  logp, old, adv, mask = _case()
  with pytest.raises(ValueError, match="sapo_tau_neg"):
    _loss("sapo", logp, old, adv, mask, loss_args=dict(ARGS, sapo_tau_neg=0.0))
  with pytest.raises(ValueError, match="actor.loss_args.kl_cov_ratio is not set"):
    _loss("kl_cov", logp, old, adv, mask, loss_args={})


def test_every_shipped_loss_plans_with_the_defaults(capsys):
  from distflow_jax import cli
  for loss in ("gmpo", "sapo", "clip_cov", "kl_cov"):
    assert cli.main(["plan", f"--config.actor.policy_loss={loss}"]) == 0, capsys.readouterr()


# --------------------------------------------------------------------------- estimators


def test_opo_subtracts_the_length_weighted_group_mean():
  r = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.0, 1.0, 0.3, 0.2, 0.9, 0.0], np.float32)
  lengths = np.array([4, 1, 2, 3, 5, 5, 1, 2, 0, 0, 0, 0])
  T = 5
  mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
  out = adv_lib.opo_advantages(jnp.asarray(r), jnp.asarray(mask), group_size=4)
  want = np.zeros(12)
  for g in range(3):
    sl = slice(4 * g, 4 * g + 4)
    n = lengths[sl]
    if n.sum():
      want[sl] = r[sl] - (n * r[sl]).sum() / n.sum()
  np.testing.assert_allclose(np.asarray(out.advantages_BxT), want[:, None] * mask, rtol=1e-6,
                             atol=1e-7)
  assert want[:4].tolist() != (r[:4] - r[:4].mean()).tolist()  # not GRPO's plain mean


def test_grpo_passk_gives_only_the_best_sample_its_lead():
  r = np.array([0.0, 1.0, 0.0, 0.0,  0.2, 0.9, 0.5, 0.9,  0.1, 0.7, 0.4, 0.0], np.float32)
  mask = np.ones((12, 3), np.float32)
  for norm in (True, False):
    out = np.asarray(adv_lib.grpo_passk_advantages(
        jnp.asarray(r), jnp.asarray(mask), group_size=4,
        normalize_by_std=norm).advantages_BxT[:, 0])
    want = np.zeros(12)
    for g in range(3):
      grp = r[4 * g:4 * g + 4].astype(np.float64)
      top = np.sort(grp)[::-1]
      gap = top[0] - top[1]
      if norm:
        gap /= grp.std(ddof=1) + 1e-6
      want[4 * g + int(np.argmax(grp))] = gap
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-7)
  assert out[1] == 1.0 and out[9] == pytest.approx(0.3) and not out[4:8].any()  # a tie: 0
  with pytest.raises(ValueError, match="at least 2 samples"):
    adv_lib.grpo_passk_advantages(jnp.asarray(r), jnp.asarray(mask), group_size=1)


def test_the_estimators_are_dag_functions_that_need_whole_groups():
  from distflow_jax.dag import FUNCTIONS
  for name in ("advantage.opo", "advantage.grpo_passk"):
    assert name in FUNCTIONS.names(), name
