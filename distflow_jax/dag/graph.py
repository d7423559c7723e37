"""The DAG as a graph: `Dag` (its nodes and edges, validated by validate.py), children, topological order, a cycle, depth.

Everything here is O(nodes + edges) and iterative (no recursion), so a workflow of
any size and declaration order validates and plans in linear time.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from collections.abc import Sequence

from distflow_jax.dag.spec import Node


def children_of(nodes: Sequence[Node]) -> dict[str, list[str]]:
  """id -> ids of the nodes that depend on it, in declaration order."""
  out: dict[str, list[str]] = {n.id: [] for n in nodes}
  for n in nodes:
    for d in n.deps:
      out[d].append(n.id)
  return out


def topological(nodes: Sequence[Node], children: dict[str, list[str]]) -> list[Node]:
  """Kahn's order (roots first, ties in declaration order).  On a cycle the result is
  short: the nodes on or behind a cycle are left out (see ``find_cycle``)."""
  by_id = {n.id: n for n in nodes}
  waiting = {n.id: len(n.deps) for n in nodes}
  queue = deque(n.id for n in nodes if not n.deps)
  out: list[Node] = []
  while queue:
    nid = queue.popleft()
    out.append(by_id[nid])
    for c in children[nid]:
      waiting[c] -= 1
      if not waiting[c]:
        queue.append(c)
  return out


def find_cycle(nodes: Sequence[Node], ordered: Sequence[Node]) -> list[str]:
  """A cycle among the nodes ``topological`` left out, in data-flow order, from its
  first declared node and closed (that id again at the end)."""
  left = {n.id: n for n in nodes}
  for n in ordered:
    del left[n.id]
  # Every node left out has a dependency that was left out too: follow those.
  nid = next(iter(left))
  pos: dict[str, int] = {}
  walk: list[str] = []
  while nid not in pos:
    pos[nid] = len(walk)
    walk.append(nid)
    nid = next(d for d in left[nid].deps if d in left)
  cycle = walk[pos[nid]:][::-1]
  decl = {n.id: i for i, n in enumerate(nodes)}
  start = min(range(len(cycle)), key=lambda i: decl[cycle[i]])  # first declared
  cycle = cycle[start:] + cycle[:start]
  return cycle + cycle[:1]


def cycle_text(cycle: Sequence[str], keep: int = 6) -> str:
  """'a -> b -> a', or for a long cycle its ends around '...'."""
  cycle = [c if c.isprintable() else repr(c) for c in cycle]  # one line, always
  if len(cycle) <= 2 * keep + 1:
    return " -> ".join(cycle)
  return (f"{' -> '.join(cycle[:keep])} -> ... ({len(cycle) - 2 * keep} more) -> "
          f"{' -> '.join(cycle[-keep:])}")


def depths(ordered: Sequence[Node]) -> dict[str, int]:
  """Logical depth: 0 for a root, else 1 + the deepest dependency."""
  depth: dict[str, int] = {}
  for n in ordered:
    depth[n.id] = 1 + max((depth[d] for d in n.deps), default=-1)
  return depth


def short_list(ids: Sequence[str], limit: int = 12) -> str:
  """``str(list(ids))``, cut to its first ``limit`` ids for a one-line message."""
  ids = list(ids)
  if len(ids) <= limit:
    return str(ids)
  return f"{str(ids[:limit])[:-1]}, ... {len(ids) - limit} more]"


@dataclasses.dataclass(frozen=True)
class Dag:
  nodes: tuple[Node, ...]  # declaration order
  entry: str

  def node(self, node_id: str) -> Node:
    return self._by_id[node_id]

  @functools.cached_property
  def _by_id(self) -> dict[str, Node]:
    return {n.id: n for n in self.nodes}

  @functools.cached_property
  def _children(self) -> dict[str, list[str]]:
    return children_of(self.nodes)

  @functools.cached_property
  def topological(self) -> tuple[Node, ...]:
    """The nodes, dependencies first (Kahn's order, ties in declaration order)."""
    return tuple(topological(self.nodes, self._children))

  def children(self, node_id: str) -> list[str]:
    return list(self._children[node_id])

  def ancestors(self, node_id: str) -> set[str]:
    by_id, seen, stack = self._by_id, set(), list(self._by_id[node_id].deps)
    while stack:
      d = stack.pop()
      if d not in seen:
        seen.add(d)
        stack.extend(by_id[d].deps)
    return seen
