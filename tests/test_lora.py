"""models/lora.py: adapters on the transformer, switched off, merged, read and written by
HF module name, checked against the model, and checkpointed without the base."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from distflow_jax.config import defaults
from distflow_jax.dag.spec import Role
from distflow_jax.data.loader import PromptLoader
from distflow_jax.models import lora, sharding
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.lora_layer import LoraSpec
from distflow_jax.models.tokenizer import Tokenizer
from distflow_jax.models.transformer import Transformer, forward, positions_from_mask
from distflow_jax.persist import checkpoint as ck
from distflow_jax.state.roles import ModelState
from distflow_jax.train import placement

pytestmark = pytest.mark.timeout(300)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def cfg(dtype="float32", scan=False, **kw):
  return ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True,
                     dtype=dtype, scan_layers=scan, **kw)


def inputs():
  tok = jax.random.randint(jax.random.key(1), (2, 9), 0, 64)
  mask = jnp.arange(9)[None] < jnp.array([[9], [6]])
  return tok, positions_from_mask(mask), mask


def same_bits(x, y):
  x, y = np.asarray(x), np.asarray(y)
  return x.dtype == y.dtype and x.tobytes() == y.tobytes()


def randomize_b(model, seed=2):
  arrays = lora.adapter_arrays(model)
  rng = np.random.default_rng(seed)
  return lora.set_adapter_arrays(model, {k: (a, rng.normal(0, 0.05, b.shape).astype(np.float32))
                                         for k, (a, b) in arrays.items()})


# Eager NNX dispatches op by op (many tiny compiles on a busy CPU): the passes run jitted.
FWD = jax.jit(forward)


@jax.jit
def _three_passes(graphdef, params, tok, pos, mask, seg):
  """The model's plain, prefix (return_kv + return_hidden) and packed passes, in one
  program (eager NNX dispatches op by op: slow on a busy CPU)."""
  plain, _ = forward(graphdef, params, tok, pos, mask)
  hidden, _ = forward(graphdef, params, tok[:, :5], pos[:, :5], mask[:, :5], return_kv=True,
                      return_hidden=True)
  packed, _ = forward(graphdef, params, tok, pos, segment_ids_BxT=seg)
  return plain, hidden, packed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scan", [False, True])
def test_fresh_adapters_give_the_base_logits_bitwise(dtype, scan):
  base = Transformer(cfg(dtype, scan), rngs=nnx.Rngs(0))
  tok, pos, mask = inputs()
  seg = jnp.where(jnp.arange(9) < 4, 1, 2)[None].repeat(2, 0)
  want = _three_passes(*nnx.split(base), tok, pos, mask, seg)
  model = lora.attach(base, LoraSpec(4, 8.0, ("*_proj",), init="kaiming"), seed=3)
  assert lora.has_adapters(model) and not lora.has_adapters(base)
  got = _three_passes(*nnx.split(model), tok, pos, mask, seg)
  assert all(same_bits(g, w) for g, w in zip(got, want))
  # The base weights are the same arrays, not copies; the adapters float32 whatever dtype.
  b_flat = dict(nnx.to_flat_state(nnx.split(base)[1]))
  for k, v in nnx.to_flat_state(nnx.split(model)[1]):
    if isinstance(v, nnx.LoRAParam):
      assert v.get_value().dtype == jnp.float32
    else:
      assert v.get_value() is b_flat[k].get_value()


@pytest.mark.parametrize("scan", [False, True])
def test_switched_off_and_merged(scan):
  base = Transformer(cfg(scan=scan), rngs=nnx.Rngs(0))
  tok, pos, mask = inputs()
  want, _ = FWD(*nnx.split(base), tok, pos, mask)
  spec = LoraSpec(4, 8.0, ("q_proj", "v_proj", "down_proj"))
  model = randomize_b(lora.attach(base, spec, seed=3))
  g, params = nnx.split(model)
  trained, _ = FWD(g, params, tok, pos, mask)
  assert float(jnp.abs(trained - want).max()) > 1e-3  # the adapters act
  off, _ = FWD(g, lora.base_only(params), tok, pos, mask)
  assert same_bits(off, want)
  merged = lora.merged_state(params, spec.scale)
  assert not lora.has_adapters(merged)
  got, _ = FWD(nnx.split(base)[0], merged, tok, pos, mask)
  np.testing.assert_allclose(got, trained, atol=2e-5, rtol=1e-5)
  # jit-able, as the weight sync runs it
  got_jit, _ = FWD(nnx.split(base)[0], jax.jit(lambda p: lora.merged_state(p, spec.scale))(
      params), tok, pos, mask)
  np.testing.assert_allclose(got_jit, got, atol=1e-6)


def test_split_trainable_is_the_adapters():
  model = lora.attach(Transformer(cfg(), rngs=nnx.Rngs(0)), LoraSpec(2, 2.0, ALL), seed=0)
  params = nnx.split(model)[1]
  t, f = lora.split_trainable(params)
  assert all(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(t))
  assert not lora.has_adapters(f)
  assert jax.tree.structure(lora.merge_trainable(t, f)) == jax.tree.structure(params)
  plain = nnx.split(Transformer(cfg(), rngs=nnx.Rngs(0)))[1]
  t, f = lora.split_trainable(plain)
  assert t is plain and not jax.tree.leaves(f)


@pytest.mark.parametrize("scan", [False, True])
def test_adapter_arrays_by_hf_name_round_trip_and_refusals(scan):
  model = lora.attach(Transformer(cfg(scan=scan), rngs=nnx.Rngs(0)),
                      LoraSpec(4, 8.0, ("q_proj", "down_proj")), seed=1)
  arrays = lora.adapter_arrays(model)
  assert sorted(arrays) == [f"model.layers.{i}.{m}" for i in (0, 1)
                            for m in ("mlp.down_proj", "self_attn.q_proj")]
  a, b = arrays["model.layers.1.self_attn.q_proj"]
  assert a.shape == (32, 4) and b.shape == (4, 32) and a.dtype == b.dtype == np.float32
  assert arrays["model.layers.0.mlp.down_proj"][0].shape == (48, 4)
  rng = np.random.default_rng(0)
  new = {k: (rng.normal(size=a.shape).astype(np.float32),
             rng.normal(size=b.shape).astype(np.float32)) for k, (a, b) in arrays.items()}
  lora.set_adapter_arrays(model, new)
  back = lora.adapter_arrays(model)
  for k in new:
    np.testing.assert_array_equal(back[k][0], new[k][0])
    np.testing.assert_array_equal(back[k][1], new[k][1])
  missing = dict(new)
  del missing["model.layers.1.mlp.down_proj"]
  with pytest.raises(lora.LoraError, match=r"'model.layers.1.mlp.down_proj' is missing"):
    lora.set_adapter_arrays(model, missing)
  with pytest.raises(lora.LoraError, match=r"'model.layers.0.self_attn.k_proj' is unknown"):
    lora.set_adapter_arrays(model, {**new, "model.layers.0.self_attn.k_proj": new[
        "model.layers.0.self_attn.q_proj"]})
  bad = {**new, "model.layers.0.self_attn.q_proj": (np.zeros((32, 8), np.float32), b)}
  with pytest.raises(lora.LoraError, match=r"q_proj' a: shape \(32, 8\) .* \(32, 4\)"):
    lora.set_adapter_arrays(model, bad)


@pytest.mark.parametrize("spec, needle", [
    (LoraSpec(4, 8.0, ("qproj",)), "pattern 'qproj' matches no module"),
    (LoraSpec(4, 8.0, ("model.layers.0.*",)), "in layer 1"),
    (LoraSpec(17, 8.0, ("k_proj",)), "rank=17 is larger than k_proj's min(d_in, d_out) = "
                                      "min(32, 16)"),
])  # the values alone: config/lora_checks.py, through the CLI in test_bad_inputs_lora.py
def test_spec_checks_against_the_model(spec, needle):
  with pytest.raises(lora.LoraError) as e:
    lora.check(spec, cfg())
  assert needle in str(e.value) and "\n" not in str(e.value)
  lora.check(LoraSpec(16, 8.0, ("model.layers.*.self_attn.k_proj",)), cfg())  # fits


def test_the_model_config_round_trips_through_a_checkpoints_meta():
  import dataclasses
  c = cfg(lora=LoraSpec(4, 8.0, ("q_proj",)))
  assert ModelConfig(**json.loads(json.dumps(dataclasses.asdict(c)))).lora == c.lora


# ---- the run checkpoint holds the adapters only, and refuses another base ---------------------

def _roles(seed_base=0, seed_b=5):
  mesh = sharding.make_mesh({"fsdp": 1}, jax.devices()[:1])
  base = sharding.create_sharded(lambda: Transformer(cfg(), rngs=nnx.Rngs(seed_base)), mesh,
                                 sharding.fsdp_tp_rules())
  model = randomize_b(lora.attach(base, LoraSpec(4, 8.0, ALL), 0, mesh), seed_b)
  g, p = nnx.split(model)
  tx = optax.adam(1e-3)
  return {Role.ACTOR: ModelState(Role.ACTOR, mesh, g, p, tx, placement.init_opt_state(tx, p))}


def _loader(tmp_path):
  path = tmp_path / "train.jsonl"
  path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                          for i in range(8)))
  return PromptLoader(str(path), Tokenizer.builtin(), batch_size=2, max_prompt_len=16, seed=0,
                      process_index=0, process_count=1)


def test_checkpoint_holds_adapters_and_refuses_another_base(tmp_path):
  roles = _roles()
  adapters = lora.split_trainable(roles[Role.ACTOR].params)[0]
  c = ck.Checkpointer(str(tmp_path / "ck"), save_every=1, keep=2, log=lambda m: None)
  c.save(1, roles, _loader(tmp_path), defaults.base(), cfg())
  c.close()
  c = ck.Checkpointer(str(tmp_path / "ck"), save_every=1, keep=2, log=lambda m: None)
  saved = ck.flat_shapes(c._manager.item_metadata(1)[ck.STATE])  # pylint: disable=protected-access
  assert saved and all(".lora_a" in n or ".lora_b" in n or ".opt_state." in n for n in saved)
  assert not any(".kernel" in n for n in saved)
  live = _roles(seed_b=9)  # same base, other adapters: restored to the saved ones
  c.restore(1, live, _loader(tmp_path), defaults.base())
  for got, want in zip(jax.tree.leaves(lora.split_trainable(live[Role.ACTOR].params)[0]),
                       jax.tree.leaves(adapters)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ck.CheckpointError, match="trained on another base model") as e:
    c.restore(1, _roles(seed_base=1), _loader(tmp_path), defaults.base())
  assert "\n" not in str(e.value)


# ---- the rollout engine holds merged weights ---------------------------------------------------

@pytest.mark.parametrize("scan", [False, True])
def test_engine_sync_merges_the_adapters_without_recompiling(scan):
  import time

  from distflow_jax.rollout.engine import Engine
  from distflow_jax.rollout.engine.config import EngineConfig, replica_mesh
  spec = LoraSpec(4, 8.0, ALL)
  mesh = sharding.make_mesh({"fsdp": 1}, jax.devices()[:1])
  base = sharding.create_sharded(lambda: Transformer(cfg(scan=scan), rngs=nnx.Rngs(0)), mesh,
                                 sharding.fsdp_tp_rules())
  model = randomize_b(lora.attach(base, spec, 0, mesh))
  params = nnx.split(model)[1]
  engine = Engine(cfg(scan=scan, lora=spec), EngineConfig(max_concurrent_decodes=2,
                                                          prefill_buckets=(8,)),
                  replica_mesh(1, jax.devices()[:1]))
  assert not lora.has_adapters(engine._abstract_params)  # pylint: disable=protected-access
  times = []
  for k in range(3):
    t0 = time.perf_counter()
    got = jax.block_until_ready(engine.update_params(params))
    times.append(time.perf_counter() - t0)
  want = lora.merged_state(params, spec.scale)
  if scan:
    from distflow_jax.models import stacking
    want = stacking.to_loop(want)
  assert not lora.has_adapters(got)
  for (kg, g), (kw, w) in zip(nnx.to_flat_state(got), nnx.to_flat_state(want)):
    assert kg == kw
    np.testing.assert_allclose(np.asarray(g.get_value()), np.asarray(w.get_value()), atol=1e-6)
  assert engine._unstack._cache_size() == 1  # pylint: disable=protected-access
  print(f"lora sync (scan={scan}): first {times[0] * 1e3:.1f} ms, then "
        f"{min(times[1:]) * 1e3:.1f} ms")


@pytest.mark.timeout(120)
def test_fresh_adapters_are_one_program_whatever_the_targets():
  """attach makes every adapter in one jitted program (lora.adapter_init), not one per
  leaf: a cold start compiles one program for them however many targets and layers."""
  from distflow_jax.run.compile_cache import CompileCounter
  model_cfg = ModelConfig(arch="llama", vocab_size=40, hidden_size=24, intermediate_size=40,
                          num_layers=3, num_heads=3, num_kv_heads=1, head_dim=8)  # its own
  spec = LoraSpec(rank=3, alpha=6.0, targets=("q_proj", "k_proj", "v_proj", "o_proj",
                                               "gate_proj", "up_proj", "down_proj"))
  base = Transformer(model_cfg, rngs=nnx.Rngs(0))
  counter = CompileCounter()
  before = counter.snapshot()
  model = lora.attach(base, spec, seed=11)
  made = counter.since(before)
  assert len(lora.adapter_shapes(model)) == 3 * 7  # 21 adapters, 42 leaves
  assert made.programs == 1, made
