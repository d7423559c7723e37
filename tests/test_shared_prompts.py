"""Shared prompts: a GRPO group's prompt runs once; numbers equal the per-row pass."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from distflow_jax.models import ModelConfig, Transformer
from distflow_jax.models.transformer import forward, positions_from_mask
from distflow_jax.train import hidden, micro_batches, steps
from loss_settings import actor_loss_settings

CFG = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True)
G, NS, PL, N = 3, 4, 7, 6  # groups, samples per group, prompt width, response width
B = G * NS

# Every model computation below runs jitted: one compile per program, not one per eager op.
_forward = jax.jit(forward, static_argnums=0,
                   static_argnames=("return_kv", "prefix_repeat"))
_logprobs = jax.jit(steps.response_logprobs, static_argnums=0, static_argnames=("group_size",))
_grouped = jax.jit(hidden.prompts_grouped, static_argnums=1)


def grouped_batch(seed=0, group=NS):
  """`B // group` prompts (left padded, own lengths), each repeated `group` times; responses
  right padded, lengths 1..N."""
  rng = np.random.default_rng(seed)
  g = B // group
  plen = rng.integers(2, PL + 1, size=g)
  pmask = np.arange(PL)[None] >= (PL - plen)[:, None]
  ptok = np.where(pmask, rng.integers(1, 64, (g, PL)), 0).astype(np.int32)
  rmask = np.arange(N)[None] < rng.integers(1, N + 1, size=B)[:, None]
  return {
      "prompt_tokens": np.repeat(ptok, group, 0), "prompt_mask": np.repeat(pmask, group, 0),
      "response_tokens": np.where(rmask, rng.integers(1, 64, (B, N)), 0).astype(np.int32),
      "response_mask": rmask,
      "advantages": (rng.normal(size=(B, N)) * rmask).astype(np.float32),
  }


@pytest.fixture(scope="module")
def model():
  return nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))


def test_prefix_forward_equals_the_full_sequence(model):
  graphdef, params = model
  batch = grouped_batch()
  tokens, mask, pos = hidden.sequence_inputs(batch)
  full, _ = _forward(graphdef, params, tokens, pos, mask)
  pm = jnp.asarray(batch["prompt_mask"][::NS])
  _, kv = _forward(graphdef, params, jnp.asarray(batch["prompt_tokens"][::NS]),
                   positions_from_mask(pm), pm, return_kv=True)
  assert [k.shape for k in kv.k] == [(G, CFG.num_kv_heads, PL, CFG.head_dim)] * CFG.num_layers
  resp, _ = _forward(graphdef, params, tokens[:, PL:], pos[:, PL:], mask[:, PL:], prefix=kv,
                     prefix_repeat=NS)
  rm = batch["response_mask"]
  np.testing.assert_allclose(np.asarray(resp)[rm], np.asarray(full[:, PL:])[rm], atol=2e-5)


def test_prefix_arguments_are_checked(model):
  graphdef, params = model
  tok = jnp.ones((4, 3), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(3), (4, 3))
  _, kv = _forward(graphdef, params, tok[:2], pos[:2], return_kv=True)
  with pytest.raises(ValueError, match="prefix of 2 rows repeated 3 times"):
    _forward(graphdef, params, tok, pos, prefix=kv, prefix_repeat=3)
  with pytest.raises(ValueError, match="exclude each other"):
    _forward(graphdef, params, tok, pos, prefix=kv, prefix_repeat=2, return_kv=True)


@pytest.mark.slow
def test_shared_logprobs_and_gradients_equal_the_plain_pass(model):
  graphdef, params = model
  batch = grouped_batch()
  assert bool(_grouped(batch, NS))
  plain = jax.jit(hidden._response_hidden_plain, static_argnums=0)(graphdef, params, batch)
  shared = jax.jit(hidden._response_hidden_shared, static_argnums=(0, 3))(graphdef, params,
                                                                          batch, NS)
  rm = batch["response_mask"]
  np.testing.assert_allclose(np.asarray(shared)[rm], np.asarray(plain)[rm], atol=2e-5)

  def loss(p, gs):
    return jnp.sum(steps.response_logprobs(graphdef, p, batch, group_size=gs)[0])
  g1 = jax.jit(jax.grad(loss), static_argnums=1)(params, 1)
  g4 = jax.jit(jax.grad(loss), static_argnums=1)(params, NS)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4)):
    np.testing.assert_allclose(a, b, atol=2e-5 * max(1.0, float(jnp.max(jnp.abs(a)))))


def test_grouping_check(model):
  batch = grouped_batch()
  assert bool(_grouped(batch, NS))
  assert bool(_grouped(batch, 1))
  broken = dict(batch, prompt_tokens=batch["prompt_tokens"].copy())
  broken["prompt_tokens"][1, -1] += 1  # one token differs inside a group
  assert not bool(_grouped(broken, NS))
  masked = dict(batch, prompt_mask=batch["prompt_mask"].copy())
  masked["prompt_mask"][NS + 1, -2] = False  # same tokens, other padding
  assert not bool(_grouped(masked, NS))
  graphdef, params = model
  with pytest.raises(ValueError, match="12 rows are not whole groups of 5"):
    _logprobs(graphdef, params, batch, group_size=5)


def test_train_step_refuses_an_ungrouped_batch(model):
  graphdef, params = model
  batch = grouped_batch(seed=2)
  lp, _ = _logprobs(graphdef, params, batch)
  batch = {**batch, "old_logprobs": np.asarray(lp), "ref_logprobs": np.asarray(lp)}
  batch["prompt_tokens"] = np.roll(batch["prompt_tokens"], 1, axis=0)
  cfg = actor_loss_settings(group_size=NS)
  tx = optax.sgd(1.0)
  step = steps.make_train_step(lambda g, p, mb: steps.actor_loss(g, p, mb, cfg, 512),
                               graphdef, tx, 1, "token-mean", NS)
  before = jax.tree.map(np.asarray, params)
  new_p, _, stats = step(jax.tree.map(jnp.copy, params), tx.init(params), batch)
  assert int(stats["ungrouped"]) == 1 and int(stats["skipped"]) == 1
  for a, b in zip(jax.tree.leaves(new_p), jax.tree.leaves(before)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="train_actor: the batch's rows are not in groups"):
    steps.finalize_stats(stats, "train_actor")
  with pytest.raises(ValueError, match="do not split into 2 micro-batches of whole groups of 4"):
    steps.make_train_step(lambda g, p, mb: steps.actor_loss(g, p, mb, cfg, 512),
                          graphdef, tx, 2, "token-mean", NS)(params, tx.init(params), batch)


def test_micro_batches_keep_groups_whole():
  rows = np.arange(24)
  mbs = micro_batches.deal_rows({"r": rows}, 3, 4)["r"]
  assert mbs.shape == (3, 8)
  np.testing.assert_array_equal(mbs[0], [0, 1, 2, 3, 12, 13, 14, 15])
  np.testing.assert_array_equal(np.sort(np.asarray(mbs).ravel()), rows)
  # 24 rows do not split into 4 micro-batches of whole groups of 4: rows are dealt singly.
  np.testing.assert_array_equal(micro_batches.deal_rows({"r": rows}, 4, 4)["r"][1],
                                [1, 5, 9, 13, 17, 21])


@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.llvm_level1  # bitwise; at LLVM level 0 it differs by an ulp
def test_shared_train_step_gives_the_plain_update(model, micro):
  graphdef, params = model
  batch = grouped_batch(seed=1)
  lp, _ = _logprobs(graphdef, params, batch)
  batch = {**batch, "old_logprobs": np.asarray(lp) - 0.05, "ref_logprobs": np.asarray(lp)}
  tx = optax.sgd(1.0)
  out = []
  for gs in (1, NS):
    cfg = actor_loss_settings(kl_coef=0.1, group_size=gs)
    step = steps.make_train_step(lambda g, p, mb, c=cfg: steps.actor_loss(g, p, mb, c, 512),
                                 graphdef, tx, micro, "token-mean", gs)
    p = jax.tree.map(jnp.copy, params)
    out.append(step(p, tx.init(p), batch))
  (p1, _, s1), (p4, _, s4) = out
  np.testing.assert_allclose(s1["total"], s4["total"], rtol=1e-5)
  moved = 0.0
  for a, b, before in zip(jax.tree.leaves(p1), jax.tree.leaves(p4), jax.tree.leaves(params)):
    np.testing.assert_allclose(a, b, atol=5e-6)
    moved = max(moved, float(jnp.max(jnp.abs(a - before))))
  assert moved > 1e-4  # the step did update the parameters
