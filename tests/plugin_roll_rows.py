"""A user plugin (loaded through config.plugins): a node that moves every row one place on,
so the samples of a prompt are no longer consecutive (all fields move together)."""

import dataclasses

import jax
import jax.numpy as jnp

from distflow_jax.dag.registry import FUNCTIONS
from distflow_jax.data.batch import Batch


def roll_rows(ctx, node, lay, batch):
  data = {k: jax.jit(lambda x: jnp.roll(x, 1, axis=0), out_shardings=v.sharding)(v)
          for k, v in batch.data.items()}
  return Batch(data=data, host=batch.host)


FUNCTIONS.register(dataclasses.replace(FUNCTIONS.spec("reward.format"), name="rows.roll",
                                       requires=frozenset(), produces=frozenset(),
                                       doc="test plugin: breaks groups"), roll_rows)
