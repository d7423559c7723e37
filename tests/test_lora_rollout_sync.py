"""rollout.lora_sync=adapters (rollout/lora_sync.py) against the merged route, over real LoRA
train steps: the same rollout weights and tokens, nothing compiled from the second sync on,
only the adapters' bytes moved, the base aliased where the layouts agree, the previous merged
kernels donated, and a changed base refused.

Weights: bitwise on one device; on 8 simulated devices (fsdp training, a tensor-parallel
rollout replica) within 1e-6, as the two routes run ``a @ b`` on different shards (fsdp rows
on the training mesh, tensor columns on the replica) and XLA:CPU's dot sums the rank's
products in an order that follows the shard's shape (1 ulp of W apart, 3e-8, measured)."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from distflow_jax.models import lora, sharding
from distflow_jax.models.lora_layer import LoraSpec
from distflow_jax.models.transformer import Transformer
from distflow_jax.rollout import generate
from distflow_jax.rollout.engine import Engine
from distflow_jax.rollout.engine.config import EngineConfig, LoraSync, replica_mesh
from distflow_jax.rollout.lora_sync import BaseChanged
from distflow_jax.train import placement, steps
from loss_settings import actor_loss_settings
from test_train_steps import CFG, make_batch, with_old_logprobs

pytestmark = pytest.mark.timeout(300)
SPEC = LoraSpec(4, 8.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"))
MODEL = CFG.replace(num_layers=2)
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8], [2, 7]]
# (training devices, rollout tensor_parallel)
PLACEMENTS = {"one_device": (1, 1), "fsdp8_tp2": (8, 2)}


def _actor(train_devices, scan):
  mesh = sharding.make_mesh({"fsdp": train_devices}, jax.devices()[:train_devices])
  cfg = MODEL.replace(scan_layers=scan)
  base = sharding.create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh,
                                 sharding.fsdp_tp_rules())
  return mesh, nnx.split(lora.attach(base, SPEC, 0, mesh))


def _engine(route, tp, scan):
  return Engine(MODEL.replace(scan_layers=scan, lora=SPEC),
                EngineConfig(max_concurrent_decodes=4, prefill_buckets=(8,), max_new_tokens=6,
                             decode_steps=3, lora_sync=route),
                replica_mesh(tp, jax.devices()[:tp]))


def adapter_bytes(cfg=MODEL, rank=SPEC.rank):
  """The adapters' bytes from the model's shapes: float32 a [d_in, r] and b [r, d_out] per
  target and layer."""
  d, f = cfg.hidden_size, cfg.intermediate_size
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  dims = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]
  return cfg.num_layers * sum(4 * rank * (i + o) for i, o in dims)


def _leaves(state):
  return {lora.path_str(k): v.get_value() for k, v in nnx.to_flat_state(state)}


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("where", sorted(PLACEMENTS))
def test_adapters_route_matches_the_merged_route_over_train_steps(where, scan):
  train_devices, tp = PLACEMENTS[where]
  mesh, (graphdef, params) = _actor(train_devices, scan)
  engines = {r: _engine(r, tp, scan) for r in LoraSync}
  tx = optax.adam(1e-2)
  step = steps.make_train_step(
      lambda g, p, mb: steps.actor_loss(g, p, mb, actor_loss_settings(kl_coef=0.1), 512),
      graphdef, tx, 2, "token-mean")
  opt = placement.init_opt_state(tx, params)
  rows = NamedSharding(sharding.make_mesh({"data": train_devices},
                                          jax.devices()[:train_devices]), P("data"))
  counts, tokens = None, []
  base_bytes = sum(x.size * x.dtype.itemsize
                   for x in jax.tree.leaves(lora.split_trainable(params)[1]))
  for k in range(3):
    states = {r: e.update_params(params) for r, e in engines.items()}
    got = {r: _leaves(s) for r, s in states.items()}
    merged, adapters = got[LoraSync.MERGED], got[LoraSync.ADAPTERS]
    assert list(merged) == list(adapters)
    for path, want in merged.items():
      have = adapters[path]
      assert have.sharding == want.sharding, path
      if train_devices == 1:
        assert np.asarray(have).tobytes() == np.asarray(want).tobytes(), (k, path)
      else:
        np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=0, atol=1e-6,
                                   err_msg=f"step {k} {path}")
    outs = {r: generate(e, states[r], PROMPTS, 2, rng=jax.random.key(k))
            for r, e in engines.items()}
    np.testing.assert_array_equal(outs[LoraSync.ADAPTERS].tokens_RxN,
                                  outs[LoraSync.MERGED].tokens_RxN)
    tokens.append(outs[LoraSync.MERGED].tokens_RxN)
    # Bytes: the whole merged model each sync; the adapters alone from the second on (on
    # the first, also the base where its rollout layout differs from its training one).
    eng = engines[LoraSync.ADAPTERS]
    assert engines[LoraSync.MERGED].sync_bytes == base_bytes
    copied = 0 if (train_devices == 1 or k) else base_bytes
    assert eng.sync_bytes == adapter_bytes() + copied, (k, eng.sync_bytes)
    if k == 1:
      counts = {r: e.compile_counts() for r, e in engines.items()}
      assert counts[LoraSync.ADAPTERS]["lora_sync"] > 0
    elif k > 1:
      assert {r: e.compile_counts() for r, e in engines.items()} == counts  # no recompile
    batch = jax.device_put(with_old_logprobs(graphdef, params, make_batch(k)), rows)
    params, opt, stats = step(params, opt, batch)
    assert int(stats["skipped"]) == 0
  assert not np.array_equal(tokens[0], tokens[-1])  # the adapters did change the rollout


def _randomized(params, seed):
  rng = np.random.default_rng(seed)
  return lora.set_adapter_arrays(params, {
      k: (a, rng.normal(0, 0.05, b.shape).astype(np.float32))
      for k, (a, b) in lora.adapter_arrays(params).items()})


def _pointer(x):
  return x.addressable_shards[0].data.unsafe_buffer_pointer()


@pytest.mark.parametrize("where", sorted(PLACEMENTS))
def test_base_is_aliased_where_layouts_agree_and_old_kernels_are_donated(where):
  """One device, loop layers: the rollout's base leaves are the training arrays' buffers (no
  copy, on any sync); elsewhere the engine's own copy, made once.  Each sync's merged
  kernels are written into the previous sync's, which are gone."""
  train_devices, tp = PLACEMENTS[where]
  _, (_, params) = _actor(train_devices, False)
  eng = _engine(LoraSync.ADAPTERS, tp, False)
  kernels = [p for p in _leaves(params) if p.endswith("/kernel")
             and p.rsplit("/", 1)[0] + "/lora_a" in _leaves(params)]
  first = _leaves(eng.update_params(_randomized(params, 1)))
  before = {p: _pointer(x) for p, x in first.items()}
  second = _leaves(eng.update_params(_randomized(params, 2)))
  train = _leaves(params)
  for path, x in second.items():
    if path in kernels:
      assert first[path].is_deleted(), path  # donated: the new kernel took its buffer
      assert _pointer(x) == before[path] and _pointer(x) != _pointer(train[path]), path
      continue
    aliased = _pointer(x) == _pointer(train[path])
    assert aliased == (train_devices == 1), (path, where)
    assert _pointer(x) == before[path], path  # the same base copy every sync


