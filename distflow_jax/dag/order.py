"""The planner's greedy topological order in O((nodes + edges) log nodes).

Among the ready nodes the planner takes the one with the smallest key
``(moves data, does not follow the last node, depth, declaration index)``.
Whether a node moves data depends on the layout the batch has now, but every
node of one *group* (same placement, role and group need; see ``make_plan``)
gets the same layout, so one heap per group ordered by (depth, declaration)
holds the ready nodes that do not follow the last node, and only the nodes
the last node just made ready (its children) are compared one by one.  Each
node enters and leaves one heap once; the number of groups is small and fixed
by the registry's placements and the roles.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable

from distflow_jax.dag import graph
from distflow_jax.dag.spec import DagError, Node


class ReadyQueue:
  """Ready nodes of a DAG, handed out by the planner's preference."""

  def __init__(self, nodes: tuple[Node, ...], group_of: Callable[[Node], Hashable]):
    self._children = graph.children_of(nodes)
    ordered = graph.topological(nodes, self._children)
    if len(ordered) < len(nodes):
      raise DagError(f"the DAG has a cycle: "
                     f"{graph.cycle_text(graph.find_cycle(nodes, ordered))}")
    self._depth = graph.depths(ordered)
    self._decl = {n.id: i for i, n in enumerate(nodes)}
    self._by_id = {n.id: n for n in nodes}
    self._waiting = {n.id: len(n.deps) for n in nodes}
    self._group_of = group_of
    self._heaps: dict[Hashable, list[tuple[int, int, str]]] = {}
    self._fresh: list[Node] = []  # made ready by the last node taken: they follow it
    self.left = len(nodes)
    for n in nodes:
      if not n.deps:
        self._push(n)

  def _push(self, n: Node) -> None:
    heap = self._heaps.setdefault(self._group_of(n), [])
    heapq.heappush(heap, (self._depth[n.id], self._decl[n.id], n.id))

  def take(self, stays: Callable[[Node], bool]) -> Node:
    """Removes and returns the preferred ready node; ``stays(n)``: n runs in the
    layout the batch has now (asked once per group, of any member)."""
    best_key, best, from_fresh = None, None, False
    for n in self._fresh:
      key = (not stays(n), False, self._depth[n.id], self._decl[n.id])
      if best_key is None or key < best_key:
        best_key, best, from_fresh = key, n, True
    for heap in self._heaps.values():
      if heap:
        depth, decl, nid = heap[0]
        key = (not stays(self._by_id[nid]), True, depth, decl)
        if best_key is None or key < best_key:
          best_key, best, from_fresh = key, self._by_id[nid], False
    if best is None:
      raise DagError("no node is ready: the DAG has a cycle")
    if not from_fresh:
      heapq.heappop(self._heaps[self._group_of(best)])
    for n in self._fresh:
      if n is not best:
        self._push(n)
    self._fresh = []
    for c in self._children[best.id]:
      self._waiting[c] -= 1
      if not self._waiting[c]:
        self._fresh.append(self._by_id[c])
    self.left -= 1
    return best

  def depth(self, node_id: str) -> int:
    return self._depth[node_id]
