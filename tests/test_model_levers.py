"""Memory and compile levers (issue 15.3): scanned layers, remat policies, attention through
jax.nn.dot_product_attention, float32 master weights; each must leave the numbers alone."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from distflow_jax.models import hf_io, sharding, stacking
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.heads import Critic, critic_values
from distflow_jax.models.transformer import Transformer, forward, init_cache
from distflow_jax.train import optim, placement, steps

TOL = 1e-5


def _cfg(arch: str, tied: bool, **kw) -> ModelConfig:
  return ModelConfig(arch=arch, vocab_size=61, hidden_size=32, intermediate_size=48,
                     num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                     qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3", tie_embeddings=tied,
                     attention_impl="einsum", **kw)


def _inputs(b=3, t=9, vocab=61):
  tokens = jax.random.randint(jax.random.key(1), (b, t), 0, vocab)
  mask = jnp.arange(t)[None] >= jnp.array([0, 2, 4])[:b, None]  # left padded
  pos = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
  return tokens, pos, mask


def _loss(graphdef, params, tokens, pos, mask):
  logits, _ = forward(graphdef, params, tokens, pos, mask)
  return jnp.sum(jnp.where(mask[..., None], jax.nn.log_softmax(logits), 0.0)[..., 0])


def _close(a, b, tol=TOL):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=tol)


def _pair(cfg):
  loop = Transformer(cfg, rngs=nnx.Rngs(0))
  scan = Transformer(cfg.replace(scan_layers=True), rngs=nnx.Rngs(0))
  return nnx.split(loop), nnx.split(scan)


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False), ("qwen3", True),
                                       ("qwen3", False)])
def test_scan_equals_loop_logits_and_grads(arch, tied):
  (g1, p1), (g2, p2) = _pair(_cfg(arch, tied))
  _close(stacking.to_scan(p1), p2, 0)  # same initialisation, stacked
  x = _inputs()
  _close(forward(g1, p1, *x)[0], forward(g2, p2, *x)[0])
  grad = jax.jit(jax.grad(_loss, argnums=1), static_argnums=0)
  _close(stacking.to_scan(grad(g1, p1, *x)), grad(g2, p2, *x))


@pytest.mark.parametrize("scan", [False, True])
def test_remat_policies_same_grads(scan):
  cfg = _cfg("qwen2", False, scan_layers=scan)
  g, p = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  x = _inputs()
  grad = jax.jit(jax.grad(_loss, argnums=1), static_argnums=0)
  want = grad(g, p, *x)
  for policy in ("full", "dots_saveable"):
    gr, _ = nnx.split(Transformer(cfg.replace(remat=policy), rngs=nnx.Rngs(0)))
    _close(grad(gr, p, *x), want)


def test_shared_prefix_scan_and_remat_equal_plain_pass():
  """return_kv / prefix (the GRPO shared-prompt passes) under scan + remat match the loop."""
  cfg = _cfg("llama", True)
  (g1, p1), (g2, p2) = _pair(cfg)
  g3, _ = nnx.split(Transformer(cfg.replace(scan_layers=True, remat="full"), rngs=nnx.Rngs(0)))
  b, n = 4, 5
  batch = {"prompt_tokens": jnp.repeat(_inputs(2, 6)[0], 2, axis=0),
           "prompt_mask": jnp.repeat(_inputs(2, 6)[2], 2, axis=0),
           "response_tokens": jax.random.randint(jax.random.key(2), (b, n), 0, 61),
           "response_mask": jnp.arange(n)[None] < jnp.array([5, 3, 4, 1])[:, None]}

  def f(g, p):
    logp, _ = steps.response_logprobs(g, p, batch, group_size=2)
    return logp.sum(), logp
  vg = jax.jit(jax.value_and_grad(f, argnums=1, has_aux=True), static_argnums=0)
  (_, want), gw = vg(g1, p1)
  for g in (g2, g3):
    (_, got), gg = vg(g, p2)
    _close(got, want)
    _close(gg, stacking.to_scan(gw))


def test_cached_decode_with_scan_layers():
  """Prefill + decode through the KV cache with stacked layers equals the loop model."""
  (g1, p1), (g2, p2) = _pair(_cfg("qwen3", False))
  tokens, pos, mask = _inputs()
  outs = []
  for g, p in ((g1, p1), (g2, p2)):
    cache = init_cache(g.cfg if hasattr(g, "cfg") else _cfg("qwen3", False), 3, 16)
    logits, cache = forward(g, p, tokens, pos, mask, cache, jnp.zeros((3,), jnp.int32))
    nxt = jnp.argmax(logits[:, -1], -1)[:, None]
    step, _ = forward(g, p, nxt, pos[:, -1:] + 1, jnp.ones((3, 1), bool), cache,
                      jnp.full((3,), 9, jnp.int32))
    outs.append((logits, step))
  _close(outs[0], outs[1])


@pytest.mark.parametrize("impl", ["xla", "auto"])
def test_dot_product_attention_equals_einsum(impl):
  cfg = _cfg("qwen2", True, scan_layers=True)
  g, p = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  gd, _ = nnx.split(Transformer(cfg.replace(attention_impl=impl), rngs=nnx.Rngs(0)))
  x = _inputs()
  _close(forward(gd, p, *x)[0], forward(g, p, *x)[0])
  grad = jax.jit(jax.grad(_loss, argnums=1), static_argnums=0)
  _close(grad(gd, p, *x), grad(g, p, *x))
  # With a cache (prefill) too; decode (one token) keeps its own path.
  c = init_cache(cfg, 3, 12)
  z = jnp.zeros((3,), jnp.int32)
  _close(forward(gd, p, *x, c, z)[0], forward(g, p, *x, c, z)[0])


@pytest.mark.parametrize("tied", [True, False])
def test_hf_round_trip_with_scan_layers(tmp_path, tied):
  cfg = _cfg("qwen2", tied)
  loop = Transformer(cfg, rngs=nnx.Rngs(0))
  hf_io.save_pretrained(tmp_path / "a", loop)
  scan = hf_io.load_pretrained(tmp_path / "a", cfg=cfg.replace(scan_layers=True))
  assert nnx.state(scan)["layers"]["mlp"]["up_proj"]["kernel"][...].shape == (3, 32, 48)
  hf_io.save_pretrained(tmp_path / "b", scan)
  a, b = hf_io.export_state_dict(loop), hf_io.export_state_dict(scan)
  assert sorted(a) == sorted(b)
  _close([a[k] for k in sorted(a)], [b[k] for k in sorted(b)], 0)
  again = hf_io.load_pretrained(tmp_path / "b", cfg=cfg)
  _close(nnx.state(again), nnx.state(loop), 0)


def test_sharding_rules_skip_the_layer_axis():
  mesh = sharding.make_mesh({"fsdp": 2}, jax.devices()[:2])
  spec = sharding.spec_for("layers/attn/q_proj/kernel", (3, 32, 32), sharding.fsdp_tp_rules(),
                           mesh)
  assert spec == jax.sharding.PartitionSpec(None, "fsdp", None)
  spec = sharding.spec_for("backbone/layers/mlp/down_proj/kernel", (3, 48, 32),
                           sharding.fsdp_tp_rules(), mesh)
  assert spec[0] is None
  model = sharding.create_sharded(
      lambda: Critic(_cfg("llama", True, scan_layers=True), rngs=nnx.Rngs(0)), mesh,
      sharding.fsdp_tp_rules())
  g, p = nnx.split(model)
  assert critic_values(g, p, *_inputs()).shape == (3, 9)


def test_master_weights_keep_small_updates():
  """bfloat16 parameters with float32 master weights take updates far below their ulp."""
  params = {"w": jnp.ones((4,), jnp.bfloat16)}
  tx = optim.with_master_weights(optax.sgd(1e-4))
  state = tx.init(params)
  assert state.master["w"].dtype == jnp.float32
  plain_tx = optax.sgd(1e-4)
  plain, plain_state = dict(params), plain_tx.init(params)
  for _ in range(100):
    g = {"w": jnp.ones((4,), jnp.bfloat16)}
    u, state = tx.update(g, state, params)
    params = optax.apply_updates(params, u)
    pu, plain_state = plain_tx.update(g, plain_state, plain)
    plain = optax.apply_updates(plain, pu)
  assert params["w"].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(state.master["w"]), 1 - 100 * 1e-4, rtol=1e-5)
  assert float(plain["w"][0]) == 1.0  # each 1e-4 step rounds away in bfloat16
  assert float(params["w"][0]) < 1.0


def test_engine_takes_stacked_params():
  """The rollout engine decodes with one array per layer: stacked actor parameters are
  unstacked on load / sync and generate the loop model's greedy tokens."""
  from distflow_jax.rollout import Engine, EngineConfig, SamplingParams, generate, replica_mesh
  cfg = _cfg("qwen2", False)
  (_, p1), _ = _pair(cfg)
  p1 = jax.tree.map(lambda x: x * 8.0 if x.ndim == 2 else x, p1)  # peaky: varied tokens
  p2 = stacking.to_scan(p1)
  ecfg = EngineConfig(max_concurrent_decodes=2, prefill_buckets=(8,), max_new_tokens=5,
                      sampling=SamplingParams(0.0), decode_steps=5)
  mesh = replica_mesh(1, jax.devices()[:1])
  prompts = [[1, 2, 3], [7, 8, 9, 10, 11]]
  want = generate(Engine(cfg, ecfg, mesh), p1, prompts)
  eng = Engine(cfg.replace(scan_layers=True), ecfg, mesh)
  for params in (eng.load_params(p2), eng.update_params(p2)):
    got = generate(eng, params, prompts)
    np.testing.assert_array_equal(got.tokens_RxN, want.tokens_RxN)
    np.testing.assert_allclose(got.logprobs_RxN, want.logprobs_RxN, atol=TOL)