def test_a_changed_base_is_refused_in_one_line():
  _, (_, params) = _actor(1, False)
  eng = _engine(LoraSync.ADAPTERS, 1, False)
  eng.update_params(params)
  flat = list(nnx.to_flat_state(params))
  path = next(k for k, _ in flat if lora.path_str(k) == "layers/1/mlp/up_proj/kernel")
  other = nnx.from_flat_state([(k, v.replace(v.get_value() + 1.0) if k == path else v)
                               for k, v in flat])
  with pytest.raises(BaseChanged) as e:
    eng.update_params(other)
  msg = str(e.value)
  assert "\n" not in msg and "layers/1/mlp/up_proj/kernel" in msg, msg
  assert "rollout.lora_sync=merged" in msg, msg
  eng.update_params(params)  # the base it copied is still accepted


def test_merged_kernels_the_caller_dropped_are_not_kept_between_syncs():
  """The engine holds no merged kernel between syncs once its caller dropped the weights
  (they do not stay alive through the train step); the next merge writes new buffers."""
  import gc
  import weakref
  _, (_, params) = _actor(8, False)
  eng = _engine(LoraSync.ADAPTERS, 2, False)
  first = eng.update_params(_randomized(params, 1))
  refs = [weakref.ref(x) for x in jax.tree.leaves(first)]
  kernel = _leaves(first)["layers/0/attn/q_proj/kernel"]
  want = np.asarray(kernel)
  del first, kernel
  gc.collect()
  counts = eng.compile_counts()
  second = _leaves(eng.update_params(_randomized(params, 1)))
  assert sum(r() is None for r in refs) >= len(lora.adapter_arrays(params))  # freed
  np.testing.assert_array_equal(np.asarray(second["layers/0/attn/q_proj/kernel"]), want)
  assert eng.compile_counts() == counts


@pytest.mark.timeout(600)
def test_a_run_logs_the_bytes_each_sync_moved(tmp_path, capsys):
  """A 2-step grpo:tiny_lora run (8 devices, rollout.lora_sync=adapters): step 1 moves the
  base and the adapters, step 2 the adapters alone, as ``sync/bytes_moved`` in its
  metrics; the adapters' bytes from the micro preset's shapes."""
  import json

  from distflow_jax import cli
  from distflow_jax.models.config import PRESETS
  from workflow_util import SMOKE
  run_dir = tmp_path / "run"
  code = cli.main(["train", "--config=grpo:tiny_lora", f"--config.run_dir={run_dir}",
                   *[f"--config.{o}" for o in SMOKE if not o.startswith("trainer.total_steps")],
                   "--config.trainer.total_steps=2", "--config.rollout.lora_sync=adapters"])
  assert code == 0, capsys.readouterr().err
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  moved = [r["sync/bytes_moved"] for r in rows if "sync/bytes_moved" in r]
  want = adapter_bytes(PRESETS["micro"](64), rank=8)
  assert len(moved) == 2 and moved[1] == want and moved[0] > 5 * want, (moved, want)
