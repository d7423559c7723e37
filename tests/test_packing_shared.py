"""Packed passes with shared prompts (train/packing_shared.py, models/segments.py): a group's
prompt laid once per packed row, its responses after it, give the padded and the unpacked
shared passes' log-probs, values, gradients and train steps (einsum and blockwise attention,
1 device and the 8-device simulated mesh, token-budget micro-batches); the plan; a wrong
mask is caught; a tiny GRPO run with both switches on."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from distflow_jax.models import ModelConfig, Transformer, heads, segments, sharding
from distflow_jax.train import packing, placement, steps, token_budget
from loss_settings import actor_loss_settings

CFG = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True)
G, GS, PL, N = 4, 4, 7, 6  # groups, rows per group, prompt and response widths
B = G * GS


def make_batch(seed=0):
  """G groups of GS rows, one prompt per group (left-padded), long-tailed responses."""
  rng = np.random.default_rng(seed)
  prompt_len = rng.integers(2, PL + 1, size=G).repeat(GS)
  resp_len = rng.integers(0, N + 1, size=B)
  resp_len[0] = N
  prompt_mask = np.arange(PL)[None] >= (PL - prompt_len)[:, None]
  response_mask = np.arange(N)[None] < resp_len[:, None]
  prompts = rng.integers(1, 64, (G, PL)).repeat(GS, axis=0)
  return {
      "prompt_tokens": np.where(prompt_mask, prompts, 0).astype(np.int32),
      "prompt_mask": prompt_mask,
      "response_tokens": np.where(response_mask, rng.integers(1, 64, (B, N)), 0).astype(np.int32),
      "response_mask": response_mask,
      "advantages": (rng.normal(size=(B, N)) * response_mask).astype(np.float32),
      "returns": (rng.normal(size=(B, N)) * response_mask).astype(np.float32),
      "values": (rng.normal(size=(B, N)) * response_mask).astype(np.float32),
  }


def model(cfg=CFG):
  return nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))


def shared_plan(batch, pack_len=0, num_shards=1):
  return packing.plan(batch["prompt_mask"], batch["response_mask"], pack_len, num_shards, GS)


def logprobs(graphdef, params, batch, gs=GS):
  fn = jax.jit(lambda g, p, b: steps.response_logprobs(g, p, b, group_size=gs),
               static_argnums=0)
  return [np.asarray(x) for x in fn(graphdef, params, batch)]


def test_plan_lays_each_prompt_once_and_packs_tighter():
  batch = make_batch()
  pk, stats = shared_plan(batch, 32)  # every group fits one unit (7 + 4 * 5 tokens)
  _, plain = packing.plan(batch["prompt_mask"], batch["response_mask"], 32)
  seg, src, pos = pk["seg"], pk["src"], pk["pos"]
  p_plus_n = PL + N
  sample_S, col_S = src // p_plus_n, src % p_plus_n
  for g in range(G):
    rows = np.arange(g * GS, (g + 1) * GS)
    prompt_slots = (seg > 0) & np.isin(sample_S, rows) & (col_S < PL)
    # The group's prompt tokens: each real one laid exactly once, at positions 0 .. Lp - 1,
    # all carrying a prompt id (a multiple of PROMPT_STRIDE).
    cols = np.sort(col_S[prompt_slots])
    np.testing.assert_array_equal(cols, np.flatnonzero(batch["prompt_mask"][g * GS]))
    assert np.all(seg[prompt_slots] % segments.PROMPT_STRIDE == 0)
    np.testing.assert_array_equal(np.sort(pos[prompt_slots]), np.arange(len(cols)))
  # Every response token but each sample's last is laid once, after its prompt's positions.
  resp = (seg > 0) & (col_S >= PL)
  fed = np.maximum(batch["response_mask"].sum(1) - 1, 0)
  np.testing.assert_array_equal(np.bincount(sample_S[resp], minlength=B), fed)
  lp = batch["prompt_mask"].sum(1)
  np.testing.assert_array_equal(pos[resp], lp[sample_S[resp]] + col_S[resp] - PL)
  # `out`: response token 0 reads its group's last prompt slot, token t its own slot t - 1.
  flat_src = src.reshape(-1)[pk["out"]]
  for b in range(B):
    for t in np.flatnonzero(batch["response_mask"][b]):
      want = (b // GS * GS, PL - 1) if t == 0 else (b, PL + t - 1)
      got = (flat_src[b, t] // p_plus_n, flat_src[b, t] % p_plus_n)
      assert got[1] == want[1] and got[0] // GS == want[0] // GS and (t == 0 or got[0] == b)
  assert stats.useful == int((seg > 0).sum()) < plain.useful
  assert stats.packed < plain.packed and stats.pad_fraction < plain.pad_fraction


def test_groups_longer_than_a_row_spread_with_a_prompt_copy_per_row():
  """pack_len=12 < some groups: their responses go where rows have room, each row holding a
  piece of a group holds its prompt exactly once, and every fed token is still laid once."""
  batch = make_batch()
  pk, stats = shared_plan(batch, 12)
  seg, src = pk["seg"], pk["src"]
  sample_S, col_S = src // (PL + N), src % (PL + N)
  lp = batch["prompt_mask"].sum(1)
  copies = 0
  for r in range(seg.shape[0]):
    for g in set(sample_S[r][(seg[r] > 0)] // GS):
      here = (seg[r] > 0) & (sample_S[r] // GS == g)
      prompt = here & (col_S[r] < PL)
      assert prompt.sum() == lp[g * GS]  # the whole prompt, once
      assert (here & (col_S[r] >= PL)).any()  # and at least one response of the group
      copies += 1
  assert copies > G  # some group did not fit one row
  fed = np.maximum(batch["response_mask"].sum(1) - 1, 0)
  resp = (seg > 0) & (col_S >= PL)
  np.testing.assert_array_equal(np.bincount(sample_S[resp], minlength=B), fed)
  assert stats.useful == int((seg > 0).sum())


@pytest.mark.parametrize("impl,pack_len", [("einsum", 0), ("einsum", 12), ("blockwise", 0)])
def test_packed_shared_logprobs_match_padded_and_unpacked_shared(impl, pack_len):
  """pack_len=12 splits some groups into several units (each with its own prompt copy);
  blockwise with 8-slot blocks evaluates the mask block by block."""
  cfg = dataclasses.replace(CFG, attention_impl=impl, attention_block=8)
  graphdef, params = model(cfg)
  batch = make_batch(1)
  pk, _ = shared_plan(batch, pack_len)
  assert pk["seg"].max() % segments.PROMPT_STRIDE > 1  # several responses share a prompt
  ref_lp, ref_ent = logprobs(graphdef, params, batch, gs=1)
  shared_lp, _ = logprobs(graphdef, params, batch)
  lp, ent = logprobs(graphdef, params, {**batch, "pack": pk})
  np.testing.assert_allclose(lp, ref_lp, atol=1e-5)
  np.testing.assert_allclose(lp, shared_lp, atol=1e-5)
  np.testing.assert_allclose(ent, ref_ent, atol=1e-5)
  assert np.all(lp[~batch["response_mask"]] == 0)


def test_a_mask_letting_siblings_see_each_other_is_caught(monkeypatch):
  """The sentinel: with responses of one group seeing each other the log-probs move."""
  graphdef, params = model()
  batch = make_batch(1)
  pk, _ = shared_plan(batch)
  ref, _ = logprobs(graphdef, params, batch, gs=1)
  wrong = lambda q, k: segments.prompt_id(q)[:, :, None] == segments.prompt_id(k)[:, None, :]  # noqa: E731
  monkeypatch.setattr(segments, "visible", wrong)
  lp, _ = logprobs(graphdef, params, {**batch, "pack": pk})
  assert np.abs(lp - ref).max() > 1e-3


def test_packed_shared_values_match_padded():
  graphdef, params = nnx.split(heads.Critic(CFG, rngs=nnx.Rngs(0)))
  params["value_head"]["kernel"] = jnp.ones_like(params["value_head"]["kernel"][...]) * 0.1
  batch = make_batch(2)
  pk, _ = shared_plan(batch, 16)
  values = jax.jit(steps.response_values, static_argnums=0)
  v = values(graphdef, params, batch)
  v2 = values(graphdef, params, {**batch, "pack": pk})
  np.testing.assert_allclose(np.asarray(v2), np.asarray(v), atol=1e-5)


def _loss_fn(gs=GS):
  cfg = actor_loss_settings(kl_coef=0.1, entropy_coef=0.01, group_size=gs)
  return lambda g, p, mb: steps.actor_loss(g, p, mb, cfg, 512)  # noqa: E731


def _old(graphdef, params, batch):
  lp, _ = logprobs(graphdef, params, batch, gs=1)
  m = batch["response_mask"]
  return {**batch, "old_logprobs": lp - 0.01 * m, "ref_logprobs": lp + 0.02 * m}


@pytest.mark.parametrize("impl", ["einsum", "blockwise"])
def test_packed_shared_gradients_match_padded(impl):
  graphdef, params = model(dataclasses.replace(CFG, attention_impl=impl, attention_block=8))
  batch = _old(graphdef, params, make_batch(3))
  pk, _ = shared_plan(batch, 20)
  grad = lambda b, gs: jax.jit(jax.grad(  # noqa: E731
      lambda p: _loss_fn(gs)(graphdef, p, b).total))(params)
  ref = grad(batch, 1)
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(grad({**batch, "pack": pk}, GS))):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def _train(graphdef, params, batch, m, gs=GS):
  tx = optax.sgd(0.5)
  step = steps.make_train_step(_loss_fn(gs), graphdef, tx, m, "token-mean", gs)
  new_p, _, stats = step(jax.tree.map(jnp.copy, params), placement.init_opt_state(tx, params),
                         batch)
  assert int(stats["skipped"]) == 0 and int(stats["ungrouped"]) == 0
  return new_p, stats


def _assert_same(ref_p, new_p):
  for a, b in zip(jax.tree.leaves(ref_p), jax.tree.leaves(new_p)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def test_packed_shared_train_steps_match_padded():
  """Dealt micro-batches (2, whole groups) and token-budget micro-batches (groups kept in
  one micro-batch): the padded step's update."""
  graphdef, params = model()
  batch = _old(graphdef, params, make_batch(4))
  ref_p, ref_s = _train(graphdef, params, batch, 2, gs=1)
  pks, _ = packing.plan_parts(batch["prompt_mask"], batch["response_mask"], 16, 2, GS, 1, GS)
  assert pks["seg"].max() >= segments.PROMPT_STRIDE
  new_p, new_s = _train(graphdef, params, {**batch, "pack": pks}, 2)
  np.testing.assert_allclose(float(new_s["total"]), float(ref_s["total"]), atol=1e-5)
  _assert_same(ref_p, new_p)
  tb, _, tokens_DxM = token_budget.plan(batch["prompt_mask"], batch["response_mask"], 24, 16,
                                        1, GS)
  assert tokens_DxM.shape[1] > 1 and tb["seg"].max() >= segments.PROMPT_STRIDE
  new_p, _ = _train(graphdef, params, {**batch, "pack": tb}, None)
  _assert_same(ref_p, new_p)


