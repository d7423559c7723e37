"""Actor / critic steps: exact micro-batch accumulation, NaN guard, one compile, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from distflow_jax.models import ModelConfig, Transformer
from distflow_jax.models import heads, sharding
from distflow_jax.train import hidden, steps
from loss_settings import actor_loss_settings

# Small enough to compile fast; Qwen2-shaped (QKV bias, GQA).
CFG = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=64, intermediate_size=128,
                  num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True)
B, PL, N = 8, 6, 5


def make_batch(seed=0):
  rng = np.random.default_rng(seed)
  prompt_len = rng.integers(2, PL + 1, size=B)
  resp_len = rng.integers(1, N + 1, size=B)
  prompt_mask = np.arange(PL)[None] >= (PL - prompt_len)[:, None]  # left padded
  response_mask = np.arange(N)[None] < resp_len[:, None]
  batch = {
      "prompt_tokens": np.where(prompt_mask, rng.integers(1, 64, (B, PL)), 0).astype(np.int32),
      "prompt_mask": prompt_mask,
      "response_tokens": np.where(response_mask, rng.integers(1, 64, (B, N)), 0).astype(np.int32),
      "response_mask": response_mask,
      "advantages": (rng.normal(size=(B, N)) * response_mask).astype(np.float32),
      "returns": (rng.normal(size=(B, N)) * response_mask).astype(np.float32),
  }
  return batch


def model_and_params(seed=0):
  graphdef, params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(seed)))
  return graphdef, params


def with_old_logprobs(graphdef, params, batch):
  lp, _ = jax.jit(steps.response_logprobs, static_argnums=0)(graphdef, params, batch)
  return {**batch, "old_logprobs": np.asarray(lp), "ref_logprobs": np.asarray(lp)}


def test_response_logprobs_match_full_forward():
  graphdef, params = model_and_params()
  batch = make_batch()
  lp, ent = jax.jit(steps.response_logprobs, static_argnums=0)(graphdef, params, batch)
  lp = np.asarray(lp)

  @jax.jit
  def full_logp(params, batch):
    tokens, mask, positions = hidden.sequence_inputs(batch)
    logits, _ = nnx.merge(graphdef, params)(tokens, positions, mask)
    return jax.nn.log_softmax(logits.astype(jnp.float32), -1)
  logp_all = np.asarray(full_logp(params, batch))  # indexed on the host, not per element
  for b in range(B):
    for t in range(N):
      if batch["response_mask"][b, t]:
        want = logp_all[b, PL - 1 + t, batch["response_tokens"][b, t]]
        np.testing.assert_allclose(lp[b, t], want, atol=1e-5)
      else:
        assert lp[b, t] == 0.0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_give_the_full_batch_update(agg):
  graphdef, params = model_and_params()
  batch = with_old_logprobs(graphdef, params, make_batch())
  loss_cfg = actor_loss_settings(loss_agg=agg, kl_coef=0.1)
  loss_fn = lambda g, p, mb: steps.actor_loss(g, p, mb, loss_cfg, 512)  # noqa: E731
  tx = optax.sgd(1.0)
  results = []
  for m in (1, 4):
    p = jax.tree.map(jnp.copy, params)
    step = steps.make_train_step(loss_fn, graphdef, tx, m, agg)
    new_p, _, stats = step(p, tx.init(p), batch)
    results.append((new_p, stats))
  (p1, s1), (p4, s4) = results
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)):
    np.testing.assert_allclose(a, b, atol=2e-6)
  np.testing.assert_allclose(s1["total"], s4["total"], rtol=1e-5)
  assert float(s1["count"]) == float(s4["count"])


def test_nan_step_is_skipped_and_params_unchanged():
  graphdef, params = model_and_params()
  batch = with_old_logprobs(graphdef, params, make_batch())
  batch["advantages"] = batch["advantages"].copy()
  batch["advantages"][0, 0] = np.nan  # a real token (every response has >= 1)
  loss_cfg = actor_loss_settings()
  tx = optax.sgd(0.5)  # test_sharded_fsdp_step_equals_unsharded's step: one compile for both
  step = steps.make_train_step(lambda g, p, mb: steps.actor_loss(g, p, mb, loss_cfg, 512),
                               graphdef, tx, 2, "token-mean")
  before = jax.tree.map(np.asarray, params)
  new_p, _, stats = step(jax.tree.map(jnp.copy, params), tx.init(params), batch)
  assert int(stats["skipped"]) == 1
  for a, b in zip(jax.tree.leaves(new_p), jax.tree.leaves(before)):
    np.testing.assert_array_equal(a, b)
  report = steps.finalize_stats(stats, "train_actor")
  assert report["skipped"] == 1.0


def test_policy_improves_and_compiles_once():
  graphdef, params = model_and_params()
  batch = make_batch()
  batch["advantages"] = batch["response_mask"].astype(np.float32)  # reinforce everything
  loss_cfg = actor_loss_settings(clip_ratio_low=10.0 / 11, clip_ratio_high=10.0)
  tx = optax.adam(3e-3)
  step = steps.make_train_step(lambda g, p, mb: steps.actor_loss(g, p, mb, loss_cfg, 512),
                               graphdef, tx, 2, "token-mean")
  lp_fn = jax.jit(steps.response_logprobs, static_argnums=0)
  opt = tx.init(params)
  first = float(jnp.sum(lp_fn(graphdef, params, batch)[0]))
  for _ in range(4):
    b = with_old_logprobs(graphdef, params, batch)
    params, opt, stats = step(params, opt, b)
    assert int(stats["skipped"]) == 0
  last = float(jnp.sum(lp_fn(graphdef, params, batch)[0]))
  assert last > first + 1.0, (first, last)
  assert step._cache_size() == 1


def test_critic_step_reduces_value_error():
  critic = heads.Critic(CFG, rngs=nnx.Rngs(1))
  graphdef, params = nnx.split(critic)
  batch = make_batch()
  batch["returns"] = 0.5 * batch["response_mask"].astype(np.float32)
  tx = optax.adam(1e-3)
  step = steps.make_train_step(lambda g, p, mb: steps.critic_loss(g, p, mb, 0.0),
                               graphdef, tx, 2, "token-mean")
  opt = tx.init(params)
  errs = []
  values_fn = jax.jit(steps.response_values, static_argnums=0)
  for _ in range(5):
    values = np.asarray(values_fn(graphdef, params, batch))
    errs.append(float(np.sum((values - batch["returns"]) ** 2 * batch["response_mask"])))
    params, opt, stats = step(params, opt, {**batch, "values": values})
  assert errs[-1] < errs[0] * 0.5, errs


def test_sharded_fsdp_step_equals_unsharded():
  graphdef, params = model_and_params()
  batch = with_old_logprobs(graphdef, params, make_batch())
  loss_cfg = actor_loss_settings()
  tx = optax.sgd(0.5)
  fn = lambda g, p, mb: steps.actor_loss(g, p, mb, loss_cfg, 512)  # noqa: E731
  ref_p, _, _ = steps.make_train_step(fn, graphdef, tx, 2, "token-mean")(
      jax.tree.map(jnp.copy, params), tx.init(params), batch)

  mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
  sp = sharding.shard_state(jax.tree.map(jnp.copy, params), mesh, sharding.fsdp_tp_rules())
  data = {k: jax.device_put(v, NamedSharding(mesh, P("fsdp"))) for k, v in batch.items()}
  new_p, _, _ = steps.make_train_step(fn, graphdef, tx, 2, "token-mean")(sp, tx.init(sp), data)
  for a, b in zip(jax.tree.leaves(ref_p), jax.tree.leaves(new_p)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
