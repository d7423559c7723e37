"""LoRA adapters sharded like their base weights, on the simulated 8-device mesh.

``lora_a`` [d_in, r] takes its kernel's input-axis sharding, ``lora_b`` [r, d_out] its
output-axis sharding, the rank unsplit (models/sharding.py `rule_for`).  Under FSDP (8) and
FSDP x tensor (2 x 4), loop and scan layers: the shardings are those, the optimizer state
follows them, a train step keeps them (one compile over two steps), moves the adapters and
leaves the base bitwise; the rollout's merge of sharded adapters is one compiled program."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from distflow_jax.models import lora, sharding
from distflow_jax.models.lora_layer import LoraSpec
from distflow_jax.models.transformer import Transformer
from distflow_jax.train import placement, steps
from loss_settings import actor_loss_settings
from test_train_steps import CFG, make_batch, with_old_logprobs

pytestmark = pytest.mark.timeout(300)
SPEC = LoraSpec(4, 8.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"))
PLACEMENTS = {"fsdp8": {"fsdp": 8}, "fsdp2_tensor4": {"fsdp": 2, "tensor": 4}}


def _model(axes, scan):
  mesh = sharding.make_mesh(axes)
  rules = sharding.fsdp_tp_rules()
  cfg = CFG.replace(scan_layers=scan)
  base = sharding.create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh, rules)
  return mesh, lora.attach(base, SPEC, 0, mesh, rules)


def _flat(params):
  return {lora.path_str(k): v.get_value() for k, v in nnx.to_flat_state(params)}


def _host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_adapter_rules_follow_the_kernel_rule():
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  rules = sharding.fsdp_tp_rules()
  spec = lambda p, s: sharding.spec_for(p, s, rules, mesh)  # noqa: E731
  assert spec("layers/0/attn/q_proj/lora_a", (64, 8)) == P("fsdp", None)
  assert spec("layers/0/attn/q_proj/lora_b", (8, 64)) == P(None, "tensor")
  assert spec("layers/mlp/down_proj/lora_a", (2, 128, 8)) == P(None, "tensor", None)
  assert spec("layers/mlp/down_proj/lora_b", (2, 8, 64)) == P(None, None, "fsdp")
  # an adapter's dim the kernel's axes do not divide is refused, naming the adapter
  with pytest.raises(ValueError, match=r"'layers/0/attn/q_proj/lora_b' dim 6"):
    spec("layers/0/attn/q_proj/lora_b", (8, 6))
  assert sharding.spec_for("layers/0/attn/q_proj/lora_a", (64, 8), sharding.no_sharding(),
                           mesh) == P(None, None)


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("placement_name", list(PLACEMENTS))
def test_adapters_shard_like_their_base_and_a_step_keeps_them(placement_name, scan):
  mesh, model = _model(PLACEMENTS[placement_name], scan)
  graphdef, params = nnx.split(model)
  flat = _flat(params)
  split = 0
  for path, x in flat.items():
    if not path.endswith(("lora_a", "lora_b")):
      continue
    kernel = flat[path.rsplit("/", 1)[0] + "/kernel"].sharding.spec
    lead, (i, o) = tuple(kernel)[:-2], tuple(kernel)[-2:]
    want = P(*lead, i, None) if path.endswith("lora_a") else P(*lead, None, o)
    assert x.sharding.spec == want, (path, x.sharding.spec, want)
    split += x.addressable_shards[0].data.shape != x.shape
  assert split >= 7, "no adapter is actually split over the mesh"

  batch = with_old_logprobs(graphdef, params, make_batch())
  batch = jax.device_put(batch, NamedSharding(sharding.make_mesh({"data": 8}), P("data")))
  loss_cfg = actor_loss_settings(kl_coef=0.1)
  tx = optax.adam(1e-2)
  step = steps.make_train_step(lambda g, p, mb: steps.actor_loss(g, p, mb, loss_cfg, 512),
                               graphdef, tx, 2, "token-mean")
  opt = placement.init_opt_state(tx, params)
  adapters, base = lora.split_trainable(params)
  shard_of = {lora.path_str(k): v.get_value().sharding for k, v in nnx.to_flat_state(adapters)}
  for m in (x for x in jax.tree.leaves(opt) if x.ndim):  # moments sharded like the adapters
    assert m.sharding.spec in {s.spec for s in shard_of.values()}
  before_base, before_ad = _host(base), _host(adapters)
  for _ in range(2):
    params, opt, stats = step(params, opt, batch)
    assert int(stats["skipped"]) == 0
  assert step._jitted._cache_size() == 1  # pylint: disable=protected-access
  adapters, base = lora.split_trainable(params)
  for old, new in zip(before_base, _host(base)):
    assert old.dtype == new.dtype and old.tobytes() == new.tobytes()
  assert all(not np.array_equal(o, n) for o, n in zip(before_ad, _host(adapters)))
  for k, v in nnx.to_flat_state(adapters):
    assert v.get_value().sharding == shard_of[lora.path_str(k)]


@pytest.mark.parametrize("scan", [False, True])
def test_engine_merges_sharded_adapters_in_one_program(scan):
  from distflow_jax.rollout.engine import Engine
  from distflow_jax.rollout.engine.config import EngineConfig, replica_mesh
  _, model = _model(PLACEMENTS["fsdp2_tensor4"], scan)
  params = nnx.split(model)[1]
  rng = np.random.default_rng(0)
  params = lora.set_adapter_arrays(params, {
      k: (a, rng.normal(0, 0.05, b.shape).astype(np.float32))
      for k, (a, b) in lora.adapter_arrays(params).items()})
  engine = Engine(CFG.replace(scan_layers=scan, lora=SPEC),
                  EngineConfig(max_concurrent_decodes=2, prefill_buckets=(8,)),
                  replica_mesh(2, jax.devices()[:2]))
  for _ in range(3):
    got = jax.block_until_ready(engine.update_params(params))
  assert engine._unstack._cache_size() == 1  # pylint: disable=protected-access
  want = lora.merged_state(jax.device_get(params), SPEC.scale)
  if scan:
    from distflow_jax.models import stacking
    want = stacking.to_loop(want)
  for (kg, g), (kw, w) in zip(nnx.to_flat_state(got), nnx.to_flat_state(want)):
    assert kg == kw
    np.testing.assert_allclose(np.asarray(g.get_value()), np.asarray(w.get_value()), atol=1e-6)
