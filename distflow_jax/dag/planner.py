"""The planner: a validated DAG -> a sequential chain with a layout per node.

Every process calls ``make_plan`` with the same config and topology and gets
the same plan; it then keeps its own portion (``Plan.portion``).  Nothing is
sent between processes to agree on it.

Ordering.  A topological order is built greedily: among the ready nodes, one
that runs in the layout the batch already has comes first (no data moves),
then one that consumes what the last node just made (the chain follows the
data), then the smallest logical depth, then declaration order.  For GRPO this
yields DistFlow's order (rewards and group advantages before the batch is
re-partitioned for the model passes); for PPO it yields generate, reward,
old_logprob, ref_logprob, values, advantage, train_critic, train_actor.  The
order is found with heaps (``order.py``) in O((nodes + edges) log nodes).

Layouts.  A layout is the ordered device list plus the data-parallel size
over it; the batch is split into ``dp_size`` equal parts in device order.
Two layouts with the same devices and DP size need no data movement (the
fast path).  ``generate`` runs on per-host rollout replicas over the actor's
devices (``tensor_parallel`` devices each, inside one host or across whole hosts:
``replicas.py``); model nodes run
on their role's mesh (DP = data x fsdp); host-side COMPUTE nodes run where the
batch is, except that a node needing whole prompt groups after a
re-partition moves the batch back to the rollout layout.

Transitions and layouts are typed (``Move``, ``LayoutKind``): code decides
on the enum members; a layout's ``name`` and the members' values are for
display only (``render``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from distflow_jax.dag import replicas
from distflow_jax.dag.order import ReadyQueue
from distflow_jax.dag.registry import Placement, Registry
from distflow_jax.dag.spec import DagError, Node, Role
from distflow_jax.dag.validate import Dag

MESH_AXES = ("data", "fsdp", "tensor")
DP_AXES = ("data", "fsdp")


class Move(enum.Enum):
  """How the batch reaches a chain step, or travels along a DAG edge."""
  ENTRY = "entry"  # the chain's first step: the batch starts here
  FAST = "fast"  # same devices and DP size: nothing is copied
  REPARTITION = "repartition"  # one all-to-all into the next layout


class LayoutKind(enum.Enum):
  """Where a layout comes from (host-side nodes inherit the batch's layout)."""
  ROLLOUT = "rollout"  # per-host rollout replicas over the actor's devices
  ROLE_MESH = "mesh"  # a role's model mesh


@dataclasses.dataclass(frozen=True)
class Topology:
  num_processes: int
  devices_per_process: int

  def __post_init__(self):
    if self.num_processes < 1 or self.devices_per_process < 1:
      raise ValueError(f"topology needs >= 1 process and device, got {self}")

  @property
  def num_devices(self) -> int:
    return self.num_processes * self.devices_per_process

  def process_of(self, device: int) -> int:
    return device // self.devices_per_process

  def devices_of(self, process: int) -> tuple[int, ...]:
    start = process * self.devices_per_process
    return tuple(range(start, start + self.devices_per_process))


@dataclasses.dataclass(frozen=True)
class RoleMesh:
  role: Role
  devices: tuple[int, ...]
  axes: tuple[tuple[str, int], ...]  # (name, size) in MESH_AXES order

  @property
  def dp_size(self) -> int:
    return _prod(s for a, s in self.axes if a in DP_AXES)

  @property
  def shape(self) -> dict[str, int]:
    return dict(self.axes)


@dataclasses.dataclass(frozen=True)
class NodeLayout:
  name: str  # display only
  kind: LayoutKind
  devices: tuple[int, ...]
  dp_size: int
  role: Role | None = None  # a ROLE_MESH layout's role: its batch lies on that role's mesh

  def same_data_layout(self, other: "NodeLayout") -> bool:
    return self.devices == other.devices and self.dp_size == other.dp_size


@dataclasses.dataclass(frozen=True)
class Step:
  index: int
  node: Node
  layout: NodeLayout
  move_in: Move
  groups_intact: bool  # every prompt group on one host when the node runs


@dataclasses.dataclass(frozen=True)
class Edge:
  src: str
  dst: str
  kind: Move  # FAST or REPARTITION


@dataclasses.dataclass(frozen=True)
class Plan:
  steps: tuple[Step, ...]
  edges: tuple[Edge, ...]
  topology: Topology
  meshes: tuple[RoleMesh, ...]
  rollout_tensor_parallel: int

  def step(self, node_id: str) -> Step:
    return self._by_id[node_id]

  @functools.cached_property
  def _by_id(self) -> dict[str, Step]:
    return {s.node.id: s for s in self.steps}

  @property
  def order(self) -> list[str]:
    return [s.node.id for s in self.steps]

  def repartitions(self) -> list[tuple[str, str]]:
    """Chain transitions where the batch is re-partitioned (one all-to-all each)."""
    return [(self.steps[s.index - 1].node.id, s.node.id)
            for s in self.steps if s.move_in is Move.REPARTITION]

  def portion(self, process: int) -> list[tuple[Step, tuple[int, ...]]]:
    """The steps this process takes part in, with its local devices for each."""
    if not 0 <= process < self.topology.num_processes:
      raise ValueError(f"process {process} out of range [0, {self.topology.num_processes})")
    local = set(self.topology.devices_of(process))
    out = []
    for s in self.steps:
      mine = tuple(d for d in s.layout.devices if d in local)
      if mine:
        out.append((s, mine))
    return out


def _prod(xs) -> int:
  out = 1
  for x in xs:
    out *= x
  return out


def _is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _as_dict(x: Any, where: str, what: str) -> dict:
  if x is None:
    return {}
  if isinstance(x, Mapping):
    return dict(x)
  if hasattr(x, "to_dict"):  # an ml_collections.ConfigDict
    return dict(x.to_dict())
  raise DagError(f"{where} must be {what}, got {x!r}")


def parse_devices(spec: Any, topo: Topology, where: str) -> tuple[int, ...]:
  """'all' | 'a:b' (global device ids, b exclusive) | list of ids."""
  n = topo.num_devices
  if spec in (None, "all", ""):
    return tuple(range(n))
  if isinstance(spec, str):
    try:
      a, b = (int(x) if x else None for x in spec.split(":"))
    except ValueError:
      raise DagError(f"{where}: devices {spec!r} must be 'all', 'start:stop' or a list") from None
    a = 0 if a is None else a
    b = n if b is None else b
    if not 0 <= a < b <= n:
      raise DagError(f"{where}: devices {spec!r} is not a range inside 0:{n} "
                     f"({topo.num_processes} processes x {topo.devices_per_process} devices)")
    devs = tuple(range(a, b))
  elif isinstance(spec, Sequence) and all(_is_int(d) for d in spec):
    devs = tuple(spec)
  else:
    raise DagError(f"{where}: devices {spec!r} must be 'all', 'start:stop' or a list")
  bad = [d for d in devs if not 0 <= d < n]
  if not devs or bad or len(set(devs)) != len(devs):
    raise DagError(f"{where}: devices {spec!r} select {list(devs)}, but valid ids are "
                   f"0..{n - 1} ({topo.num_processes} processes x "
                   f"{topo.devices_per_process} devices), each at most once")
  return devs


def role_mesh(role: Role, placement: Mapping[str, Any] | None, topo: Topology) -> RoleMesh:
  where = f"placement.{role.value.lower()}"
  placement = _as_dict(placement, where, "a dict with keys devices, mesh")
  unknown = sorted(set(placement) - {"devices", "mesh"}, key=repr)
  if unknown:
    raise DagError(f"{where}: unknown key(s) {unknown}; valid: devices, mesh")
  devs = parse_devices(placement.get("devices", "all"), topo, where)
  shape = _as_dict(placement.get("mesh") or {"fsdp": -1}, f"{where}.mesh",
                   f"a dict of axis sizes over {list(MESH_AXES)}")
  bad = sorted(set(shape) - set(MESH_AXES), key=repr)
  if bad:
    raise DagError(f"{where}.mesh: unknown axis {bad}; valid axes: {list(MESH_AXES)}")
  sizes = {a: shape.get(a, 1) for a in MESH_AXES}
  for a, s in sizes.items():
    if not _is_int(s) or s == 0 or s < -1:
      raise DagError(f"{where}.mesh.{a} = {s!r}: must be a positive int or -1 (fill)")
  fills = [a for a, s in sizes.items() if s == -1]
  if len(fills) > 1:
    raise DagError(f"{where}.mesh: only one axis may be -1, got {fills}")
  known = _prod(s for s in sizes.values() if s != -1)
  if fills:
    if len(devs) % known:
      raise DagError(f"{where}.mesh {sizes}: {len(devs)} devices do not divide by {known}")
    sizes[fills[0]] = len(devs) // known
  if _prod(sizes.values()) != len(devs):
    raise DagError(f"{where}.mesh {sizes} has {_prod(sizes.values())} devices but the role "
                   f"has {len(devs)} ({topo.num_processes} processes x "
                   f"{topo.devices_per_process} devices)")
  return RoleMesh(role=role, devices=devs, axes=tuple((a, sizes[a]) for a in MESH_AXES))


def rollout_devices(spec: Any, actor: RoleMesh, topo: Topology) -> tuple[int, ...]:
  """``placement.rollout``: {devices: "actor" (the default: the actor's devices) | a device
  spec as a role's}; the rollout replicas then run on devices of their own."""
  spec = _as_dict(spec, "placement.rollout", "a dict with key devices")
  unknown = sorted(set(spec) - {"devices"}, key=repr)
  if unknown:
    raise DagError(f"placement.rollout: unknown key(s) {unknown}; valid: devices")
  devices = spec.get("devices", "actor")
  if devices == "actor":
    return actor.devices
  return parse_devices(devices, topo, "placement.rollout")


def rollout_layout(actor: RoleMesh, tp: int, topo: Topology, spec: Any = None) -> NodeLayout:
  if not _is_int(tp) or tp < 1:
    raise DagError(f"rollout.tensor_parallel must be an int >= 1, got {tp!r}")
  devices = rollout_devices(spec, actor, topo)
  on = "actor" if devices == actor.devices else "placement.rollout"
  groups = replicas.replica_groups(devices, tp, topo.process_of, on)  # or refused
  name = f"rollout({'actor' if on == 'actor' else 'own'}, tp={tp})"
  # The batch's rows: split over the replicas' data axes, or per process where a replica
  # spans hosts (each of its processes keeps its own rows: rollout/spanning.py).
  dp = sum(map(len, groups)) if replicas.spans_hosts(groups) else len(devices) // tp
  return NodeLayout(name=name, kind=LayoutKind.ROLLOUT, devices=devices, dp_size=dp)


def make_plan(dag: Dag, registry: Registry, topo: Topology,
              placement: Mapping[str, Any] | None = None,
              rollout_tensor_parallel: int = 1) -> Plan:
  placement = _as_dict(placement, "placement", "a dict of role -> {devices, mesh}")
  valid_roles = {r.value.lower() for r in Role} | {"rollout"}
  for key in placement:
    if key not in valid_roles:
      name = f"placement.{key}" if isinstance(key, str) and key.isidentifier() else (
          f"placement key {key!r}")
      raise DagError(f"{name}: unknown role; valid: {sorted(valid_roles)}")
  used = sorted({n.role for n in dag.nodes if n.role is not None}, key=lambda r: r.value)
  if any(registry.spec(n.fn).placement is Placement.ROLLOUT for n in dag.nodes):
    used = sorted(set(used) | {Role.ACTOR}, key=lambda r: r.value)
  meshes = {r: role_mesh(r, placement.get(r.value.lower()), topo) for r in used}
  rollout = (rollout_layout(meshes[Role.ACTOR], rollout_tensor_parallel, topo,
                            placement.get("rollout")) if Role.ACTOR in meshes else None)

  def layout_of(node: Node, current: NodeLayout | None, intact: bool) -> NodeLayout:
    spec = registry.spec(node.fn)
    if spec.placement is Placement.ROLLOUT:
      return rollout
    if spec.placement is Placement.ROLE_MESH:
      if node.role not in meshes:
        raise DagError(f"DAG node {node.id!r} (fn {node.fn!r}) runs on a role's mesh but "
                       f"has no role")
      m = meshes[node.role]
      return NodeLayout(name=f"mesh({node.role.value.lower()}, dp={m.dp_size})",
                        kind=LayoutKind.ROLE_MESH, devices=m.devices, dp_size=m.dp_size,
                        role=node.role)
    if current is None:
      raise DagError(f"DAG node {node.id!r}: a host-side COMPUTE node cannot start the "
                     f"workflow; it needs data from a model node")
    if spec.needs_groups and not intact:
      if rollout is None:
        raise DagError(f"DAG node {node.id!r} needs whole prompt groups but nothing generates")
      return rollout
    return current

  def group_of(node: Node):
    # Nodes of one group always get the same layout (see layout_of).
    spec = registry.spec(node.fn)
    if spec.placement is Placement.ROLE_MESH:
      return spec.placement, node.role
    return spec.placement, spec.placement is Placement.INHERIT and spec.needs_groups

  ready = ReadyQueue(dag.nodes, group_of)
  steps: list[Step] = []
  current: NodeLayout | None = None
  intact = True
  while ready.left:
    node = ready.take(lambda n: current is not None
                      and layout_of(n, current, intact).same_data_layout(current))
    lay = layout_of(node, current, intact)
    if current is None:
      move = Move.ENTRY
    elif lay.same_data_layout(current):
      move = Move.FAST
    else:
      move = Move.REPARTITION
    if registry.spec(node.fn).placement is Placement.ROLLOUT:
      intact = True  # fresh samples are generated group by group on one host
    elif move is Move.REPARTITION:
      intact = lay is rollout
    steps.append(Step(index=len(steps), node=node, layout=lay, move_in=move,
                      groups_intact=intact))
    current = lay

  by_id = {s.node.id: s for s in steps}
  edges = tuple(
      Edge(src=d, dst=n.id,
           kind=(Move.FAST if by_id[d].layout.same_data_layout(by_id[n.id].layout)
                 else Move.REPARTITION))
      for n in dag.nodes for d in n.deps)
  return Plan(steps=tuple(steps), edges=edges, topology=topo,
              meshes=tuple(meshes[r] for r in used),
              rollout_tensor_parallel=rollout_tensor_parallel)
