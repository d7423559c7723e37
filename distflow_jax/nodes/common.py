"""What the node families share: the node function type and the batch helpers.

A node function is ``fn(ctx, node, layout, batch) -> NodeOut``: it reads fields of the
batch (global arrays laid out as ``layout``) and returns what it made: the batch with its
new fields, the metrics it recorded, and the new train state of a role it trained.  It
changes nothing else: ``RunContext`` is read-only to it, and the executor applies the
output (run/executor.py).  A plugin's function may return the batch alone.  Each family
module exposes ``NODES``, a table from registry name to node function, which
``distflow_jax.nodes.bind_builtins`` binds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from distflow_jax.dag.spec import DagError, Node, Role
from distflow_jax.data.batch import Batch, to_local
from distflow_jax.state.metrics import Metrics
from distflow_jax.data.fields import GROUP_ID, IMAGES, SAMPLE_ID, SEQ

if TYPE_CHECKING:
  from distflow_jax.data.layout import Layout
  from distflow_jax.state.context import RunContext


@dataclasses.dataclass(frozen=True)
class TrainedState:
  """A trained role's new parameters and optimizer state (pytrees on its mesh)."""
  params: Any
  opt_state: Any


@dataclasses.dataclass(frozen=True)
class NodeOut:
  """What a node returns: ``batch`` (the input batch plus the fields the node made),
  ``metrics`` (its own records, merged into the step's) and ``states`` (each role it
  trained: its new train state, which the executor puts in place of the old)."""
  batch: Batch
  metrics: Metrics = dataclasses.field(default_factory=Metrics)
  states: Mapping[Role, TrainedState] = dataclasses.field(default_factory=dict)


def node_out(node: Node, result: Any) -> NodeOut:
  """A node function's result as a ``NodeOut`` (a plugin's may be the batch alone)."""
  if isinstance(result, NodeOut):
    return result
  if isinstance(result, Batch):
    return NodeOut(result)
  raise DagError(f"DAG node {node.id!r}: its function {node.fn!r} returned "
                 f"{type(result).__name__}; a node function returns the batch or "
                 f"nodes.common.NodeOut(batch, metrics)")


NodeFn = Callable[["RunContext", Node, "Layout", Batch], "NodeOut | Batch"]
# A family's table: registry name -> node function.
NodeTable = Mapping[str, NodeFn]


def seq(batch: Batch) -> dict:
  """The batch's token fields (``fields.SEQ``), and its image fields when it has them
  (train/image_inputs.py), as the model passes take them."""
  return {k: batch.data[k] for k in (*SEQ, *IMAGES) if k in batch.data}


def local_fields(batch: Batch, *keys: str) -> dict[str, np.ndarray]:
  """This host's rows of ``keys`` (plus sample and group ids), as numpy."""
  sub = Batch({k: batch.data[k] for k in (*keys, SAMPLE_ID, GROUP_ID)})
  return dict(to_local(sub).data)
