"""Sharding rules on a simulated 2x4 (fsdp x tensor) CPU mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from distflow_jax.models.config import ModelConfig
from distflow_jax.models.heads import Critic, critic_values
from distflow_jax.models.sharding import (create_sharded, fsdp_tp_rules, make_mesh, no_sharding,
                                          shard_state, spec_for, state_shardings)
from distflow_jax.models.transformer import Transformer, forward, init_cache


@pytest.fixture(scope="module")
def mesh():
  return make_mesh({"fsdp": 2, "tensor": 4})


def test_rules_give_expected_specs_and_drop_missing_axes(mesh):
  rules = fsdp_tp_rules()
  assert spec_for("layers/3/attn/q_proj/kernel", (8, 16), rules, mesh) == P("fsdp", "tensor")
  assert spec_for("layers/0/mlp/down_proj/kernel", (16, 8), rules, mesh) == P("tensor", "fsdp")
  assert spec_for("backbone/embed/embedding", (64, 8), rules, mesh) == P("tensor", "fsdp")
  assert spec_for("final_norm/scale", (8,), rules, mesh) == P(None)
  data_only = make_mesh({"data": 8})
  assert spec_for("layers/0/attn/q_proj/kernel", (8, 16), rules, data_only) == P(None, None)
  with pytest.raises(ValueError, match=r"'layers/0/attn/q_proj/kernel' dim 6"):
    spec_for("layers/0/attn/q_proj/kernel", (8, 6), rules, mesh)
  with pytest.raises(ValueError, match="no sharding rule matches parameter 'x'"):
    spec_for("x", (2,), ((r"y", P()),), mesh)
  with pytest.raises(ValueError, match="mesh axis 'model'"):
    make_mesh({"model": 8})


@pytest.mark.timeout(240)
def test_sharded_2x4_equals_unsharded(mesh):
  cfg = ModelConfig.tiny(128, arch="qwen2").replace(num_layers=2)
  ctor = lambda: Transformer(cfg, rngs=nnx.Rngs(0))  # noqa: E731
  sharded = create_sharded(ctor, mesh, fsdp_tp_rules())
  g, p_sh = nnx.split(sharded)
  for path, var in nnx.to_flat_state(p_sh):
    if path[-1] == "kernel" and path[-2] == "q_proj":
      assert var.get_value().sharding.spec == P("fsdp", "tensor")
      assert len(var.get_value().addressable_shards[0].data.shape) == 2
      assert var.get_value().addressable_shards[0].data.shape == (96, 48)
  _, p_one = nnx.split(ctor())
  for a, b in zip(jax.tree.leaves(p_sh), jax.tree.leaves(p_one)):
    np.testing.assert_allclose(a, b, atol=1e-6)
  p_sh = jax.tree.map(lambda a, b: jax.device_put(jnp.asarray(b), a.sharding), p_sh, p_one)

  b, t = 8, 12
  tok = jax.random.randint(jax.random.key(0), (b, t), 0, 128)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))

  @jax.jit
  def run(p):
    logits, _ = forward(g, p, tok, pos)
    _, cache = forward(g, p, tok[:, :-1], pos[:, :-1], None, init_cache(cfg, b, 16),
                       jnp.zeros(b, jnp.int32))
    step, _ = forward(g, p, tok[:, -1:], pos[:, -1:], None, cache, jnp.full(b, t - 1))
    return logits, step

  logits_sh, step_sh = run(p_sh)
  logits_one, step_one = run(p_one)
  np.testing.assert_allclose(logits_sh, logits_one, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(step_sh[:, 0], logits_one[:, -1], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(step_sh, step_one, atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(240)
def test_critic_sharded_and_shard_state(mesh):
  cfg = ModelConfig.tiny(128, arch="qwen3").replace(num_layers=1)
  critic = create_sharded(lambda: Critic(cfg, rngs=nnx.Rngs(0)), mesh, fsdp_tp_rules())
  g, p = nnx.split(critic)
  shardings = state_shardings(p, mesh, fsdp_tp_rules())
  assert shardings["value_head"]["kernel"].get_value().spec == P("fsdp", None)
  tok = jnp.arange(16).reshape(2, 8) % 128
  pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
  v_sh = jax.jit(critic_values)(g, p, tok, pos)
  replicated = shard_state(p, mesh, no_sharding())
  assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(replicated))
  v_rep = jax.jit(critic_values)(g, replicated, tok, pos)
  np.testing.assert_allclose(v_sh, v_rep, atol=1e-5)
