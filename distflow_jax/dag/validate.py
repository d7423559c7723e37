"""Validation of a workflow DAG.  Every error names the offending node(s).

Checks, in order: node syntax, duplicate ids, unknown functions, type/role/
function combinations, missing dependencies, cycles, the entry node,
reachability from it, dead ends (a non-training sink whose output nobody
uses), data flow (each function's required batch fields are made by an
ancestor, and at most one ancestor makes each non-summed field), then the
workflow rules of ``rules.py`` (one producer per field, one trainer per role, a
read critic is trained).  All of it is O(nodes + edges) and never recurses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from distflow_jax.dag import graph, rules
from distflow_jax.dag.graph import Dag  # noqa: F401 (re-exported: validate.Dag)
from distflow_jax.dag.registry import FunctionSpec, Placement, Registry
from distflow_jax.data import fields
from distflow_jax.data.fields import SUMMED
from distflow_jax.dag.spec import DagError, Node, NodeType, Role, parse_node


def build_dag(raw_nodes: Sequence[Mapping[str, Any]], registry: Registry,
              entry: str | None = None) -> Dag:
  """Parses and validates a node list; returns the DAG or raises DagError."""
  if isinstance(raw_nodes, (str, bytes)) or not isinstance(raw_nodes, Sequence):
    raise DagError(f"the DAG must be a list of node dicts, got {type(raw_nodes).__name__}")
  if not raw_nodes:
    raise DagError("the DAG is empty: give at least a generate node and a train node")

  def defaults(fn: str):
    if fn not in registry:
      registry.spec(fn)  # raises the 'unknown function' error listing names
    spec = registry.spec(fn)
    return spec.implied_type(), spec.implied_role()

  nodes: list[Node] = []
  seen: dict[str, int] = {}
  for i, raw in enumerate(raw_nodes):
    try:
      node = parse_node(raw, i, defaults)
    except DagError as e:
      node_id = raw.get("id") if isinstance(raw, Mapping) else None
      if node_id and repr(node_id) not in str(e):
        raise DagError(f"DAG node {node_id!r}: {e}") from None
      raise
    if node.id in seen:
      raise DagError(f"duplicate node id {node.id!r} (nodes #{seen[node.id]} and #{i})")
    seen[node.id] = i
    _check_kind(node, registry.spec(node.fn))
    nodes.append(node)

  ids = set(seen)
  for n in nodes:
    for d in n.deps:
      if d == n.id:
        raise DagError(f"DAG node {n.id!r} depends on itself")
      if d not in ids:
        raise DagError(f"DAG node {n.id!r} depends on {d!r}, which is not a node; "
                       f"nodes: {graph.short_list(sorted(ids))}")
  _check_acyclic(nodes)
  dag = Dag(nodes=tuple(nodes), entry=_entry(nodes, registry, entry))
  _check_reachable(dag)
  _check_sinks(dag)
  _check_data_flow(dag, registry)
  rules.check_workflow(dag, registry)
  return dag


def _check_kind(node: Node, spec: FunctionSpec) -> None:
  where = f"DAG node {node.id!r} (fn {node.fn!r})"
  if node.type not in spec.types:
    allowed = sorted(t.value for t in spec.types)
    raise DagError(f"{where}: type {node.type.value} makes no sense for this function; "
                   f"it runs as {' or '.join(allowed)}")
  if node.role not in spec.roles:
    allowed = sorted("none" if r is None else r.value for r in spec.roles)
    got = "none" if node.role is None else node.role.value
    raise DagError(f"{where}: role {got} makes no sense for this function; "
                   f"valid roles: {', '.join(allowed)}")
  if node.type is not NodeType.COMPUTE and node.role is None:
    raise DagError(f"{where}: a {node.type.value} node needs a role (it runs a model)")
  if node.type is NodeType.MODEL_TRAIN and node.role is Role.REFERENCE:
    raise DagError(f"{where}: the REFERENCE model is frozen and cannot be trained")


def _check_acyclic(nodes: list[Node]) -> None:
  ordered = graph.topological(nodes, graph.children_of(nodes))
  if len(ordered) < len(nodes):
    cycle = graph.find_cycle(nodes, ordered)
    size = "" if len(cycle) <= 13 else f" of {len(cycle) - 1} nodes"
    raise DagError(f"the DAG has a cycle{size}: {graph.cycle_text(cycle)}")


def _entry(nodes: list[Node], registry: Registry, entry: str | None) -> str:
  ids = [n.id for n in nodes]
  if entry is not None:
    if entry not in ids:
      raise DagError(f"entry node {entry!r} is not in the DAG; "
                     f"nodes: {graph.short_list(sorted(ids))}")
    if next(n for n in nodes if n.id == entry).deps:
      raise DagError(f"entry node {entry!r} must have no dependencies")
    return entry
  gens = [n.id for n in nodes if not n.deps and registry.spec(n.fn).placement is Placement.ROLLOUT]
  if len(gens) == 1:
    return gens[0]
  roots = [n.id for n in nodes if not n.deps]
  if len(roots) == 1:
    return roots[0]
  raise DagError(f"cannot tell the entry node among {graph.short_list(roots or ids)}: give "
                 f"exactly one node without dependencies (usually fn 'generate'), or set "
                 f"config.entry")


def _check_reachable(dag: Dag) -> None:
  reached, stack = {dag.entry}, [dag.entry]
  while stack:
    for c in dag.children(stack.pop()):
      if c not in reached:
        reached.add(c)
        stack.append(c)
  lost = [n.id for n in dag.nodes if n.id not in reached]
  if lost:
    raise DagError(f"DAG node(s) {graph.short_list(lost)} unreachable from the entry node "
                   f"{dag.entry!r}")


def _check_sinks(dag: Dag) -> None:
  sinks = [n for n in dag.nodes if not dag.children(n.id)]
  if not any(n.type is NodeType.MODEL_TRAIN for n in sinks):
    ends = graph.short_list([n.id for n in sinks])
    raise DagError(f"the DAG has no training sink: it ends at {ends}, "
                   f"but a workflow must end in a MODEL_TRAIN node (e.g. fn 'train.actor')")
  for n in sinks:
    if n.type is not NodeType.MODEL_TRAIN:
      raise DagError(f"DAG node {n.id!r} is a dead end: nothing depends on it and it does not "
                     f"train, so its output would be thrown away")


def _check_field_names(dag: Dag, registry: Registry) -> None:
  """Every field a node's spec requires or produces is a batch field (data/fields.py)."""
  for n in dag.nodes:
    spec = registry.spec(n.fn)
    for what, names in (("requires", spec.requires), ("produces", spec.produces)):
      for name in sorted(names):
        message = fields.unknown_message(name, f"DAG node {n.id!r}: fn {n.fn!r} {what}")
        if message is not None:
          raise DagError(message)


