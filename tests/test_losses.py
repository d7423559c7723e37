"""Losses and KL against hand-computed values and numpy references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distflow_jax.algos import kl as kl_lib
from distflow_jax.algos import losses

RNG = np.random.default_rng(1)
MODES = [m.value for m in losses.LossAggMode]


def _mask(lengths, T):
  return (np.arange(T)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)


def np_aggregate(l, m, mode, norm_length=None):
  nonempty = m.sum(1) > 0
  if mode == "token-mean":
    return (l * m).sum() / m.sum()
  per_seq_sum = (l * m).sum(1)[nonempty]
  if mode == "seq-mean-token-sum":
    return per_seq_sum.mean()
  if mode == "seq-mean-token-mean":
    return (per_seq_sum / m.sum(1)[nonempty]).mean()
  return (per_seq_sum / norm_length).mean()


def np_ppo(logp, old, adv, eps_low, eps_high, c=None):
  ratio = np.exp(logp - old)
  l1 = -adv * ratio
  l2 = -adv * np.clip(ratio, 1 - eps_low, 1 + eps_high)
  l = np.maximum(l1, l2)
  if c is not None:
    l = np.where(adv < 0, np.minimum(l, -adv * c), l)
  return l, (l2 > l1)


def _random_batch(B=6, T=5):
  logp = -RNG.random((B, T)).astype(np.float32) * 2
  old = logp + RNG.normal(scale=0.4, size=(B, T)).astype(np.float32)
  adv = RNG.normal(size=(B, T)).astype(np.float32)
  m = _mask(RNG.integers(1, T + 1, B), T)
  m[2] = 0  # an empty response
  return logp, old, adv, m


# ---------------------------------------------------------------- aggregation


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_matches_numpy(mode):
  l = RNG.normal(size=(5, 4)).astype(np.float32)
  m = _mask([4, 1, 0, 3, 2], 4)
  total, count = losses.aggregate(jnp.asarray(l), jnp.asarray(m), mode,
                                  norm_length=4.0)
  want = np_aggregate(l, m, mode, norm_length=4.0)
  np.testing.assert_allclose(float(total) / float(count), want, rtol=1e-5)
  assert float(count) == (m.sum() if mode == "token-mean" else 4)


def test_aggregate_hand_values():
  l = jnp.array([[1.0, 3.0], [4.0, 0.0]])
  m = jnp.array([[1.0, 1.0], [1.0, 0.0]])
  assert [float(x) for x in losses.aggregate(l, m, "token-mean")] == [8.0, 3.0]
  assert [float(x) for x in losses.aggregate(l, m, "seq-mean-token-sum")] == [8.0, 2.0]
  assert [float(x) for x in losses.aggregate(l, m, "seq-mean-token-mean")] == [6.0, 2.0]


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_sum_to_full_batch(mode):
  logp, old, adv, m = _random_batch(B=8, T=6)
  kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, agg_mode=mode, norm_length=6.0)
  full = losses.policy_loss(logp, old, adv, m, **kw)
  parts = [losses.policy_loss(logp[s], old[s], adv[s], m[s], **kw)
           for s in (slice(0, 3), slice(3, 5), slice(5, 8))]
  summed = losses.combine(parts)
  np.testing.assert_allclose(summed.total / summed.count, full.total / full.count,
                             rtol=1e-5)
  for k in full.metrics:
    np.testing.assert_allclose(summed.metrics[k], full.metrics[k], rtol=1e-5,
                               atol=1e-6)
  np.testing.assert_allclose(
      sum(float(losses.loss_denominator(m[s], mode)) for s in
          (slice(0, 3), slice(3, 8))), float(full.count))


def test_nan_on_padding_does_not_poison():
  l = jnp.array([[1.0, jnp.nan], [2.0, jnp.inf]])
  m = jnp.array([[1.0, 0.0], [1.0, 0.0]])
  for mode in MODES:
    total, _ = losses.aggregate(l, m, mode, norm_length=2.0)
    assert math.isfinite(float(total)), mode


def test_nan_padding_gives_finite_values_and_gradients():
  logp, old, adv, m = _random_batch()
  pad = m == 0
  bad = lambda x: np.where(pad, np.nan, x).astype(np.float32)
  ent = RNG.random(logp.shape).astype(np.float32)

  def total(lp, level, mode):
    out = losses.actor_loss(lp, bad(old), bad(adv), m, entropy_BxT=bad(ent),
                            entropy_coef=0.1, ref_logprobs_BxT=bad(old),
                            kl_coef=0.1, ratio_level=level, agg_mode=mode,
                            norm_length=5.0)
    return out.total

  for level in ("token", "sequence"):
    for mode in MODES:
      clean = losses.actor_loss(logp, old, adv, m, entropy_BxT=ent, entropy_coef=0.1,
                                ref_logprobs_BxT=old, kl_coef=0.1, ratio_level=level,
                                agg_mode=mode, norm_length=5.0)
      np.testing.assert_allclose(total(bad(logp), level, mode), clean.total, rtol=1e-6)
      g = jax.grad(total)(jnp.asarray(bad(logp)), level, mode)
      assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[pad] == 0), (level, mode)
  v = losses.value_loss(bad(logp), bad(old), bad(adv), m)
  assert np.isfinite(float(v.total))


# ---------------------------------------------------------------- policy loss


def test_ppo_hand_values():
  # ratio 1.25 with A=+1: clipped at 1.2 for eps_high=.2, free for .28 (DAPO).
  logp = jnp.log(jnp.array([[1.25, 5.0]]))
  old = jnp.zeros((1, 2))
  m = jnp.array([[1.0, 0.0]])
  sym = losses.policy_loss(logp, old, jnp.ones((1, 2)), m, clip_ratio_low=0.2)
  assert float(sym.total) == pytest.approx(-1.2)
  assert float(sym.metrics["pg_clipfrac"]) == 1.0
  dapo = losses.policy_loss(logp, old, jnp.ones((1, 2)), m, clip_ratio_low=0.2,
                            clip_ratio_high=0.28)
  assert float(dapo.total) == pytest.approx(-1.25)
  assert float(dapo.metrics["pg_clipfrac"]) == 0.0
  # ratio 5 with A=-1: PPO loss max(5, 1.2) = 5; dual clip c=3 bounds it to 3.
  m2 = jnp.array([[0.0, 1.0]])
  neg = -jnp.ones((1, 2))
  plain = losses.policy_loss(logp, old, neg, m2)
  assert float(plain.total) == pytest.approx(5.0)
  dual = losses.policy_loss(logp, old, neg, m2, clip_ratio_c=3.0)
  assert float(dual.total) == pytest.approx(3.0)
  assert float(dual.metrics["pg_clipfrac_lower"]) == 1.0


@pytest.mark.parametrize("dual", [None, 3.0])
@pytest.mark.parametrize("mode", MODES)
def test_ppo_matches_numpy(mode, dual):
  logp, old, adv, m = _random_batch()
  out = losses.policy_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv),
                           jnp.asarray(m), clip_ratio_low=0.2, clip_ratio_high=0.3,
                           clip_ratio_c=dual, agg_mode=mode, norm_length=5.0)
  l, clipped = np_ppo(logp, old, adv, 0.2, 0.3, dual)
  np.testing.assert_allclose(float(out.total / out.count),
                             np_aggregate(l, m, mode, 5.0), rtol=1e-5)
  assert float(out.token_count) == m.sum()
  np.testing.assert_allclose(float(out.metrics["pg_clipfrac"]),
                             (clipped * m).sum(), rtol=1e-6)
  np.testing.assert_allclose(float(out.metrics["ppo_kl"]), ((old - logp) * m).sum(),
                             rtol=1e-5)


def test_ppo_gradient_is_zero_when_clipped_and_matches_numpy_otherwise():
  logp, old, adv, m = _random_batch(B=4, T=3)
  f = lambda lp: losses.policy_loss(lp, old, adv, m, clip_ratio_low=0.2).total
  g = np.asarray(jax.grad(f)(jnp.asarray(logp)))
  _, clipped = np_ppo(logp, old, adv, 0.2, 0.2)
  ratio = np.exp(logp - old)
  # d/dlogp of -A * ratio is -A * ratio; clipped tokens have zero gradient.
  want = np.where(clipped, 0.0, -adv * ratio) * m
  np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


def test_gspo_matches_sequence_level_objective():
  B, T = 4, 5
  logp, old, _, m = _random_batch(B, T)
  m[2] = _mask([3], T)[0]
  adv_B = RNG.normal(size=B).astype(np.float32)
  adv = adv_B[:, None] * m
  eps_low, eps_high = 0.1, 0.15

  def token_form(lp):
    return losses.policy_loss(lp, old, adv, m, clip_ratio_low=eps_low,
                              clip_ratio_high=eps_high, ratio_level="sequence",
                              agg_mode="seq-mean-token-mean")

  def seq_form(lp):  # GSPO as written: one ratio per sequence.
    s = jnp.exp(((lp - old) * m).sum(1) / m.sum(1))
    l = jnp.maximum(-adv_B * s, -adv_B * jnp.clip(s, 1 - eps_low, 1 + eps_high))
    return l.mean()

  out = token_form(jnp.asarray(logp))
  np.testing.assert_allclose(float(out.total / out.count),
                             float(seq_form(jnp.asarray(logp))), rtol=1e-5)
  # ratio metric: every real token carries its sequence's ratio.
  s_np = np.exp(((logp - old) * m).sum(1) / m.sum(1))
  np.testing.assert_allclose(float(out.metrics["ratio"]), (s_np * m.sum(1)).sum(),
                             rtol=1e-5)
  g_tok = jax.grad(lambda lp: token_form(lp).total / token_form(lp).count)(
      jnp.asarray(logp))
  g_seq = jax.grad(seq_form)(jnp.asarray(logp))
  np.testing.assert_allclose(g_tok * m, g_seq * m, rtol=1e-4, atol=1e-6)


def test_policy_loss_validation():
  z = jnp.zeros((2, 3))
  with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
    losses.policy_loss(z, z, z, z, clip_ratio_c=0.5)
  with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'.*token-mean"):
    losses.policy_loss(z, z, z, z, agg_mode="mean")
  with pytest.raises(ValueError, match="norm_length"):
    losses.policy_loss(z, z, z, z, agg_mode="seq-mean-token-sum-norm")
  with pytest.raises(ValueError, match=r"advantages_BxT \(2, 4\)"):
    losses.policy_loss(z, z, jnp.zeros((2, 4)), z)
  with pytest.raises(ValueError, match="unknown ratio level"):
    losses.policy_loss(z, z, z, z, ratio_level="seq")


# ---------------------------------------------------------------- KL


def test_kl_estimators_match_numpy():
  logp = -RNG.random((3, 4)).astype(np.float32)
  ref = -RNG.random((3, 4)).astype(np.float32)
  lr = ref - logp
  want = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": np.exp(lr) - 1 - lr}
  for name, w in want.items():
    np.testing.assert_allclose(kl_lib.kl_divergence(logp, ref, name), w,
                               rtol=1e-5, atol=1e-7)
  assert np.all(np.asarray(kl_lib.kl_divergence(logp, ref, "k3")) >= 0)
  with pytest.raises(ValueError, match="unknown KL estimator 'k4'.*k1, k2, k3"):
    kl_lib.kl_divergence(logp, ref, "k4")


def test_k1_and_k3_are_unbiased_for_true_kl():
  # Categorical pi, pi_ref over 4 outcomes; sample from pi; compare to exact KL.
  p = np.array([0.1, 0.2, 0.3, 0.4])
  q = np.array([0.25, 0.25, 0.25, 0.25])
  exact = float(np.sum(p * np.log(p / q)))
  ys = RNG.choice(4, size=200_000, p=p)
  logp, ref = np.log(p[ys])[None], np.log(q[ys])[None]
  for name in ("k1", "k3"):
    est = float(np.mean(kl_lib.kl_divergence(logp, ref, name)))
    assert est == pytest.approx(exact, abs=2e-3), name


def test_kl_loss_and_penalty():
  logp = jnp.log(jnp.array([[0.5, 0.25]]))
  ref = jnp.log(jnp.array([[0.25, 0.25]]))
  m = jnp.array([[1.0, 1.0]])
  out = losses.kl_loss(logp, ref, m, estimator="k1")
  assert float(out.total / out.count) == pytest.approx(math.log(2) / 2)
  pen = kl_lib.apply_kl_penalty(jnp.array([[0.0, 1.0]]), jnp.array([[2.0, 4.0]]),
                                jnp.array([[1.0, 0.0]]), 0.5)
  np.testing.assert_allclose(pen, [[-1.0, 0.0]])


def test_adaptive_kl_coef_hand_values():
  # KL above target: error clipped to +.2 -> coef * (1 + .2 * 100 / 1000).
  assert float(kl_lib.adaptive_kl_coef(0.1, 0.5, 0.1, 1000, 100)) == pytest.approx(0.102)
  # KL below target: error .05/.1 - 1 = -.5 -> clipped -.2.
  assert float(kl_lib.adaptive_kl_coef(0.1, 0.05, 0.1, 1000, 100)) == pytest.approx(0.098)
  # Within the band: error .11/.1 - 1 = .1 -> 1 + .1 * 10 / 10 = 1.1.
  assert float(kl_lib.adaptive_kl_coef(1.0, 0.11, 0.1, 10, 10)) == pytest.approx(1.1)
  with pytest.raises(ValueError, match="target"):
    kl_lib.adaptive_kl_coef(0.1, 0.1, 0.0, 10, 1)


# ---------------------------------------------------------------- entropy + value


def test_actor_loss_combines_terms():
  logp, old, adv, m = _random_batch()
  ent = RNG.random(logp.shape).astype(np.float32)
  ref = logp + RNG.normal(scale=0.1, size=logp.shape).astype(np.float32)
  for mode in MODES:
    out = losses.actor_loss(logp, old, adv, m, entropy_BxT=ent, entropy_coef=0.01,
                            ref_logprobs_BxT=ref, kl_coef=0.05, kl_estimator="k2",
                            agg_mode=mode, norm_length=5.0, clip_ratio_low=0.2)
    l, _ = np_ppo(logp, old, adv, 0.2, 0.2)
    kl = 0.5 * (ref - logp) ** 2
    want = np_aggregate(l - 0.01 * ent + 0.05 * kl, m, mode, 5.0)
    np.testing.assert_allclose(float(out.total / out.count), want, rtol=1e-5)
    np.testing.assert_allclose(float(out.metrics["entropy"]), (ent * m).sum(),
                               rtol=1e-5)
  with pytest.raises(ValueError, match="entropy_coef=0.1 needs entropy_BxT"):
    losses.actor_loss(logp, old, adv, m, entropy_coef=0.1)


def test_value_loss_hand_and_numpy():
  v, old, ret = jnp.array([[1.5, 1.1]]), jnp.array([[1.0, 1.0]]), jnp.array([[2.0, 0.0]])
  m = jnp.array([[1.0, 1.0]])
  out = losses.value_loss(v, old, ret, m, clip_range=0.2)
  # Token 0: unclipped .25, clipped (1.2-2)^2=.64 -> .32.  Token 1: both 1.21 -> .605.
  assert float(out.total) == pytest.approx(0.32 + 0.605)
  assert float(out.metrics["vf_clipfrac"]) == 1.0
  plain = losses.value_loss(v, old, ret, m, clip_range=None)
  assert float(plain.total) == pytest.approx(0.5 * (0.25 + 1.21))

  B, T = 5, 4
  v = RNG.normal(size=(B, T)).astype(np.float32)
  old = v + RNG.normal(scale=0.5, size=(B, T)).astype(np.float32)
  ret = RNG.normal(size=(B, T)).astype(np.float32)
  m = _mask([4, 2, 0, 1, 3], T)
  vc = old + np.clip(v - old, -0.3, 0.3)
  l = 0.5 * np.maximum((v - ret) ** 2, (vc - ret) ** 2)
  for mode in MODES:
    out = losses.value_loss(v, old, ret, m, clip_range=0.3, agg_mode=mode,
                            norm_length=4.0)
    np.testing.assert_allclose(float(out.total / out.count),
                               np_aggregate(l, m, mode, 4.0), rtol=1e-5)


# ---------------------------------------------------------------- finalize + jit


def test_finalize_means_and_refusals():
  logp, old, adv, m = _random_batch()
  out = losses.policy_loss(logp, old, adv, m)
  res = losses.finalize(out, where="train_actor")
  assert res["loss"] == pytest.approx(float(out.total) / m.sum(), rel=1e-6)
  assert res["pg_loss"] == pytest.approx(res["loss"], rel=1e-6)
  assert res["ppo_kl"] == pytest.approx(((old - logp) * m).sum() / m.sum(), rel=1e-5)
  empty = losses.policy_loss(logp, old, adv, np.zeros_like(m))
  with pytest.raises(losses.EmptyBatchError, match="train_actor: no real response"):
    losses.finalize(empty, where="train_actor")
  bad = losses.policy_loss(logp, old, np.full_like(adv, np.nan), m)
  with pytest.raises(losses.NonFiniteLossError, match="train_actor: loss total is nan"):
    losses.finalize(bad, where="train_actor")


def test_jit_matches_eager():
  logp, old, adv, m = (jnp.asarray(x) for x in _random_batch())
  ent = jnp.asarray(RNG.random(logp.shape).astype(np.float32))

  def f(logp, old, adv, m, ent):
    return (losses.actor_loss(logp, old, adv, m, entropy_BxT=ent, entropy_coef=0.1,
                              ref_logprobs_BxT=old, kl_coef=0.1, clip_ratio_c=3.0,
                              agg_mode="seq-mean-token-mean"),
            losses.policy_loss(logp, old, adv, m, ratio_level="sequence"),
            losses.value_loss(logp, old, adv, m))

  eager = f(logp, old, adv, m, ent)
  jitted = jax.jit(f)(logp, old, adv, m, ent)
  for e, j in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
    np.testing.assert_allclose(e, j, rtol=1e-5, atol=1e-6)
  new_coef = jax.jit(kl_lib.adaptive_kl_coef, static_argnums=(2, 3))(0.1, 0.5, 0.1, 1000, 100)
  assert float(new_coef) == pytest.approx(0.102)