def test_token_budget_keeps_groups_whole():
  batch = make_batch(5)
  tb, stats, tokens_DxM = token_budget.plan(batch["prompt_mask"], batch["response_mask"], 30,
                                            0, 2, GS)
  _, plain, _ = token_budget.plan(batch["prompt_mask"], batch["response_mask"], 30, 0, 2)
  for idx_S, valid_S in zip(tb["idx"], tb["valid"]):
    groups = set(idx_S[valid_S] // GS)
    for g in groups:  # a group with responses sits wholly in one micro-batch
      with_resp = [b for b in range(g * GS, (g + 1) * GS) if batch["response_mask"][b].sum() > 0]
      assert set(with_resp) <= set(idx_S[valid_S])
  assert stats.useful < plain.useful and tokens_DxM.sum() == stats.useful


def test_packed_shared_on_8_device_mesh_matches_padded():
  """Rows and parameters over 8 simulated devices (fsdp 2 x tensor 2 x data 2: 4 row shards,
  one group each), groups packed per shard: the padded single-device numbers."""
  assert jax.device_count() == 8
  graphdef, params = model()
  batch = _old(graphdef, params, make_batch(6))
  ref_lp, _ = logprobs(graphdef, params, batch, gs=1)
  # The padded update in 2 micro-batches: test_packed_shared_train_steps_match_padded's
  # reference program (one compile for both; the update is the one-batch update to 1e-5).
  ref_p, _ = _train(graphdef, params, batch, 2, gs=1)
  axes = {"data": 2, "fsdp": 2, "tensor": 2}
  mesh = sharding.make_mesh(axes)
  rows = P(("data", "fsdp"))
  sp = sharding.shard_state(jax.tree.map(jnp.copy, params), mesh, sharding.fsdp_tp_rules())
  data = {k: jax.device_put(v, NamedSharding(mesh, rows)) for k, v in batch.items()}
  rep = NamedSharding(mesh, P())
  pk, _ = shared_plan(batch, 0, 4)
  assert pk["seg"].shape[0] % 4 == 0
  lp_fn = jax.jit(placement.rows_sharded_on(
      lambda g, p, b: steps.response_logprobs(g, p, b, group_size=GS)[0], mesh),
      static_argnums=0)
  lp = lp_fn(graphdef, sp, {**data, "pack": jax.device_put(pk, rep)})
  np.testing.assert_allclose(np.asarray(lp), ref_lp, atol=1e-5)
  tb, _, _ = token_budget.plan(batch["prompt_mask"], batch["response_mask"], 24, 0, 4, GS)
  new_p, _ = _train(graphdef, sp, {**data, "pack": jax.device_put(tb, rep)}, None)
  _assert_same(ref_p, new_p)


def test_config_takes_packing_with_shared_prompts():
  from distflow_jax.config import loading
  from distflow_jax.config.values import check_values
  check_values(loading.load("grpo:tiny", ["model.pack_sequences=True", "rollout.n=2",
                                          "model.share_prompt_prefix=True",
                                          "actor.micro_batch_tokens=64"]))
  cfg = loading.load("grpo:tiny", ["model.pack_sequences=True", "rollout.n=2",
                                   "trainer.deterministic=True"])
  with pytest.raises(loading.ConfigError, match="trainer.deterministic"):
    check_values(cfg)


@pytest.mark.timeout(600)
def test_grpo_trains_packed_with_shared_prompts(tmp_path):
  """One tiny GRPO step with both switches on (old log-probs recomputed, reference KL,
  token-budget micro-batches): finite metrics, the prompts shared and packed."""
  import math

  from distflow_jax.config import loading
  from distflow_jax.run import trainer
  from workflow_util import smoke_overrides
  cfg = loading.load("grpo:tiny", smoke_overrides(
      tmp_path, "cluster.devices_per_process=8", "model.pack_sequences=True",
      "model.share_prompt_prefix=True", "data.prompts_per_step=8", "rollout.n=2",
      "trainer.total_steps=1", "actor.recompute_old_logprobs=True",
      "actor.micro_batch_tokens=64", "actor.entropy_coef=0.01"))
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  (m,) = list(trainer.train(ctx, loaders))
  assert math.isfinite(m["actor/loss"]) and m["actor/skipped"] == 0.0
  assert math.isfinite(m["actor/grad_norm"])
  for node in ("old_logprob", "ref_logprob", "train_actor"):
    assert m[f"prompt_group/{node}"] == 2.0
    assert 0.0 <= m[f"pad_fraction/{node}"] < 1.0
