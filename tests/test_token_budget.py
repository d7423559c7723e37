"""Token-budget micro-batches (``<role>.micro_batch_tokens``, train/token_budget.py): the
assignment keeps every micro-batch within the budget, balances them and gives every shard
the same count; the train step's update equals the row micro-batches' and the padded
step's (1 device and the 8-device simulated mesh); the config refusals; a tiny GRPO run."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from distflow_jax.models import heads, sharding
from distflow_jax.train import packing, placement, steps, token_budget
from loss_settings import actor_loss_settings
from test_packing import CFG, N, _old, make_batch, model

PACK_LEN = 16


def long_tailed_lengths(seed, b, pack_len):
  """Many short samples and a few near pack_len (RL response lengths)."""
  rng = np.random.default_rng(seed)
  lengths = np.minimum(rng.pareto(1.2, size=b) * 6 + 2, pack_len).astype(np.int64)
  lengths[rng.integers(0, b, size=3)] = 0  # no response: in no micro-batch
  return lengths


@pytest.mark.parametrize("budget", [40, 64, 100])
def test_assignment_within_budget_balanced_equal_count(budget):
  lengths = long_tailed_lengths(0, 128, 48)
  shards = 4
  parts = token_budget.assign(lengths, budget, 48, shards)
  m = len(parts[0])
  assert all(len(part) == m for part in parts)
  rows = token_budget.rows_per_micro_batch(budget, 48)
  tokens_DxM = token_budget.tokens_per_micro_batch(lengths, parts)
  per = 128 // shards
  for s, part in enumerate(parts):
    placed = sorted(x for micro in part for row in micro for x in row)
    on_shard = [x for x in range(s * per, (s + 1) * per) if lengths[x] > 0]
    assert placed == on_shard  # every sample with a response once, on its own shard
    for micro, tokens in zip(part, tokens_DxM[s]):
      assert len(micro) == rows
      assert all(lengths[row].sum() <= 48 for row in micro)
      # Within the budget, or one sample longer than it, alone.
      assert tokens <= budget or sum(map(len, micro)) == 1
    # Balanced: no micro-batch is more than a longest sample above the emptiest.
    assert tokens_DxM[s].max() - tokens_DxM[s].min() <= lengths[on_shard].max()
  # Few micro-batches: bucketed up from the fewest the fullest shard could need (+1 slack).
  need = max(-(-int(lengths[s * per:(s + 1) * per].sum()) // budget) for s in range(shards))
  assert need <= m <= packing.bucket_rows(need + 1)


def test_row_micro_batches_are_less_even_than_token_budget():
  """The motivation, measured: over long-tailed lengths, round-robin row micro-batches of
  the same count hold far more unequal token counts than the budget's."""
  lengths = long_tailed_lengths(1, 64, 48)
  parts = token_budget.assign(lengths, 80, 48, 1)
  tokens = token_budget.tokens_per_micro_batch(lengths, parts)[0]
  m = len(tokens)
  rows = np.array([lengths[j::m].sum() for j in range(m)])  # rows dealt round robin
  assert tokens.max() <= 80 < rows.max()
  assert tokens.max() - tokens.min() < rows.max() - rows.min()


def test_sample_longer_than_budget_is_alone_and_rows_round_up():
  lengths = np.array([30, 5, 5, 5, 4, 3, 0, 2])
  parts = token_budget.assign(lengths, 12, 32, 1)
  (part,) = parts
  alone = [micro for micro in part if 0 in [x for row in micro for x in row]]
  assert alone == [[[0]]]  # R = ceil(12 / 32) = 1 row; the 30-token sample by itself
  assert all(lengths[[x for row in micro for x in row]].sum() <= 12
             for micro in part if micro is not alone[0])
  assert token_budget.rows_per_micro_batch(33, 16) == 3
  with pytest.raises(ValueError, match="model.pack_len=16 is shorter than a sample of 30"):
    token_budget.assign(lengths, 64, 16, 1)


