"""The workflow DAG as data: nodes parsed from plain config dicts.

A node is ``{"id": str, "fn": str, "type": "MODEL_INFERENCE" | "MODEL_TRAIN" |
"COMPUTE", "role": "ACTOR" | "CRITIC" | "REFERENCE" | "REWARD" | None,
"deps": [ids], "config": {overrides}}``.  ``type`` and ``role`` may be left
out when the function has exactly one sensible value for them (``generate`` is
always an ACTOR MODEL_INFERENCE node), so a config can stay short.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any


class DagError(ValueError):
  """A workflow DAG or node that cannot run; the message names the node(s)."""


class Role(enum.Enum):
  ACTOR = "ACTOR"
  CRITIC = "CRITIC"
  REFERENCE = "REFERENCE"
  REWARD = "REWARD"


class NodeType(enum.Enum):
  MODEL_INFERENCE = "MODEL_INFERENCE"
  MODEL_TRAIN = "MODEL_TRAIN"
  COMPUTE = "COMPUTE"


_NODE_KEYS = ("id", "fn", "type", "role", "deps", "config")


@dataclasses.dataclass(frozen=True)
class Node:
  id: str
  fn: str
  type: NodeType
  role: Role | None
  deps: tuple[str, ...] = ()
  # Per-node overrides of the function's config section (read-only).
  overrides: Mapping[str, Any] = dataclasses.field(
      default_factory=lambda: MappingProxyType({}), hash=False)

  def describe(self) -> str:
    role = self.role.value if self.role else "-"
    return f"{self.id} [{self.type.value}/{role}] fn={self.fn}"


def _parse_enum(enum_cls, value, what: str, where: str):
  if isinstance(value, enum_cls):
    return value
  if not isinstance(value, str):
    raise DagError(f"{where}: {what} must be a string, got {value!r}")
  try:
    return enum_cls(value.upper())
  except ValueError:
    valid = ", ".join(m.value for m in enum_cls)
    raise DagError(f"{where}: unknown {what} {value!r}; valid: {valid}") from None


def parse_node(raw: Mapping[str, Any], index: int,
               defaults: Callable[[str], tuple[NodeType | None, Role | None | str]]
               ) -> Node:
  """Parses one node dict.  ``defaults(fn)`` gives the implied type and role."""
  where = f"DAG node #{index}"
  if not isinstance(raw, Mapping):
    raise DagError(f"{where}: must be a dict with keys {list(_NODE_KEYS)}, got {raw!r}")
  node_id = raw.get("id")
  if not isinstance(node_id, str) or not node_id.strip():
    raise DagError(f"{where}: needs a non-empty string 'id', got {node_id!r}")
  where = f"DAG node {node_id!r}"
  unknown = sorted(set(raw) - set(_NODE_KEYS), key=repr)
  if unknown:
    raise DagError(f"{where}: unknown key(s) {unknown}; valid keys: {list(_NODE_KEYS)}")
  fn = raw.get("fn")
  if not isinstance(fn, str) or not fn:
    raise DagError(f"{where}: needs a function name 'fn' (a registered name)")
  implied_type, implied_role = defaults(fn)
  if "type" in raw and raw["type"] is not None:
    node_type = _parse_enum(NodeType, raw["type"], "type", where)
  elif implied_type is not None:
    node_type = implied_type
  else:
    raise DagError(f"{where}: 'type' is required for fn {fn!r} "
                   f"(one of {[t.value for t in NodeType]})")
  if "role" in raw:
    role = None if raw["role"] in (None, "", "NONE", "none") else _parse_enum(
        Role, raw["role"], "role", where)
  elif implied_role != "ambiguous":
    role = implied_role
  else:
    raise DagError(f"{where}: 'role' is required for fn {fn!r}")
  deps = raw.get("deps", ())
  if isinstance(deps, str) or not isinstance(deps, Sequence):
    raise DagError(f"{where}: 'deps' must be a list of node ids, got {deps!r}")
  for d in deps:
    if not isinstance(d, str):
      raise DagError(f"{where}: dependency {d!r} is not a node id string")
  if len(set(deps)) != len(deps):
    raise DagError(f"{where}: repeated dependency in {list(deps)}")
  overrides = raw.get("config", {}) or {}
  if not isinstance(overrides, Mapping):
    raise DagError(f"{where}: 'config' must be a dict of overrides, got {overrides!r}")
  return Node(id=node_id, fn=fn, type=node_type, role=role, deps=tuple(deps),
              overrides=MappingProxyType(dict(overrides)))
