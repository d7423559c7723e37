"""Child program: packed passes on a mesh over 2 processes equal the padded ones (issue 19).

Every process builds the same tiny model and batch (4 groups of 4 rows, one prompt per
group), computes the padded per-token log-probs and one train step's update on one local
device, then the packed ones (per-sample and shared-prompt plans, one group per row shard)
with the rows and parameters sharded over the global mesh (data 2 x fsdp 2 over both
processes), and checks them to 1e-5.  Prints one OK line per plan.
"""

import sys

import numpy as np

from distflow_jax import distributed

info = distributed.initialize()

import jax  # noqa: E402  (after initialize)
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, "tests")
import test_packing_shared as tps  # noqa: E402

from distflow_jax.models import sharding  # noqa: E402
from distflow_jax.train import packing, placement, steps  # noqa: E402

mesh = sharding.make_mesh({"data": 2, "fsdp": 2}, jax.devices())
rows, rep = NamedSharding(mesh, P(("data", "fsdp"))), NamedSharding(mesh, P())


def global_array(x: np.ndarray, where: NamedSharding) -> jax.Array:
  """The same host array on every process -> one global array laid out as `where`."""
  return jax.make_array_from_callback(x.shape, where, lambda idx: x[idx])


def whole(x: jax.Array) -> np.ndarray:
  return packing.host_array(x)


graphdef, params = tps.model()
batch = tps._old(graphdef, params, tps.make_batch(6))
batch = {k: np.asarray(v) for k, v in batch.items()}
ref_lp, _ = tps.logprobs(graphdef, params, batch, gs=1)
ref_p, _ = tps._train(graphdef, params, batch, 1, gs=1)
host_params = jax.tree.map(np.asarray, params)
for name, gs in (("per-sample", 1), ("shared", tps.GS)):
  sp = jax.tree.map(lambda x, s: global_array(x, s), host_params,
                    sharding.state_shardings(params, mesh, sharding.fsdp_tp_rules()))
  data = {k: global_array(v, rows) for k, v in batch.items()}
  pk, _ = packing.plan(batch["prompt_mask"], batch["response_mask"], 0, 4, gs)
  pack = {k: global_array(np.asarray(v), rep) for k, v in pk.items()}
  lp_fn = jax.jit(placement.rows_sharded_on(
      lambda g, p, b: steps.response_logprobs(g, p, b, group_size=gs)[0], mesh),
      static_argnums=0)
  lp = whole(lp_fn(graphdef, sp, {**data, "pack": pack}))
  np.testing.assert_allclose(lp, ref_lp, atol=1e-5)
  parts, _ = packing.plan_parts(batch["prompt_mask"], batch["response_mask"], 0, 1, gs, 4, gs)
  new_p, _ = tps._train(graphdef, sp, {**data, "pack": {k: global_array(np.asarray(v), rep)
                                                       for k, v in parts.items()}}, 1, gs=gs)
  for a, b in zip(jax.tree.leaves(ref_p), jax.tree.leaves(new_p)):
    np.testing.assert_allclose(whole(b), np.asarray(a), atol=1e-5)
  print(f"OK {name} process {info.process_index}/{info.process_count}", flush=True)