def test_plan_slots_gather_each_sample_once_with_its_tokens():
  batch = make_batch(7)
  pk, stats, tokens_DxM = token_budget.plan(batch["prompt_mask"], batch["response_mask"],
                                            20, PACK_LEN, 2)
  m, s = pk["idx"].shape
  assert pk["seg"].shape == (m, 2 * 2, PACK_LEN)  # 2 shards x ceil(20 / 16) rows
  assert pk["out"].shape == (m, s, N)
  real = batch["response_mask"].any(axis=1)
  chosen = pk["idx"][pk["valid"]]
  assert sorted(chosen) == list(np.flatnonzero(real))
  half = s // 2  # shard-major slots: shard 0's samples first
  assert np.all(pk["idx"][:, :half][pk["valid"][:, :half]] < 8)
  assert np.all(pk["idx"][:, half:][pk["valid"][:, half:]] >= 8)
  tokens = np.concatenate([batch["prompt_tokens"], batch["response_tokens"]], 1)
  for j in range(m):
    gathered = tokens[pk["idx"][j]].reshape(-1)
    per_row = (pk["seg"][j] > 0).sum(axis=1)
    assert np.all(per_row <= PACK_LEN)
    assert np.array_equal(np.sort(gathered[pk["src"][j][pk["seg"][j] > 0]]),
                          np.sort(np.concatenate(
                              [tokens[b][np.concatenate([batch["prompt_mask"][b],
                                                         batch["response_mask"][b]])][:-1]
                               for b, ok in zip(pk["idx"][j], pk["valid"][j]) if ok]
                              + [np.zeros(0, np.int32)])))
  assert tokens_DxM.max() <= 20 and stats.useful == tokens_DxM.sum()
  assert stats.packed == pk["seg"].size


def _step(graphdef, params, batch, m, agg="token-mean", critic=False, ratio_level="token"):
  tx = optax.sgd(0.5)
  if critic:
    fn = lambda g, p, mb: steps.critic_loss(g, p, mb, 0.2)  # noqa: E731
  else:
    cfg = actor_loss_settings(kl_coef=0.1, entropy_coef=0.01, loss_agg=agg, norm_length=float(N),
                          ratio_level=ratio_level)
    fn = lambda g, p, mb: steps.actor_loss(g, p, mb, cfg, 512)  # noqa: E731
  step = steps.make_train_step(fn, graphdef, tx, m, agg)
  new_p, _, stats = step(jax.tree.map(jnp.copy, params), placement.init_opt_state(tx, params),
                         batch)
  assert int(stats["skipped"]) == 0
  return new_p, stats


def _close(a_tree, b_tree):
  for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def _budget(batch, budget, shards=1, pack_len=PACK_LEN):
  pk, _, _ = token_budget.plan(batch["prompt_mask"], batch["response_mask"], budget,
                               pack_len, shards)
  return pk


@pytest.fixture(scope="module")
def actor_case():
  """A model, a batch with old and reference log-probs, and its padded one-micro-batch
  update and stats (the reference of the actor tests, computed once)."""
  graphdef, params = model()
  batch = _old(graphdef, params, make_batch(4))
  return graphdef, params, batch, *_step(graphdef, params, batch, 1)


def test_token_budget_step_matches_row_micro_batches_and_padded(actor_case):
  graphdef, params, batch, ref_p, ref_s = actor_case
  pk = _budget(batch, 24)
  assert pk["idx"].shape[0] >= 3  # several micro-batches of unequal row counts
  rows_pk, _ = packing.plan_parts(batch["prompt_mask"], batch["response_mask"], PACK_LEN, 2)
  row_p, _ = _step(graphdef, params, {**batch, "pack": rows_pk}, 2)
  new_p, new_s = _step(graphdef, params, {**batch, "pack": pk}, None)
  for k in ("total", "count", "token_count", "m/entropy", "m/kl", "m/pg_clipfrac"):
    np.testing.assert_allclose(float(new_s[k]), float(ref_s[k]), atol=1e-4)
  _close(ref_p, new_p)
  _close(row_p, new_p)


def test_token_budget_step_exact_for_sequence_aggregation():
  """Per-sequence means (seq-mean-token-mean) and GSPO's sequence ratio need each sample
  whole in one micro-batch, and the denominator counts the whole batch's sequences."""
  graphdef, params = model()
  batch = _old(graphdef, params, make_batch(8))
  agg = "seq-mean-token-mean"
  ref_p, _ = _step(graphdef, params, batch, 1, agg, ratio_level="sequence")
  new_p, _ = _step(graphdef, params, {**batch, "pack": _budget(batch, 18)}, None, agg,
                   ratio_level="sequence")
  _close(ref_p, new_p)


