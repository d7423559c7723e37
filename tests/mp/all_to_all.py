"""Child program: cross-process all_to_all over a global mesh, checked exactly."""

import numpy as np

from distflow_jax import distributed

info = distributed.initialize()

import jax  # noqa: E402  (after initialize)
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

n = jax.device_count()
mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
# Global [n, n] matrix with value 100*row + col; device d holds row d.
rows_per_proc = n // info.process_count
local = np.array([[100 * r + c for c in range(n)]
                  for r in range(info.process_index * rows_per_proc,
                                 (info.process_index + 1) * rows_per_proc)],
                 dtype=np.int32)
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local)

a2a = jax.jit(jax.shard_map(
    lambda b: jax.lax.all_to_all(b, "x", 1, 0, tiled=True),
    mesh=mesh, in_specs=P("x"), out_specs=P("x")))
y = a2a(x)
# all_to_all transposes the block layout: device d now holds column d.
for shard in y.addressable_shards:
  d = shard.index[0].start // n
  got = np.asarray(shard.data).reshape(-1)
  want = np.array([100 * r + d for r in range(n)], dtype=np.int32)
  assert np.array_equal(got, want), (d, got, want)
print(f"OK process {info.process_index}/{info.process_count} devices={n}")
