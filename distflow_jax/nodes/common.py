"""What the node families share: the node function type and the batch helpers.

A node function is ``fn(ctx, node, layout, batch) -> batch``: it reads fields of the
batch (global arrays laid out as ``layout``), adds the fields it makes, and records
metrics in ``ctx.metrics``.  Each family module exposes ``NODES``, a table from registry
name to node function, which ``distflow_jax.nodes.bind_builtins`` binds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from distflow_jax.data.batch import GROUP_ID, SAMPLE_ID, Batch, to_local
from distflow_jax.train.image_inputs import IMAGE_FIELDS

if TYPE_CHECKING:
  from distflow_jax.dag.spec import Node
  from distflow_jax.data.layout import Layout
  from distflow_jax.state.context import RunContext

NodeFn = Callable[["RunContext", "Node", "Layout", Batch], Batch]
# A family's table: registry name -> node function.
NodeTable = Mapping[str, NodeFn]

# The token fields every model pass and train step reads.
SEQ_FIELDS = ("prompt_tokens", "prompt_mask", "response_tokens", "response_mask")


def seq(batch: Batch) -> dict:
  """The batch's token fields (``SEQ_FIELDS``), and its image fields when it has them
  (train/image_inputs.py), as the model passes take them."""
  return {k: batch.data[k] for k in (*SEQ_FIELDS, *IMAGE_FIELDS) if k in batch.data}


def local_fields(batch: Batch, *keys: str) -> dict[str, np.ndarray]:
  """This host's rows of ``keys`` (plus sample and group ids), as numpy."""
  sub = Batch({k: batch.data[k] for k in (*keys, SAMPLE_ID, GROUP_ID)})
  return dict(to_local(sub).data)
