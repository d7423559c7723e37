"""Advantage estimators against hand-computed values and numpy loop references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distflow_jax.algos import advantages as adv_lib
from distflow_jax.algos import kl as kl_lib, masked

RNG = np.random.default_rng(0)


def _mask(lengths, T):
  return (np.arange(T)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)


# ---------------------------------------------------------------- numpy refs


def np_gae(r, v, m, gamma, lam):
  B, T = r.shape
  adv = np.zeros_like(r)
  for b in range(B):
    idx = [t for t in range(T) if m[b, t] > 0]
    next_v, next_a = 0.0, 0.0
    for t in reversed(idx):
      delta = r[b, t] + gamma * next_v - v[b, t]
      a = delta + gamma * lam * next_a
      adv[b, t] = a
      next_v, next_a = v[b, t], a
  ret = (adv + v) * m
  return adv, ret


def np_whiten(x, m):
  vals = x[m > 0]
  mean, var = vals.mean(), vals.var(ddof=1)
  return (x - mean) / np.sqrt(var + 1e-8) * m


def np_returns(r, m, gamma):
  out = np.zeros_like(r)
  for b in range(r.shape[0]):
    g = 0.0
    for t in reversed(range(r.shape[1])):
      if m[b, t] > 0:
        g = r[b, t] + gamma * g
        out[b, t] = g
  return out


# ---------------------------------------------------------------- GRPO


def test_grpo_hand_computed():
  # Group 1: rewards 1, 0, 0, 1 -> mean .5, unbiased std sqrt(1/3).
  r = jnp.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
  m = jnp.ones((8, 3))
  out = adv_lib.grpo_advantages(r, m, group_size=4)
  s = np.sqrt(1 / 3)
  want = np.array([.5, -.5, -.5, .5]) / (s + 1e-6)
  np.testing.assert_allclose(out.advantages_BxT[:4, 0], want, rtol=1e-5)
  # A group whose rewards are all equal gives zero advantage, not NaN.
  np.testing.assert_allclose(out.advantages_BxT[4:], 0.0)


def test_grpo_matches_numpy_and_masks_tokens():
  n, G, T = 4, 3, 5
  r = RNG.normal(size=G * n).astype(np.float32)
  m = _mask(RNG.integers(0, T + 1, G * n), T)
  out = adv_lib.grpo_advantages(jnp.asarray(r), jnp.asarray(m), group_size=n)
  want = np.zeros(G * n)
  for g in range(G):
    x = r[g * n:(g + 1) * n]
    want[g * n:(g + 1) * n] = (x - x.mean()) / (x.std(ddof=1) + 1e-6)
  np.testing.assert_allclose(out.advantages_BxT, want[:, None] * m, rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_array_equal(out.returns_BxT, out.advantages_BxT)


def test_dr_grpo_has_no_std_normalisation():
  r = jnp.array([3.0, 1.0, 0.0, 0.0])
  m = jnp.ones((4, 2))
  out = adv_lib.grpo_advantages(r, m, group_size=2, normalize_by_std=False)
  np.testing.assert_allclose(out.advantages_BxT[:, 0], [1.0, -1.0, 0.0, 0.0])


def test_group_ids_match_contiguous_groups():
  r = RNG.normal(size=6).astype(np.float32)
  m = jnp.ones((6, 2))
  contiguous = adv_lib.grpo_advantages(jnp.asarray(r), m, group_size=3)
  # Same groups, shuffled order, given by id.
  perm = np.array([4, 0, 5, 2, 1, 3])
  ids = jnp.asarray(perm // 3)
  by_id = adv_lib.grpo_advantages(jnp.asarray(r[perm]), m, group_ids_B=ids,
                                  num_groups=2)
  np.testing.assert_allclose(by_id.advantages_BxT,
                             np.asarray(contiguous.advantages_BxT)[perm],
                             rtol=1e-5, atol=1e-6)


def test_singleton_group_gets_zero():
  r = jnp.array([5.0, 1.0, 3.0])
  out = adv_lib.grpo_advantages(r, jnp.ones((3, 1)), group_ids_B=jnp.array([0, 1, 1]),
                                num_groups=2)
  np.testing.assert_allclose(out.advantages_BxT[:, 0],
                             [0.0, -1 / (np.sqrt(2) + 1e-6), 1 / (np.sqrt(2) + 1e-6)],
                             rtol=1e-5)


def test_group_size_must_divide_batch():
  with pytest.raises(ValueError, match=r"batch size 6 .* group_size 4"):
    adv_lib.grpo_advantages(jnp.zeros(6), jnp.ones((6, 2)), group_size=4)
  with pytest.raises(ValueError, match="exactly one"):
    adv_lib.grpo_advantages(jnp.zeros(6), jnp.ones((6, 2)))


# ---------------------------------------------------------------- RLOO


def test_rloo_leave_one_out():
  r = np.array([1.0, 0.0, 0.0, 1.0, 4.0, 2.0], np.float32)
  out = adv_lib.rloo_advantages(jnp.asarray(r), jnp.ones((6, 2)), group_size=3)
  want = []
  for g in range(2):
    x = r[g * 3:(g + 1) * 3]
    want += [x[i] - np.delete(x, i).mean() for i in range(3)]
  np.testing.assert_allclose(out.advantages_BxT[:, 0], want, rtol=1e-6)
  # Hand value: first sample 1 - (0 + 0) / 2 = 1.
  assert float(out.advantages_BxT[0, 0]) == pytest.approx(1.0)


# ---------------------------------------------------------------- GAE


def test_gae_hand_computed():
  # One sequence of 2 real tokens then padding, gamma=.5, lam=.5.
  r = jnp.array([[0.0, 1.0, 9.0]])
  v = jnp.array([[0.5, 0.25, 7.0]])
  m = jnp.array([[1.0, 1.0, 0.0]])
  out = adv_lib.gae_advantages(r, v, m, gamma=0.5, lam=0.5, whiten=False)
  a1 = 1.0 - 0.25                     # delta_1, bootstraps from 0
  a0 = (0.0 + 0.5 * 0.25 - 0.5) + 0.25 * a1
  np.testing.assert_allclose(out.advantages_BxT, [[a0, a1, 0.0]], rtol=1e-6)
  np.testing.assert_allclose(out.returns_BxT, [[a0 + 0.5, a1 + 0.25, 0.0]],
                             rtol=1e-6)


def test_gae_matches_numpy_with_interior_padding():
  B, T = 5, 7
  r = RNG.normal(size=(B, T)).astype(np.float32)
  v = RNG.normal(size=(B, T)).astype(np.float32)
  m = (RNG.random((B, T)) > 0.3).astype(np.float32)
  m[0] = 0  # an empty response
  want_a, want_r = np_gae(r, v, m, 0.9, 0.8)
  out = adv_lib.gae_advantages(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m),
                               gamma=0.9, lam=0.8, whiten=False)
  np.testing.assert_allclose(out.advantages_BxT, want_a, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out.returns_BxT, want_r, rtol=1e-5, atol=1e-5)
  white = adv_lib.gae_advantages(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m),
                                 gamma=0.9, lam=0.8, whiten=True)
  np.testing.assert_allclose(white.advantages_BxT, np_whiten(want_a, m),
                             rtol=1e-4, atol=1e-5)


def test_gae_padding_does_not_leak():
  r = RNG.normal(size=(2, 6)).astype(np.float32)
  v = RNG.normal(size=(2, 6)).astype(np.float32)
  m = _mask([4, 6], 6)
  base = adv_lib.gae_advantages(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m),
                                gamma=0.99, lam=0.95, whiten=False)
  r2, v2 = r.copy(), v.copy()
  r2[0, 4:] = 1e6
  v2[0, 4:] = -1e6
  moved = adv_lib.gae_advantages(jnp.asarray(r2), jnp.asarray(v2), jnp.asarray(m),
                                 gamma=0.99, lam=0.95, whiten=False)
  np.testing.assert_array_equal(base.advantages_BxT, moved.advantages_BxT)
  np.testing.assert_array_equal(base.returns_BxT, moved.returns_BxT)
  r2[0, 4:] = np.nan
  v2[0, 4:] = np.inf
  for whiten in (False, True):
    clean = adv_lib.gae_advantages(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m),
                                   gamma=0.99, lam=0.95, whiten=whiten)
    nan = adv_lib.gae_advantages(jnp.asarray(r2), jnp.asarray(v2), jnp.asarray(m),
                                 gamma=0.99, lam=0.95, whiten=whiten)
    np.testing.assert_array_equal(clean.advantages_BxT, nan.advantages_BxT)
    np.testing.assert_array_equal(clean.returns_BxT, nan.returns_BxT)
  rpp = adv_lib.reinforce_pp_advantages(jnp.asarray(r2), jnp.asarray(m))
  assert np.all(np.isfinite(rpp.advantages_BxT)) and np.all(np.isfinite(rpp.returns_BxT))


# ---------------------------------------------------------------- REINFORCE++


def test_outcome_to_token_rewards():
  m = jnp.asarray(_mask([2, 0, 3], 3))
  tr = adv_lib.outcome_to_token_rewards(jnp.array([1.0, 5.0, -2.0]), m)
  np.testing.assert_allclose(tr, [[0, 1, 0], [0, 0, 0], [0, 0, -2]])


def test_reinforce_pp_matches_numpy():
  B, T = 4, 5
  m = _mask([5, 3, 1, 4], T)
  scores = np.array([1.0, 0.0, 1.0, 0.5], np.float32)
  kl = RNG.random((B, T)).astype(np.float32)
  tr = kl_lib.apply_kl_penalty(
      adv_lib.outcome_to_token_rewards(jnp.asarray(scores), jnp.asarray(m)),
      jnp.asarray(kl), jnp.asarray(m), 0.1)
  # Independent construction of the penalised token rewards.
  tr_np = -0.1 * kl * m
  for b, L in enumerate([5, 3, 1, 4]):
    tr_np[b, L - 1] += scores[b]
  np.testing.assert_allclose(tr, tr_np, rtol=1e-6, atol=1e-7)
  out = adv_lib.reinforce_pp_advantages(tr, jnp.asarray(m), gamma=0.9)
  want_ret = np_returns(tr_np, m, 0.9)
  np.testing.assert_allclose(out.returns_BxT, want_ret, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out.advantages_BxT, np_whiten(want_ret, m),
                             rtol=1e-4, atol=1e-5)


def test_reinforce_pp_baseline_matches_numpy():
  r = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], np.float32)
  m = _mask([3, 2, 1, 3, 3, 2], 3)
  out = adv_lib.reinforce_pp_baseline_advantages(jnp.asarray(r), jnp.asarray(m),
                                                 group_size=3)
  centred = np.concatenate([r[:3] - r[:3].mean(), r[3:] - r[3:].mean()])
  tok = centred[:, None] * m
  np.testing.assert_allclose(out.returns_BxT, tok, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(out.advantages_BxT, np_whiten(tok, m), rtol=1e-4,
                             atol=1e-5)


# ---------------------------------------------------------------- jit


def test_jit_matches_eager():
  B, T, n = 6, 4, 3
  r = jnp.asarray(RNG.normal(size=B).astype(np.float32))
  tr = jnp.asarray(RNG.normal(size=(B, T)).astype(np.float32))
  v = jnp.asarray(RNG.normal(size=(B, T)).astype(np.float32))
  m = jnp.asarray(_mask([4, 3, 0, 2, 4, 1], T))
  calls = [
      lambda r, tr, v, m: adv_lib.grpo_advantages(r, m, group_size=n),
      lambda r, tr, v, m: adv_lib.rloo_advantages(r, m, group_size=n),
      lambda r, tr, v, m: adv_lib.reinforce_pp_baseline_advantages(
          r, m, group_size=n),
      lambda r, tr, v, m: adv_lib.reinforce_pp_advantages(tr, m, gamma=0.95),
      lambda r, tr, v, m: adv_lib.gae_advantages(tr, v, m, gamma=0.95, lam=0.9),
  ]
  for call in calls:
    eager = call(r, tr, v, m)
    jitted = jax.jit(call)(r, tr, v, m)
    for e, j in zip(eager, jitted):
      np.testing.assert_allclose(e, j, rtol=1e-5, atol=1e-6)
      assert np.all(np.isfinite(j))


def test_global_whiten_matches_masked_whiten_on_one_process():
  from distflow_jax.nodes.advantages import global_whiten
  rng = np.random.default_rng(3)
  x = rng.normal(size=(6, 5)).astype(np.float32)
  mask = rng.random((6, 5)) > 0.3
  want = np.asarray(masked.masked_whiten(jnp.asarray(x), jnp.asarray(mask)))
  ids = np.arange(6)
  got = global_whiten(x, mask, ids)
  np.testing.assert_allclose(got, want, atol=1e-5)
  # Rows in another order (as another layout would hold them): the same bits per sample.
  perm = np.array([4, 1, 5, 0, 3, 2])
  np.testing.assert_array_equal(global_whiten(x[perm], mask[perm], ids[perm]), got[perm])
