"""Packed (padding-free) passes give the padded passes' numbers: log-probs, values, gradients,
train steps, on one device and on the 8-device simulated mesh; the plan itself; the config
switch and its refusals; a tiny GRPO run with packing on."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from distflow_jax.models import ModelConfig, Transformer, heads, sharding
from distflow_jax.train import micro_batches, packing, placement, steps
from loss_settings import actor_loss_settings

CFG = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True)
B, PL, N = 16, 7, 6


def make_batch(seed=0, b=B):
  rng = np.random.default_rng(seed)
  prompt_len = rng.integers(1, PL + 1, size=b)
  resp_len = rng.integers(0, N + 1, size=b)
  resp_len[0] = N  # one full-length sample
  prompt_mask = np.arange(PL)[None] >= (PL - prompt_len)[:, None]
  response_mask = np.arange(N)[None] < resp_len[:, None]
  return {
      "prompt_tokens": np.where(prompt_mask, rng.integers(1, 64, (b, PL)), 0).astype(np.int32),
      "prompt_mask": prompt_mask,
      "response_tokens": np.where(response_mask, rng.integers(1, 64, (b, N)), 0).astype(np.int32),
      "response_mask": response_mask,
      "advantages": (rng.normal(size=(b, N)) * response_mask).astype(np.float32),
      "returns": (rng.normal(size=(b, N)) * response_mask).astype(np.float32),
      "values": (rng.normal(size=(b, N)) * response_mask).astype(np.float32),
  }


def model(seed=0, cfg=CFG):
  return nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))


def with_plan(batch, pack_len=0, num_shards=1):
  pk, stats = packing.plan(batch["prompt_mask"], batch["response_mask"], pack_len, num_shards)
  return {**batch, "pack": pk}, stats


def test_plan_covers_every_token_once_and_rows_shrink():
  batch = make_batch()
  pk, stats = packing.plan(batch["prompt_mask"], batch["response_mask"], 16)
  tokens = np.concatenate([batch["prompt_tokens"], batch["response_tokens"]], 1).reshape(-1)
  src = pk["src"][pk["seg"] > 0]
  assert len(np.unique(src)) == len(src) == stats.useful
  assert stats.packed == pk["seg"].size and stats.packed < stats.padded
  assert 0 <= stats.pad_fraction < stats.padded_pad_fraction
  # Positions restart at 0 in each segment and count up.
  for r in range(pk["seg"].shape[0]):
    for s in set(pk["seg"][r]) - {0}:
      np.testing.assert_array_equal(pk["pos"][r][pk["seg"][r] == s],
                                    np.arange((pk["seg"][r] == s).sum()))
  # `out` points at the slot holding the token just before each response token.
  m = batch["response_mask"]
  p_plus_n = PL + N
  slot_src = pk["src"].reshape(-1)[pk["out"]]
  for b in range(B):
    for t in np.flatnonzero(m[b]):
      full = np.concatenate([batch["prompt_mask"][b], m[b]])
      cols = np.flatnonzero(full)
      k = int(np.flatnonzero(cols == PL + t)[0])
      assert slot_src[b, t] == b * p_plus_n + cols[k - 1]
  assert tokens.shape[0] == B * p_plus_n


def test_plan_per_shard_keeps_rows_on_their_shard_and_refuses_long_samples():
  batch = make_batch()
  pk, _ = packing.plan(batch["prompt_mask"], batch["response_mask"], 0, num_shards=4)
  rows = pk["seg"].shape[0]
  assert rows % 4 == 0
  per = rows // 4
  for s in range(4):
    srcs = pk["src"][s * per:(s + 1) * per][pk["seg"][s * per:(s + 1) * per] > 0]
    assert np.all(srcs // (PL + N) // (B // 4) == s)
  with pytest.raises(ValueError, match="model.pack_len=4 is shorter than a sample"):
    packing.plan(batch["prompt_mask"], batch["response_mask"], 4)


def test_deal_rows_np_matches_deal_rows():
  x = np.arange(24 * 3).reshape(24, 3)
  for m, block in ((2, 1), (3, 2), (4, 3), (5, 1) if 24 % 5 == 0 else (6, 4)):
    np.testing.assert_array_equal(packing.deal_rows_np(x, m, block),
                                  np.asarray(micro_batches.deal_rows({"x": x}, m, block)["x"]))


def test_bucket_rows():
  assert [packing.bucket_rows(n) for n in (0, 1, 4, 5, 8, 9, 17, 100)] == [1, 1, 4, 5, 8, 10, 20, 112]


@pytest.mark.parametrize("impl", ["xla", "einsum"])
@pytest.mark.parametrize("pack_len", [0, 16])
def test_packed_logprobs_match_padded(impl, pack_len):
  import dataclasses
  cfg = dataclasses.replace(CFG, attention_impl=impl)
  graphdef, params = model(cfg=cfg)
  batch = make_batch(1)
  packed, _ = with_plan(batch, pack_len)
  lp, ent = jax.jit(steps.response_logprobs, static_argnums=0)(graphdef, params, batch)
  lp2, ent2 = jax.jit(steps.response_logprobs, static_argnums=0)(graphdef, params, packed)
  np.testing.assert_allclose(np.asarray(lp2), np.asarray(lp), atol=1e-5)
  np.testing.assert_allclose(np.asarray(ent2), np.asarray(ent), atol=1e-5)
  assert np.all(np.asarray(lp2)[~batch["response_mask"]] == 0)


def test_packed_values_match_padded():
  graphdef, params = nnx.split(heads.Critic(CFG, rngs=nnx.Rngs(0)))
  # A non-zero value head, so the values depend on the hidden states.
  params["value_head"]["kernel"] = jnp.ones_like(params["value_head"]["kernel"][...]) * 0.1
  batch = make_batch(2)
  packed, _ = with_plan(batch, 16)
  values = jax.jit(steps.response_values, static_argnums=0)
  v = values(graphdef, params, batch)
  v2 = values(graphdef, params, packed)
  np.testing.assert_allclose(np.asarray(v2), np.asarray(v), atol=1e-5)


def _actor_loss_fn():
  loss_cfg = actor_loss_settings(kl_coef=0.1, entropy_coef=0.01)
  return lambda g, p, mb: steps.actor_loss(g, p, mb, loss_cfg, 512)  # noqa: E731


def _old(graphdef, params, batch):
  lp, _ = jax.jit(steps.response_logprobs, static_argnums=0)(graphdef, params, batch)
  lp = np.asarray(lp)
  return {**batch, "old_logprobs": lp - 0.01 * batch["response_mask"],
          "ref_logprobs": lp + 0.02 * batch["response_mask"]}


def test_packed_gradients_match_padded():
  graphdef, params = model()
  batch = _old(graphdef, params, make_batch(3))
  packed, _ = with_plan(batch, 20)
  fn = _actor_loss_fn()
  grad = lambda b: jax.jit(jax.grad(lambda p: fn(graphdef, p, b).total))(params)  # noqa: E731
  for a, b in zip(jax.tree.leaves(grad(batch)), jax.tree.leaves(grad(packed))):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def _train(graphdef, params, batch, m, critic=False):
  tx = optax.sgd(0.5)
  fn = ((lambda g, p, mb: steps.critic_loss(g, p, mb, 0.2)) if critic  # noqa: E731
        else _actor_loss_fn())
  step = steps.make_train_step(fn, graphdef, tx, m, "token-mean")
  new_p, _, stats = step(jax.tree.map(jnp.copy, params), placement.init_opt_state(tx, params),
                         batch)
  return new_p, stats


@pytest.mark.parametrize("m", [1, 2])
def test_packed_train_step_matches_padded(m):
  graphdef, params = model()
  batch = _old(graphdef, params, make_batch(4))
  pk, _ = packing.plan_parts(batch["prompt_mask"], batch["response_mask"], 16, m)
  ref_p, ref_s = _train(graphdef, params, batch, m)
  new_p, new_s = _train(graphdef, params, {**batch, "pack": pk}, m)
  assert int(new_s["skipped"]) == 0
  np.testing.assert_allclose(float(new_s["total"]), float(ref_s["total"]), atol=1e-5)
  for a, b in zip(jax.tree.leaves(ref_p), jax.tree.leaves(new_p)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def test_packed_critic_step_matches_padded():
  graphdef, params = nnx.split(heads.Critic(CFG, rngs=nnx.Rngs(0)))
  params["value_head"]["kernel"] = jnp.ones_like(params["value_head"]["kernel"][...]) * 0.1
  batch = make_batch(5)
  pk, _ = packing.plan_parts(batch["prompt_mask"], batch["response_mask"], 0, 2)
  ref_p, _ = _train(graphdef, params, batch, 2, critic=True)
  new_p, _ = _train(graphdef, params, {**batch, "pack": pk}, 2, critic=True)
  for a, b in zip(jax.tree.leaves(ref_p), jax.tree.leaves(new_p)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def test_packed_on_8_device_mesh_matches_single_device():
  """The batch's rows and the parameters sharded over 8 simulated devices (fsdp 4 x
  tensor 2, and data 8), rows packed per shard: the padded single-device numbers."""
  assert jax.device_count() == 8
  graphdef, params = model()
  batch = _old(graphdef, params, make_batch(6))
  ref_lp, _ = jax.jit(steps.response_logprobs, static_argnums=0)(graphdef, params, batch)
  ref_p, _ = _train(graphdef, params, batch, 2)
  for axes, shards in (({"fsdp": 4, "tensor": 2}, 4), ({"data": 8}, 8)):
    mesh = sharding.make_mesh(axes)
    rows = P(tuple(axes)[0])
    sp = sharding.shard_state(jax.tree.map(jnp.copy, params), mesh, sharding.fsdp_tp_rules())
    data = {k: jax.device_put(v, NamedSharding(mesh, rows)) for k, v in batch.items()}
    pk, _ = packing.plan(batch["prompt_mask"], batch["response_mask"], 0, shards)
    lp_fn = jax.jit(placement.rows_sharded_on(
        lambda g, p, b: steps.response_logprobs(g, p, b)[0], mesh), static_argnums=0)
    lp = lp_fn(graphdef, sp, {**data, "pack": jax.device_put(pk, NamedSharding(mesh, P()))})
    np.testing.assert_allclose(np.asarray(lp), np.asarray(ref_lp), atol=1e-5)
    pks, _ = packing.plan_parts(batch["prompt_mask"], batch["response_mask"], 0, 2, 1, shards)
    new_p, _ = _train(graphdef, sp, {**data, "pack": jax.device_put(pks, NamedSharding(mesh, P()))}, 2)
    for a, b in zip(jax.tree.leaves(ref_p), jax.tree.leaves(new_p)):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def test_segment_ids_refused_with_a_cache():
  graphdef, params = model()
  t = jnp.ones((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="segment_ids"):
    Transformer.__call__(nnx.merge(graphdef, params), t, jnp.arange(4)[None], return_kv=True,
                         segment_ids_BxT=t)


def test_config_refuses_packing_with_deterministic_and_short_rows():
  from distflow_jax.config import loading
  from distflow_jax.config.values import check_values
  cfg = loading.load("grpo:tiny", ["model.pack_sequences=True", "rollout.n=2",
                                   "model.share_prompt_prefix=False",
                                   "trainer.deterministic=True"])
  with pytest.raises(loading.ConfigError, match="trainer.deterministic"):
    check_values(cfg)
  cfg = loading.load("grpo:tiny", ["model.pack_sequences=True", "model.pack_len=8",
                                   "model.share_prompt_prefix=False"])
  with pytest.raises(loading.ConfigError, match="model.pack_len=8 is shorter"):
    check_values(cfg)
  check_values(loading.load("grpo:tiny", ["model.pack_sequences=True",
                                          "model.share_prompt_prefix=False"]))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_grpo_and_ppo_train_packed(tmp_path):
  """A tiny GRPO run (2 steps, old log-probs recomputed, reference KL, 2 mini-batches) and
  a PPO step (values, critic) with packing on: finite losses, pad_fraction logged."""
  import math

  from distflow_jax.config import loading
  from distflow_jax.run import trainer
  from workflow_util import smoke_overrides
  common = ("cluster.devices_per_process=8", "model.pack_sequences=True",
            "model.share_prompt_prefix=False", "actor.micro_batch_size=1")
  for name, extra, nodes in (
      ("grpo:tiny", ("data.prompts_per_step=8", "rollout.n=2", "trainer.total_steps=2",
                     "actor.recompute_old_logprobs=True", "actor.mini_batches=2",
                     "actor.entropy_coef=0.01"),
       ("old_logprob", "ref_logprob", "train_actor")),
      ("ppo:tiny", ("data.prompts_per_step=8", "critic.micro_batch_size=1",
                    "trainer.total_steps=1"),
       ("values", "train_critic", "train_actor"))):
    cfg = loading.load(name, smoke_overrides(tmp_path / name.split(":")[0], *common, *extra))
    ctx, loaders = trainer.setup(cfg, log=lambda m: None)
    metrics = list(trainer.train(ctx, loaders))
    assert [m["step"] for m in metrics] == list(range(1, cfg.trainer.total_steps + 1))
    for m in metrics:
      assert math.isfinite(m["actor/loss"]) and m["actor/skipped"] == 0.0
      for node in nodes:
        assert node in ctx.plan.order
        frac, padded = m[f"pad_fraction/{node}"], m[f"pad_fraction_padded/{node}"]
        assert 0.0 <= frac < 1.0 and 0.0 <= padded < 1.0
        assert frac <= padded + 0.25  # bucketed rows: at most a quarter more
      if name == "ppo:tiny":
        assert math.isfinite(m["critic/loss"])
