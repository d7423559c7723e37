"""The node catalogue: the built-in DAG node functions, one module per family.

``rollout`` (generate), ``rewards`` (rule rewards, reward model), ``passes`` (logprob,
ref_logprob, values), ``advantages`` (the estimators of ``algos.estimators``) and ``training``
(train.actor, train.critic).  Each family's ``NODES`` maps registry names to node
functions; ``bind_builtins`` binds them all into ``dag.registry.FUNCTIONS``.

Importing this package imports no family (nor jax): the registry reads
``algos.estimators`` while the planner runs without jax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from distflow_jax.dag.registry import FUNCTIONS

if TYPE_CHECKING:
  from distflow_jax.dag.registry import Registry
  from distflow_jax.nodes.common import NodeTable

FAMILIES = ("rollout", "rewards", "passes", "advantages", "training")


def tables() -> dict[str, NodeTable]:
  """Family name -> its table of built-in node functions (imports the families)."""
  return {f: importlib.import_module(f"{__name__}.{f}").NODES for f in FAMILIES}


def bind_builtins(registry: Registry | None = None) -> None:
  """Binds every family's node functions to their names in ``registry`` (default: the
  global ``FUNCTIONS``)."""
  registry = FUNCTIONS if registry is None else registry
  for table in tables().values():
    for name, fn in table.items():
      registry.bind(name, fn)