def test_master_weights_in_a_donating_train_step():
  """bfloat16 model, float32 master weights: the jitted step (params and optimizer state
  donated) runs, keeps the parameters bfloat16 and the moments float32."""
  cfg = _cfg("llama", True, scan_layers=True, dtype="bfloat16", remat="full")
  critic = Critic(cfg, rngs=nnx.Rngs(0))
  g, p = nnx.split(critic)
  tx = optim.with_master_weights(optax.adam(1e-3))
  opt = placement.init_opt_state(tx, p)
  assert {x.dtype for x in jax.tree.leaves(opt.master)} == {jnp.dtype(jnp.float32)}
  tokens = jax.random.randint(jax.random.key(3), (2, 7), 0, 61)
  batch = {"prompt_tokens": tokens[:, :3], "prompt_mask": jnp.ones((2, 3), bool),
           "response_tokens": tokens[:, 3:], "response_mask": jnp.ones((2, 4), bool),
           "values": jnp.zeros((2, 4)), "returns": jnp.ones((2, 4))}
  step = steps.make_train_step(lambda g, p, mb: steps.critic_loss(g, p, mb, 0.0), g, tx, 1,
                               "token-mean")
  p, opt, stats = step(p, opt, batch)
  p, opt, stats = step(p, opt, batch)
  assert int(stats["skipped"]) == 0
  assert p["backbone"]["layers"]["mlp"]["up_proj"]["kernel"][...].dtype == jnp.bfloat16
  assert {x.dtype for x in jax.tree.leaves(opt.inner) if x.ndim} == {jnp.dtype(jnp.float32)}


@pytest.mark.timeout(300)
@pytest.mark.llvm_level1  # bitwise; at LLVM level 0 it differs by an ulp
def test_deterministic_step_with_scan_layers_is_bitwise_equal_on_4_and_2_devices(monkeypatch):
  """trainer.deterministic with stacked layers and remat: same bits on 4 and 2 devices."""
  import test_deterministic
  import test_train_steps
  monkeypatch.setattr(test_train_steps, "CFG", test_train_steps.CFG.replace(
      num_layers=2, scan_layers=True, remat="dots_saveable"))
  (p4, s4), (p2, s2) = test_deterministic._run(4), test_deterministic._run(2)
  for a, b in zip(p4, p2):
    np.testing.assert_array_equal(a, b)
  assert [s["total"] for s in s4] == [s["total"] for s in s2]
