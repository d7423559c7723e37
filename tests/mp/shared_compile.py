"""Child program: one program over both processes' devices, its result checked exactly, with
jax's compiler log on (tests/test_launcher.py reads who compiled and who waited for the
binary)."""

import logging

import numpy as np

from distflow_jax import distributed

info = distributed.initialize()

import jax  # noqa: E402  (after initialize)
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
logging.getLogger("jax._src.compiler").setLevel(logging.DEBUG)
n = jax.device_count()
mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
per = n // info.process_count
local = np.arange(info.process_index * per, (info.process_index + 1) * per, dtype=np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local)
total = jax.jit(lambda v: (v * v).sum() + v.cumsum()[-1], out_shardings=NamedSharding(mesh, P()))(x)
want = float((np.arange(n) ** 2).sum() + np.arange(n).sum())
assert float(total) == want, (float(total), want)
print(f"OK process {info.process_index}/{info.process_count} sum={float(total)}", flush=True)
