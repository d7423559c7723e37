"""Batch: validation, GRPO group expansion, global placement, host fields stay put."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from distflow_jax.data.batch import (Batch, expand_groups, redistribute_batch,
                                     to_global, to_local)
from distflow_jax.data.layout import Layout, placed_as


def _mesh():
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("host", "local"),
              axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _prompts(n=4):
  ids = np.arange(10, 10 + n, dtype=np.int32)
  return Batch({"sample_id": ids, "group_id": ids.copy(),
                "prompt_ids": np.arange(n * 3, dtype=np.int32).reshape(n, 3)},
               {int(i): {"answer": str(i)} for i in ids})


def test_batch_validation_names_the_array():
  with pytest.raises(ValueError, match="'group_id'"):
    Batch({"sample_id": np.arange(3)})
  with pytest.raises(ValueError, match="'x': 2"):
    Batch({"sample_id": np.arange(3), "group_id": np.arange(3), "x": np.zeros(2)})


def test_expand_groups_keeps_groups_adjacent_with_unique_ids():
  b = expand_groups(_prompts(3), 4)
  assert b.num_samples == 12
  np.testing.assert_array_equal(b.data["group_id"], np.repeat([10, 11, 12], 4))
  np.testing.assert_array_equal(
      b.data["sample_id"], [10 * 4 + j for j in range(4)] + [44, 45, 46, 47]
      + [48, 49, 50, 51])
  np.testing.assert_array_equal(b.data["prompt_ids"][4:8], np.tile([3, 4, 5], (4, 1)))
  assert b.host_fields(b.data["group_id"][[0, 5, 11]]) == [
      {"answer": "10"}, {"answer": "11"}, {"answer": "12"}]
  with pytest.raises(ValueError, match="n must be >= 1"):
    expand_groups(_prompts(), 0)


def test_to_global_and_back_single_process():
  lay = Layout(_mesh(), ("host",))
  b = expand_groups(_prompts(4), 2)
  g = to_global(b, lay)
  for k, v in g.data.items():
    assert placed_as(v, lay)
    np.testing.assert_array_equal(np.asarray(v), b.data[k])
  back = to_local(g)
  for k in b.data:
    np.testing.assert_array_equal(back.data[k], b.data[k])
  assert back.host is b.host


def test_redistribute_batch_moves_arrays_and_keeps_host_fields():
  mesh = _mesh()
  src, dst = Layout(mesh, ("host",)), Layout(mesh, ("host", "local"))
  b = to_global(expand_groups(_prompts(4), 4), src)  # 16 samples
  lengths = np.arange(16) % 5 + 1
  moved, perm = redistribute_batch(b, lengths, src, dst)
  assert moved.host is b.host
  np.testing.assert_array_equal(np.asarray(moved.data["sample_id"]),
                                np.asarray(b.data["sample_id"])[perm])
  assert moved.host_fields(np.asarray(moved.data["group_id"])[:1])[0] is not None
  assert all(placed_as(v, dst) for v in moved.data.values())
  same, ident = redistribute_batch(moved, lengths, dst, dst)
  assert all(same.data[k] is moved.data[k] for k in moved.data)
  np.testing.assert_array_equal(ident, np.arange(16))


def test_redistribute_batch_can_keep_grpo_groups_together():
  mesh = _mesh()
  src, dst = Layout(mesh, ("host",)), Layout(mesh, ("host", "local"))
  b = to_global(expand_groups(_prompts(8), 2), src)  # 16 samples, 8 groups of 2
  lengths = (np.arange(16) * 7) % 11 + 1
  moved, perm = redistribute_batch(b, lengths, src, dst, group_size=2)
  for s in moved.data["group_id"].addressable_shards:
    ids = np.asarray(s.data)
    assert ids.size == 2 and ids[0] == ids[1], ids


def test_redistribute_batch_onto_other_devices():
  """A rollout on devices 0:4 hands its batch to training on 4:8 (trainer.max_staleness):
  every sample once, bit-identical, on the destination's devices, groups kept whole."""
  auto = jax.sharding.AxisType.Auto
  devs = np.array(jax.devices()[:8])
  src = Layout(Mesh(devs[:4], ("data",), axis_types=(auto,)), ("data",))
  dst = Layout(Mesh(devs[4:].reshape(1, 4), ("data", "fsdp"), axis_types=(auto,) * 2),
               ("data", "fsdp"))
  b = to_global(expand_groups(_prompts(8), 2), src)  # 16 samples, 8 groups of 2
  lengths = (np.arange(16) * 7) % 11 + 1
  moved, perm = redistribute_batch(b, lengths, src, dst, group_size=2)
  np.testing.assert_array_equal(np.sort(perm), np.arange(16))
  for k, v in b.data.items():
    np.testing.assert_array_equal(np.asarray(moved.data[k]), np.asarray(v)[perm])
    assert placed_as(moved.data[k], dst)
    assert {s.device for s in moved.data[k].addressable_shards} == set(devs[4:])
  for s in moved.data["group_id"].addressable_shards:
    ids = np.asarray(s.data)
    assert ids.size == 4 and ids[0] == ids[1] and ids[2] == ids[3], ids
