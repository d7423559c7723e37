"""Re-partition on 8 simulated devices: fast path, one all_to_all, centralized baseline."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh

from distflow_jax.data import assign
from distflow_jax.data import redistribute as rd
from distflow_jax.data.layout import Layout, equivalent, placed_as
from distflow_jax.data.plan import make_repartition_plan

MESH_SHAPES = [((8,), ("a",)), ((2, 4), ("a", "b")), ((4, 2), ("a", "b")),
               ((2, 2, 2), ("a", "b", "c"))]


def _mesh(shape, names, perm=None):
  devs = np.array(jax.devices()[:8], dtype=object)
  if perm is not None:
    devs = devs[np.asarray(perm)]
  return Mesh(devs.reshape(shape), names,
              axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def _batch(num_rows, layout, seed=0):
  rng = np.random.default_rng(seed)
  host = {
      "sample_id": np.arange(num_rows, dtype=np.int32),
      "tokens": rng.integers(-2**31, 2**31 - 1, (num_rows, 5), dtype=np.int64)
      .astype(np.int32),
      "logp": rng.standard_normal((num_rows, 3, 2)).astype(np.float32),
      "mask": rng.random((num_rows, 4)) < 0.5,
      "small": rng.integers(-128, 127, (num_rows,), dtype=np.int8),
  }
  return host, {k: jax.device_put(v, layout.sharding) for k, v in host.items()}


def _check_moved(host, out, perm, dst, num_rows):
  # Every sample exactly once, contents bit-identical, placed as dst.
  np.testing.assert_array_equal(np.sort(perm), np.arange(num_rows))
  np.testing.assert_array_equal(np.asarray(out["sample_id"]), perm)
  for k, v in host.items():
    np.testing.assert_array_equal(np.asarray(out[k]), v[perm], err_msg=k)
    assert placed_as(out[k], dst), k
    for s in out[k].addressable_shards:
      np.testing.assert_array_equal(np.asarray(s.data), v[perm][s.index[0]])


@st.composite
def layouts(draw):
  shape, names = draw(st.sampled_from(MESH_SHAPES))
  perm = draw(st.permutations(range(8)))
  axes = draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names)))
  return Layout(_mesh(shape, names, perm), tuple(axes))


@pytest.mark.timeout(180)
@settings(max_examples=15, deadline=None)
@given(layouts(), layouts(), st.integers(1, 4), st.integers(0, 2**31 - 1),
       st.sampled_from(["distributed", "centralized"]))
def test_property_every_sample_arrives_once_unchanged(src, dst, mult, seed, mode):
  num_rows = 8 * mult
  lengths = np.random.default_rng(seed).integers(0, 500, num_rows)
  host, x = _batch(num_rows, src, seed % 1000)
  out, perm = rd.redistribute(x, lengths, src, dst, mode=mode)
  _check_moved(host, out, perm, dst, num_rows)
  if not equivalent(src, dst, num_rows):
    plan = make_repartition_plan(lengths, src, dst)
    np.testing.assert_array_equal(perm, plan.perm_B)
    # The rows each destination shard got are the balanced assignment's.
    per = num_rows // dst.num_shards
    for s in range(dst.num_shards):
      np.testing.assert_array_equal(np.sort(perm[s * per:(s + 1) * per]),
                                    np.flatnonzero(plan.dst_B == s))


def test_rollout_to_fsdp_moves_balanced_rows_with_one_all_to_all():
  mesh = _mesh((2, 4), ("host", "local"))
  src, dst = Layout(mesh, ("host",)), Layout(_mesh((8,), ("fsdp",)), ("fsdp",))
  num_rows = 64
  lengths = np.random.default_rng(1).integers(1, 1000, num_rows)
  host, x = _batch(num_rows, src)
  plan = make_repartition_plan(lengths, src, dst)
  # 64 rows / 8 senders = 8 rows each, one per destination: no padding.
  assert plan.rows_per_sender == 8 and plan.block == 1
  text = rd.compiled_text(x, plan, "distributed")
  assert text.count("all-to-all(") == 1
  for other in ("all-gather(", "all-reduce(", "collective-permute(",
                "reduce-scatter("):
    assert other not in text, other
  out, perm = rd.redistribute(x, lengths, src, dst)
  _check_moved(host, out, perm, dst, num_rows)
  loads = [lengths[perm[k * 8:(k + 1) * 8]].sum() for k in range(8)]
  np.testing.assert_array_equal(
      loads, assign.destination_loads(lengths, plan.dst_B, 8))
  assert max(loads) <= lengths.sum() / 8 + lengths.max()


def test_centralized_matches_distributed_and_uses_process_zero():
  mesh = _mesh((2, 4), ("host", "local"))
  src, dst = Layout(mesh, ("host",)), Layout(mesh, ("host", "local"))
  lengths = np.random.default_rng(2).integers(1, 100, 32)
  host, x = _batch(32, src)
  a, pa = rd.redistribute(x, lengths, src, dst, mode="distributed")
  b, pb = rd.redistribute(x, lengths, src, dst, mode="centralized")
  np.testing.assert_array_equal(pa, pb)
  for k in host:
    np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
  plan = make_repartition_plan(lengths, src, dst)
  text = rd.compiled_text(x, plan, "centralized")
  assert "all-to-all(" not in text and "collective-permute" in text


def test_fast_path_same_layout_returns_same_arrays_and_compiles_nothing():
  mesh = _mesh((2, 4), ("host", "local"))
  lay = Layout(mesh, ("host", "local"))
  _, x = _batch(16, lay)
  before = rd._program.cache_info().misses
  out, perm = rd.redistribute(x, np.ones(16), lay, Layout(mesh, ("host", "local")))
  assert out is x
  assert all(out[k] is x[k] for k in x)
  np.testing.assert_array_equal(perm, np.arange(16))
  assert rd._program.cache_info().misses == before


def test_fast_path_equivalent_layout_reuses_buffers():
  # (2,4) sharded over both axes puts the same rows on the same devices as a
  # flat mesh of those devices: re-labelled, not moved.
  mesh = _mesh((2, 4), ("host", "local"))
  src = Layout(mesh, ("host", "local"))
  dst = Layout(_mesh((8,), ("fsdp",)), ("fsdp",))
  assert equivalent(src, dst, 16)
  _, x = _batch(16, src)
  out, _ = rd.redistribute(x, np.ones(16), src, dst)
  for k in x:
    assert out[k].sharding == dst.sharding
    got = {s.device: s.data.unsafe_buffer_pointer() for s in out[k].addressable_shards}
    want = {s.device: s.data.unsafe_buffer_pointer() for s in x[k].addressable_shards}
    assert got == want


def test_layout_not_equivalent_when_device_order_differs():
  a = Layout(_mesh((8,), ("x",)), ("x",))
  b = Layout(_mesh((8,), ("x",), perm=[1, 0, 2, 3, 4, 5, 6, 7]), ("x",))
  assert not equivalent(a, b, 8)
  assert equivalent(a, Layout(_mesh((8,), ("y",)), ("y",)), 8)


def test_errors_name_the_culprit():
  mesh = _mesh((2, 4), ("host", "local"))
  src, dst = Layout(mesh, ("host",)), Layout(mesh, ("host", "local"))
  _, x = _batch(16, dst)
  with pytest.raises(ValueError, match=r"\['logp'\].*not placed as the source"):
    rd.redistribute({"logp": x["logp"]}, np.ones(16), src, dst)
  with pytest.raises(ValueError, match="valid modes"):
    rd.redistribute(x, np.ones(16), dst, src, mode="driver")
  with pytest.raises(ValueError, match="not a mesh axis"):
    Layout(mesh, ("fsdp",))
  sub = Layout(Mesh(np.array(jax.devices()[:4]), ("x",),
                    axis_types=(jax.sharding.AxisType.Auto,)), ("x",))
  with pytest.raises(ValueError, match="different devices"):
    make_repartition_plan(np.ones(16), src, sub)
  with pytest.raises(ValueError, match="multiple of 8"):
    make_repartition_plan(np.ones(12), src, dst)


class _FakeDevice:
  def __init__(self, process_index):
    self.process_index = process_index


def test_traffic_accounting_by_hand():
  mesh = _mesh((2, 4), ("host", "local"))
  src, dst = Layout(mesh, ("host",)), Layout(mesh, ("host", "local"))
  plan = make_repartition_plan(np.arange(32) + 1, src, dst)  # R = 4 rows per sender, C = 1
  assert plan.block == 1
  # Pretend the 8 devices are 2 processes x 4 devices.
  import dataclasses
  fake = dataclasses.replace(plan, senders=tuple(_FakeDevice(p) for p in
                                                 [0, 0, 0, 0, 1, 1, 1, 1]))
  # Distributed: each device sends one 1-row block to each of the 4 devices of
  # the other process: 4 devices x 4 blocks x 10 bytes.
  assert fake.traffic(10, centralized=False) == {0: (160, 160), 1: (160, 160)}
  # Centralized: process 1's 4 devices send R=4 rows each to process 0 and get
  # M=4 rows each back; process 0 mirrors it.
  assert fake.traffic(10, centralized=True) == {0: (160, 160), 1: (160, 160)}
  fake3 = dataclasses.replace(plan, senders=tuple(_FakeDevice(p) for p in
                                                  [0, 0, 1, 1, 2, 2, 3, 3]))
  # 4 processes: distributed, each device -> 6 remote devices: 2 x 6 x 10.
  assert fake3.traffic(10, centralized=False) == {p: (120, 120) for p in range(4)}
  # Centralized: processes 1..3 send 2 x 4 rows and receive 2 x 4 rows; the
  # hub handles all three.
  want = {p: (80, 80) for p in range(1, 4)}
  want[0] = (240, 240)
  assert fake3.traffic(10, centralized=True) == want
