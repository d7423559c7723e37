"""The loss mask (train/loss_mask.py): a multi-turn episode's observation tokens are in the
sequence (the model attends to them) but never trained on: no loss, KL, entropy, count or
gradient comes from their positions."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from distflow_jax.algos import advantages as adv_lib
from distflow_jax.train import steps
from loss_settings import actor_loss_settings
from distflow_jax.train.loss_mask import loss_mask
from test_train_steps import B, N, make_batch, model_and_params, with_old_logprobs

pytestmark = pytest.mark.timeout(300)


def episode_batch(seed=0):
  """make_batch's rows with observation tokens: response positions 1 and 3 (where real)
  were written by an environment, not generated (position 0 stays generated)."""
  graphdef, params = model_and_params()
  batch = with_old_logprobs(graphdef, params, make_batch(seed))
  obs = np.zeros((B, N), bool)
  obs[:, [1, 3]] = True
  batch["loss_mask"] = batch["response_mask"] & ~obs
  assert (batch["response_mask"] & obs).any()
  return graphdef, params, batch, batch["response_mask"] & obs


def _step(graphdef, params, batch, agg="token-mean"):
  cfg = actor_loss_settings(loss_agg=agg, kl_coef=0.5, entropy_coef=0.01)
  loss_fn = lambda g, p, mb: steps.actor_loss(g, p, mb, cfg, 512)  # noqa: E731
  tx = optax.sgd(1.0)
  p = jax.tree.map(jnp.copy, params)
  new_p, _, stats = steps.make_train_step(loss_fn, graphdef, tx, 2, agg)(p, tx.init(p), batch)
  return new_p, jax.device_get(stats)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_observation_positions_reach_no_loss_and_no_gradient(agg):
  graphdef, params, batch, obs = episode_batch()
  p1, s1 = _step(graphdef, params, batch, agg)
  # Whatever the per-token inputs say at observation positions, the update is the same.
  rng = np.random.default_rng(1)
  noisy = dict(batch)
  for k in ("advantages", "old_logprobs", "ref_logprobs"):
    noisy[k] = np.where(obs, rng.normal(size=(B, N)) * 50, batch[k]).astype(np.float32)
  p2, s2 = _step(graphdef, params, noisy, agg)
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(s1["total"], s2["total"])
  # The loss counts generated tokens only.
  assert float(s1["token_count"]) == batch["loss_mask"].sum() < batch["response_mask"].sum()


def test_observation_tokens_are_context():
  """Masked out of the loss, not out of the sequence: changing an observation token changes
  the log-probs of the generated tokens after it."""
  graphdef, params, batch, obs = episode_batch()
  logprobs = jax.jit(steps.response_logprobs, static_argnums=0)
  lp1, _ = logprobs(graphdef, params, batch)
  other = dict(batch, response_tokens=np.where(obs, (batch["response_tokens"] + 7) % 64,
                                               batch["response_tokens"]).astype(np.int32))
  lp2, _ = logprobs(graphdef, params, other)
  after = batch["loss_mask"] & (np.arange(N)[None] > 1)
  assert not np.allclose(np.asarray(lp1)[after], np.asarray(lp2)[after])


def test_gae_skips_observation_tokens_like_padding():
  _, _, batch, obs = episode_batch()
  m = loss_mask({k: jnp.asarray(v) for k, v in batch.items()})
  rewards = adv_lib.outcome_to_token_rewards(jnp.ones((B,)), m)
  values = jnp.asarray(np.random.default_rng(2).normal(size=(B, N)), jnp.float32)
  out = adv_lib.gae_advantages(rewards, values, m, whiten=False)
  assert (np.asarray(out.advantages_BxT)[obs] == 0).all()
  # the reward sits on the last generated token, not on a trailing observation
  last = np.asarray(rewards).argmax(1)
  assert np.asarray(m)[np.arange(B), last].all()


def test_per_turn_rewards_reach_gae_where_they_were_earned():
  """A multi-turn episode's turn rewards (``placed_rewards``, on each turn's last generated
  token) stay there; the rest of the reward goes on the last token.  With gamma = lam = 1
  and zero values, GAE's advantage at a token is the reward still to come."""
  from distflow_jax.nodes.advantages import token_rewards_of
  #            gen  gen  obs  gen  gen  obs  gen  pad
  mask = jnp.asarray([[1, 1, 0, 1, 1, 0, 1, 0]], jnp.float32)
  placed = jnp.asarray([[0, 1.0, 0, 0, 2.0, 0, 0, 0]], jnp.float32)
  tr = token_rewards_of(jnp.asarray([3.5]), placed, mask)  # 3 from turns + 0.5 outcome
  np.testing.assert_allclose(tr, [[0, 1.0, 0, 0, 2.0, 0, 0.5, 0]])
  adv = adv_lib.gae_advantages(tr, jnp.zeros_like(tr), mask, whiten=False).advantages_BxT
  np.testing.assert_allclose(adv, [[3.5, 3.5, 0, 2.5, 2.5, 0, 0.5, 0]])
  # without placement the whole reward is the last token's (what an outcome gives)
  np.testing.assert_allclose(token_rewards_of(jnp.asarray([3.5]), None, mask),
                             [[0, 0, 0, 0, 0, 0, 3.5, 0]])
