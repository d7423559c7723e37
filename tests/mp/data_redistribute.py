"""Child program: cross-process re-partition (per-host rollout -> FSDP), checked exactly."""

import numpy as np

from distflow_jax import distributed

info = distributed.initialize()

import jax  # noqa: E402  (after initialize)
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from distflow_jax.data import redistribute as rd  # noqa: E402
from distflow_jax.data.batch import Batch, redistribute_batch, to_global  # noqa: E402
from distflow_jax.data.layout import Layout, flat_mesh, host_major_mesh, placed_as  # noqa: E402
from distflow_jax.data.plan import make_repartition_plan  # noqa: E402

rows_per_host = 8
num_rows = rows_per_host * info.process_count
mine = np.arange(info.process_index * rows_per_host,
                 (info.process_index + 1) * rows_per_host)
# Every value is a function of the global sample id, so any process can check.
local = {"sample_id": mine.astype(np.int32), "group_id": (mine // 2).astype(np.int32),
         "tokens": (mine[:, None] * 1000 + np.arange(6)).astype(np.int32),
         "logp": (mine[:, None] / 7.0 + np.arange(3)).astype(np.float32),
         "mask": (mine[:, None] + np.arange(4)) % 3 == 0}
want = {k: np.concatenate([
    {"sample_id": a.astype(np.int32), "group_id": (a // 2).astype(np.int32),
     "tokens": (a[:, None] * 1000 + np.arange(6)).astype(np.int32),
     "logp": (a[:, None] / 7.0 + np.arange(3)).astype(np.float32),
     "mask": (a[:, None] + np.arange(4)) % 3 == 0}[k]
    for a in [np.arange(p * rows_per_host, (p + 1) * rows_per_host)
              for p in range(info.process_count)]]) for k in local}

src = Layout(host_major_mesh(), ("host",))
dst = Layout(flat_mesh("fsdp"), ("fsdp",))
batch = to_global(Batch(local, {int(i): {"text": f"p{i}"} for i in mine}), src)

# Lengths live sharded with the data; one small gather makes them replicated.
len_local = ((mine * 37) % 101 + 1).astype(np.int32)
lengths_g = jax.make_array_from_process_local_data(src.sharding, len_local)
lengths = rd.replicate_lengths(lengths_g)
np.testing.assert_array_equal(lengths, (np.arange(num_rows) * 37) % 101 + 1)

plan = make_repartition_plan(lengths, src, dst)
text = rd.compiled_text(dict(batch.data), plan, "distributed")
assert text.count("all-to-all(") == 1, text.count("all-to-all(")

results = {}
for mode in ("distributed", "centralized"):
  moved, perm = redistribute_batch(batch, lengths, src, dst, mode=mode)
  np.testing.assert_array_equal(perm, plan.perm_B)
  assert moved.host is batch.host
  for k, v in moved.data.items():
    assert placed_as(v, dst), (mode, k)
    for s in v.addressable_shards:
      np.testing.assert_array_equal(np.asarray(s.data), want[k][perm][s.index[0]],
                                    err_msg=f"{mode} {k}")
  jax.block_until_ready(moved.data)
  results[mode] = moved

# Balanced: each FSDP shard's token load is the assignment's, within the bound.
per = num_rows // dst.num_shards
loads = [lengths[plan.perm_B[k * per:(k + 1) * per]].sum() for k in range(dst.num_shards)]
assert max(loads) <= lengths.sum() / dst.num_shards + lengths.max(), loads

# Back to one replica per host: again one all_to_all; then the fast path.
back, perm2 = redistribute_batch(results["distributed"], lengths[plan.perm_B], dst, src)
for s in back.data["tokens"].addressable_shards:
  np.testing.assert_array_equal(np.asarray(s.data),
                                want["tokens"][plan.perm_B][perm2][s.index[0]])
same, _ = redistribute_batch(back, lengths, src, src)
assert all(same.data[k] is back.data[k] for k in back.data)

traffic = plan.traffic(rd.row_bytes(dict(batch.data)), centralized=False)
print(f"OK process {info.process_index}/{info.process_count} traffic={traffic}")