def test_token_budget_critic_step_matches_padded():
  graphdef, params = nnx.split(heads.Critic(CFG, rngs=nnx.Rngs(0)))
  params["value_head"]["kernel"] = jnp.ones_like(params["value_head"]["kernel"][...]) * 0.1
  batch = make_batch(5)
  ref_p, _ = _step(graphdef, params, batch, 2, critic=True)
  new_p, _ = _step(graphdef, params, {**batch, "pack": _budget(batch, 30, pack_len=0)}, None,
                   critic=True)
  _close(ref_p, new_p)


def test_token_budget_on_8_device_mesh_matches_single_device(actor_case):
  """Rows and parameters sharded over 8 simulated devices (fsdp 4 x tensor 2: 4 shards;
  data 8: 8 shards), micro-batches filled per shard: the padded single-device update."""
  assert jax.device_count() == 8
  graphdef, params, batch, ref_p, _ = actor_case
  for axes, shards in (({"fsdp": 4, "tensor": 2}, 4), ({"data": 8}, 8)):
    mesh = sharding.make_mesh(axes)
    sp = sharding.shard_state(jax.tree.map(jnp.copy, params), mesh, sharding.fsdp_tp_rules())
    data = {k: jax.device_put(v, NamedSharding(mesh, P(tuple(axes)[0])))
            for k, v in batch.items()}
    pk = _budget(batch, 14, shards)
    assert pk["seg"].shape[1] == shards  # one row per micro-batch and shard
    new_p, _ = _step(graphdef, sp, {**data, "pack": jax.device_put(pk, NamedSharding(mesh, P()))},
                     None)
    _close(ref_p, new_p)


def test_config_refusals_name_the_keys():
  from distflow_jax.config import loading
  from distflow_jax.config.values import check_values
  ok = ["model.pack_sequences=True", "model.share_prompt_prefix=False"]
  cases = (
      (["actor.micro_batch_tokens=64"],
       "actor.micro_batch_tokens=64 needs model.pack_sequences=True"),
      (["critic.micro_batch_tokens=64"],
       "critic.micro_batch_tokens=64 needs model.pack_sequences=True"),
      ([*ok, "actor.micro_batch_tokens=64", "trainer.deterministic=True"],
       "actor.micro_batch_tokens=64 does not work with trainer.deterministic=True"),
      ([*ok, "actor.micro_batch_tokens=-1"], r"actor.micro_batch_tokens=-1 must be >= 0"),
      ([*ok, "critic.micro_batch_tokens=2.5"], "critic.micro_batch_tokens=2.5"),
  )
  for overrides, message in cases:
    with pytest.raises(loading.ConfigError, match=message) as err:
      check_values(loading.load("grpo:tiny", overrides))
    assert "\n" not in str(err.value)
  check_values(loading.load("grpo:tiny", [*ok, "actor.micro_batch_tokens=64",
                                          "critic.micro_batch_tokens=64"]))
  # Shared prompts pack too (tests/test_packing_shared.py).
  check_values(loading.load("grpo:tiny", ["model.pack_sequences=True", "rollout.n=2",
                                          "actor.micro_batch_tokens=64"]))


@pytest.mark.timeout(600)
def test_tiny_grpo_cli_run_with_token_budget(tmp_path):
  """`distflow-jax train` on the tiny model: 32 prompts x 2 over 8 devices, 2 mini-batches
  (4 samples of ~25 tokens per shard each), packed, micro-batches of 48 tokens, old
  log-probs recomputed: finite metrics, several micro-batches, fills within the budget."""
  import json

  from distflow_jax import cli
  from workflow_util import tiny_model_folder, tiny_train_argv
  tiny_model_folder(tmp_path)
  run_dir = tmp_path / "run"
  code = cli.main(tiny_train_argv(
      tmp_path, run_dir, "--config.data.eval=", "--config.trainer.eval_every=0",
      "--config.trainer.total_steps=1", "--config.data.prompts_per_step=32",
      "--config.model.pack_sequences=True", "--config.model.share_prompt_prefix=False",
      "--config.actor.micro_batch_tokens=48", "--config.actor.mini_batches=2",
      "--config.actor.recompute_old_logprobs=True",
      "--config.actor.micro_batch_size=3"))  # not a divisor: unused with a token budget
  assert code == 0
  (r,) = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
  assert math.isfinite(r["actor/loss"]) and r["actor/skipped"] == 0.0
  assert r["actor/micro_batches"] >= 2
  assert 0.0 < r["actor/micro_batch_fill_min"] <= r["actor/micro_batch_fill_max"] <= 1.0
  assert 0.0 <= r["pad_fraction/train_actor"] < 1.0
