"""run/links.py in one process: the weights' and a batch's way between groups of unequal
device counts, each copy a mirror copy (as across processes), every value where it was.
The cross-process runs are tests/test_async_multiprocess.py's."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from distflow_jax.config.async_checks import ratio
from distflow_jax.models import sharding
from distflow_jax.run import links, transfer


def _params(mesh):
  """Parameters sharded the way the rules shard them, over the axes ``mesh`` has."""
  rs = np.random.RandomState(0)
  keep = lambda *axes: P(*[a if a in mesh.axis_names else None for a in axes])
  specs = {"kernel": keep("fsdp", "tensor"), "embed": keep("tensor", "fsdp"), "scale": P()}
  shapes = {"kernel": (8, 4), "embed": (6, 8), "scale": (4,)}
  return {k: jax.device_put(rs.randn(*shapes[k]).astype(np.float32),
                            NamedSharding(mesh, specs[k])) for k in specs}


def _shardings(tree):
  return jax.tree.map(lambda x: x.sharding, tree)


@pytest.mark.timeout(60)
def test_counts_and_blocks():
  assert ratio(2, 8) == ratio(8, 2) == 4 and ratio(3, 3) == 1
  assert ratio(3, 4) is None and ratio(0, 4) is None
  assert links.block_counts((2, 2, 1), 4) == (2, 2, 1)
  assert links.block_counts((1, 4, 2), 4) == (1, 4, 1)
  assert links.block_counts((1, 6, 2), 4) == (1, 2, 2)
  assert links.block_counts((1, 3, 1), 2) is None  # 2 does not divide the mesh's 3 devices


@pytest.mark.timeout(60)
@pytest.mark.parametrize("axes", [{"data": 1, "fsdp": 2, "tensor": 1},
                                  {"fsdp": 2}])  # no data axis: one is put in front
def test_weights_onto_a_rollout_of_more_devices(axes):
  devs = jax.devices()
  actor = sharding.make_mesh(axes, devs[:2])
  params = _params(actor)
  w = links.WeightLinks.of(_shardings(params), actor, devs[4:8])
  assert w.grow and len(w.dst) == 2 and w.snap is None
  assert w.mesh.shape["data"] == 2 * axes.get("data", 1) and w.mesh.devices.size == 4
  got = w.receive(params)  # in one process the "placeholders" are the arrays themselves
  for k, x in params.items():
    assert got[k].sharding == w.final[k]
    assert set(got[k].sharding.device_set) == set(devs[4:8])
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(x))
    for shard in got[k].addressable_shards:  # each block holds the actor's own shards
      np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(x)[shard.index])


@pytest.mark.timeout(60)
def test_weights_onto_a_rollout_of_fewer_devices():
  devs = jax.devices()
  actor = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2}, devs[:8])
  params = _params(actor)
  rollout = devs[6:8]  # any two devices: in one process the copy needs no disjoint ones
  w = links.WeightLinks.of(_shardings(params), actor, rollout)
  assert not w.grow and w.snap is not None
  assert dict(w.mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 2}  # 8 = 4 blocks of 2
  snap = jax.jit(lambda t: jax.tree.map(lambda x: x.copy(), t), out_shardings=w.snap)(params)
  [block] = w.blocks(snap)
  got = transfer.copy(block, w.dst[0])
  for k, x in params.items():
    assert set(block[k].sharding.device_set) < set(devs[:8])
    assert len(block[k].sharding.device_set) == 2
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(x))
    assert set(got[k].sharding.device_set) == set(rollout)


@pytest.mark.timeout(60)
def test_a_parameter_over_data_or_counts_that_do_not_divide_are_refused():
  devs = jax.devices()
  actor = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 1}, devs[:2])
  x = {"w": jax.device_put(np.zeros((4, 2), np.float32), NamedSharding(actor, P("data")))}
  with pytest.raises(ValueError, match="sharded over the mesh axis 'data'"):
    links.WeightLinks.of(_shardings(x), actor, devs[4:8])
  with pytest.raises(ValueError, match="one count must be a multiple of the other"):
    links.WeightLinks.of(_shardings(x), actor, devs[4:7])
  with pytest.raises(ValueError, match="one count must be a multiple of the other"):
    links.BatchLinks.of(NamedSharding(actor, P("data")), devs[4:7])


def _rows_layout(devices, data, tensor):
  mesh = sharding.make_mesh({"data": data, "tensor": tensor}, devices)
  return NamedSharding(mesh, P("data"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rollout,train", [((0, 4), (4, 6)), ((0, 2), (2, 8)), ((0, 4), (4, 8))],
                         ids=["R=4,T=2", "R=2,T=6", "R=T=4"])
def test_a_batch_between_unequal_groups_keeps_its_rows_in_order(rollout, train):
  devs = jax.devices()
  rdevs, tdevs = devs[rollout[0]:rollout[1]], devs[train[0]:train[1]]
  src = _rows_layout(rdevs, len(rdevs) // 2 if len(rdevs) > 2 else len(rdevs),
                     2 if len(rdevs) > 2 else 1)  # rows replicated over tensor, or not
  dst_layout = _rows_layout(tdevs, len(tdevs), 1)
  n = 12 if len(tdevs) == 6 else 8
  data = {"tokens": jax.device_put(np.arange(n * 3, dtype=np.int32).reshape(n, 3), src),
          "mask": jax.device_put(np.arange(n) % 3 == 0, src)}
  b = links.BatchLinks.of(src, tdevs)
  parts = b.make_parts(data)
  assert len(parts) == b.parts == (links.ratio(len(rdevs), len(tdevs)) or 0)
  keys = sorted(data)
  shapes = [list(data[k].shape) for k in keys]
  got = []
  for part, s, d in zip(parts, b.src, b.dst):
    assert all(part[k].sharding == s and part[k].shape == b.part_shape(list(data[k].shape))
               for k in keys)
    got.append(transfer.copy([part[k] for k in keys], [d] * len(keys)))
  fields = dict(zip(keys, b.joined(got, shapes)))
  placed = links.place_program(dst_layout)(fields)
  for k in keys:
    assert placed[k].sharding == dst_layout
    np.testing.assert_array_equal(np.asarray(placed[k]), np.asarray(data[k]))
