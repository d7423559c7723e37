"""Weight sync: FSDP training layout over all devices -> a tensor-parallel rollout replica,
values exact, generation from the new weights, and no recompilation after the first sync;
each device receives only its rollout shard (no whole-model gather), every route (straight,
a local move, the fallback) gives the same values, and a sync releases the previous one."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from distflow_jax.memory import compiled as cp
from distflow_jax.models import sharding
from distflow_jax.models.transformer import Transformer
from distflow_jax.rollout import generate, replica_mesh
from distflow_jax.rollout.mesh_refinement import Refinement
from distflow_jax.rollout.weight_sync import WeightSync
from test_rollout_engine import engine, full_forward_greedy, peaky_model

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9], [2, 7]]


def fsdp_state(model):
  mesh = sharding.make_mesh({"fsdp": len(jax.devices())})
  return sharding.shard_state(nnx.state(model), mesh, sharding.fsdp_tp_rules())


@pytest.mark.timeout(300)
def test_update_params_reshards_and_reuses_compiles():
  eng = engine(mesh=replica_mesh(2, jax.devices()[:4]))
  model_a, model_b = peaky_model(0), peaky_model(7)
  train_a = fsdp_state(model_a)
  q = train_a["layers"][0]["attn"]["q_proj"]["kernel"][...]
  assert q.sharding.spec[0] == "fsdp" and len(q.sharding.device_set) == 8

  params = eng.update_params(train_a)
  for (path, got), (_, want), (_, sh) in zip(nnx.to_flat_state(params),
                                            nnx.to_flat_state(nnx.state(model_a)),
                                            nnx.to_flat_state(eng.param_shardings)):
    np.testing.assert_array_equal(np.asarray(got[...]), np.asarray(want[...]), err_msg=str(path))
    assert got[...].sharding == sh.get_value(), path
  out = generate(eng, params, PROMPTS)
  for r, p in enumerate(PROMPTS):
    assert out.tokens_RxN[r].tolist() == full_forward_greedy(model_a, p, 8)
  counts = eng.compile_counts()
  # One collective step per distinct chunk: embedding with the final norm's scale, a layer
  # (the two layers alike), head; none of them a whole-model gather.
  assert counts["weight_sync"] == 3

  params = eng.update_params(fsdp_state(model_b))
  out_b = generate(eng, params, PROMPTS)
  for r, p in enumerate(PROMPTS):
    assert out_b.tokens_RxN[r].tolist() == full_forward_greedy(model_b, p, 8)
  assert (out_b.tokens_RxN != out.tokens_RxN).any()
  assert eng.compile_counts() == counts  # nothing recompiled


def test_mismatched_model_is_refused():
  eng = engine()
  state = nnx.state(peaky_model())
  leaves = jax.tree.leaves(state)[:-1]
  with pytest.raises(ValueError, match="same model"):
    eng.update_params(leaves)


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      tree)


@pytest.mark.timeout(120)
def test_each_device_receives_its_rollout_shard_not_the_whole_model():
  """The compiled sync (memory_analysis, per device): straight into the rollout layout the
  output is each device's tensor-parallel shard; the fallback (blocks that straddle
  processes, as a disaggregated placement would) holds the whole model per device."""
  rmesh = replica_mesh(4, jax.devices()[:4])
  dst = sharding.state_shardings(nnx.state(peaky_model()), rmesh, sharding.fsdp_tp_rules())
  train = _abstract(fsdp_state(peaky_model()))
  shard = cp.device_bytes(jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), train, dst))
  whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(train))
  straight = WeightSync(dst).memory(train)
  assert shard < whole / 3
  # (memory_analysis adds each step's output tuple: 8 bytes per array)
  assert straight.direct and straight.output == pytest.approx(shard, rel=0.01)
  # embed (+ the final norm's scale, a vector: issue 32), 2 layers, head
  assert straight.steps == 4 and straight.temp <= shard
  names = [name for name, _, _ in WeightSync(dst).programs(train)]
  assert names == ["reshard[embed/embedding/value]", "reshard[layers/0]",
                   "reshard[lm_head/kernel/value]"], names
  fallback = WeightSync(dst, process_of=lambda d: d.id % 2).memory(train)
  assert not fallback.direct and fallback.output == pytest.approx(whole, rel=0.01)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("route", ["block0", "block1", "rearranged", "fallback", "unsharded"])
def test_every_route_gives_the_training_values(route):
  model = peaky_model(3)
  want = jax.tree.map(np.asarray, nnx.state(model))
  devs = jax.devices()
  train, process_of = fsdp_state(model), None
  replica = {"block0": devs[:4], "block1": devs[4:], "rearranged": devs[:4][::-1],
             "fallback": devs[:4], "unsharded": devs[:4]}[route]
  if route == "fallback":
    process_of = lambda d: d.id % 2  # noqa: E731  (blocks straddle processes)
  if route == "unsharded":
    train = nnx.state(model)
  dst = sharding.state_shardings(nnx.state(model), replica_mesh(2, replica),
                                 sharding.fsdp_tp_rules())
  sync = WeightSync(dst, process_of)
  got = sync(train)
  for (path, g), (_, w), (_, sh) in zip(nnx.to_flat_state(got), nnx.to_flat_state(want),
                                        nnx.to_flat_state(dst)):
    np.testing.assert_array_equal(np.asarray(g[...]), w[...], err_msg=f"{route} {path}")
    assert g[...].sharding == sh.get_value(), (route, path)
  direct = all(sync._route(*_flat(train)).direct)
  assert direct == (route not in ("fallback", "unsharded")), route


def _flat(tree):
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [x for _, x in flat], [p for p, _ in flat]


@pytest.mark.timeout(120)
def test_a_sync_releases_the_previous_rollout_weights():
  eng = engine(mesh=replica_mesh(2, jax.devices()[:4]))
  train = fsdp_state(peaky_model(0))
  first = eng.update_params(train)
  old = jax.tree.leaves(first)
  assert not any(x.is_deleted() for x in old)
  second = eng.update_params(fsdp_state(peaky_model(7)))
  assert all(x.is_deleted() for x in old)  # old and new never coexist
  assert not any(x.is_deleted() for x in jax.tree.leaves(second))
  out = generate(eng, second, PROMPTS)
  for r, p in enumerate(PROMPTS):
    assert out.tokens_RxN[r].tolist() == full_forward_greedy(peaky_model(7), p, 8)
  # The training parameters are never released, even when handed back in.
  again = eng.update_params(second)
  assert not any(x.is_deleted() for x in jax.tree.leaves(second))
  assert not any(x.is_deleted() for x in jax.tree.leaves(train))
  np.testing.assert_array_equal(np.asarray(jax.tree.leaves(again)[0]),
                                np.asarray(jax.tree.leaves(second)[0]))


def test_refinement_of_two_meshes():
  r = Refinement.of(np.asarray(jax.devices() * 8, dtype=object),
                    [(("fsdp",), (64,)), (("b", "data", "tensor"), (8, 1, 8))])
  assert dict(r.mesh.shape) == {"_sync1": 8, "_sync0": 8}  # major to minor
  assert r.axes[(0, "fsdp")] == ("_sync1", "_sync0")
  assert r.axes[(1, "b")] == ("_sync1",) and r.axes[(1, "tensor")] == ("_sync0",)
  assert r.axes[(1, "data")] == ()
  r = Refinement.of(np.asarray(jax.devices() * 8, dtype=object),
                    [(("data", "fsdp"), (2, 32)), (("b", "data", "tensor"), (8, 1, 8))])
  assert sorted(r.mesh.shape.values()) == [2, 4, 8]
  assert len(r.axes[(0, "fsdp")]) == 2 and len(r.axes[(1, "b")]) == 2
  assert Refinement.of(np.asarray(jax.devices()[:6], dtype=object),
                       [(("a", "b"), (2, 3)), (("c", "d"), (3, 2))]) is None


@pytest.mark.timeout(120)
def test_sync_onto_rollout_devices_apart_from_training():
  """placement.rollout apart from training (trainer.max_staleness): FSDP over devices 4:8,
  the replica on 0:4.  Straight into the rollout layout on the training block (no whole
  parameter gathered on a training device), then one move onto the rollout's devices:
  values exact, each rollout device holds its shard and nothing lands elsewhere."""
  model = peaky_model(5)
  want = jax.tree.map(np.asarray, nnx.state(model))
  devs = jax.devices()
  train = sharding.shard_state(nnx.state(model), sharding.make_mesh({"fsdp": 4}, devs[4:]),
                               sharding.fsdp_tp_rules())
  dst = sharding.state_shardings(nnx.state(model), replica_mesh(2, devs[:4]),
                                 sharding.fsdp_tp_rules())
  sync = WeightSync(dst)
  got = sync(train)
  for (path, g), (_, w), (_, sh) in zip(nnx.to_flat_state(got), nnx.to_flat_state(want),
                                        nnx.to_flat_state(dst)):
    np.testing.assert_array_equal(np.asarray(g[...]), w[...], err_msg=str(path))
    assert g[...].sharding == sh.get_value(), path
    assert {s.device for s in g[...].addressable_shards} == set(devs[:4]), path
  assert all(sync._route(*_flat(train)).direct)
  assert sync.memory(_abstract(train)).direct