def _check_data_flow(dag: Dag, registry: Registry) -> None:
  _check_field_names(dag, registry)
  produces = {n.id: registry.spec(n.fn).produces for n in dag.nodes}
  # field -> up to two ancestors making it (one for a summed field): enough to tell
  # "none", "one" and "several" apart in one pass over the edges.
  seen: dict[str, dict[str, tuple[str, ...]]] = {}
  for n in dag.topological:
    acc: dict[str, tuple[str, ...]] = {}
    for d in n.deps:
      for field, makers in seen[d].items():
        _add_makers(acc, field, makers)
      for field in produces[d]:
        _add_makers(acc, field, (d,))
    seen[n.id] = acc
  for n in dag.nodes:
    for field in sorted(registry.spec(n.fn).requires):
      makers = seen[n.id].get(field, ())
      if not makers:
        raise DagError(f"DAG node {n.id!r} (fn {n.fn!r}) needs {field!r}, which none of its "
                       f"ancestors produces; add the node that makes it to its deps")
      if field not in SUMMED and len(makers) > 1:
        every = sorted(a for a in dag.ancestors(n.id) if field in produces[a])
        raise DagError(f"DAG node {n.id!r} sees {field!r} from several ancestors "
                       f"{graph.short_list(every)}; only rewards are summed, keep one producer")


def _add_makers(acc: dict[str, tuple[str, ...]], field: str, makers: tuple[str, ...]) -> None:
  cap = 1 if field in SUMMED else 2
  cur = acc.get(field, ())
  for m in makers:
    if len(cur) >= cap:
      break
    if m not in cur:
      cur += (m,)
  acc[field] = cur
