"""Rollout replicas: which processes drive each one (``rollout.tensor_parallel``).

Each process drives at most one replica.  Two shapes are possible for the rollout devices
(``placement.rollout``, by default the actor's) and ``tp = rollout.tensor_parallel``:

* **inside a host** (``tp`` divides every process's L rollout devices): a process's replica
  is all its rollout devices, ``tensor`` over ``tp`` of them and ``data`` (slots) over
  ``L / tp``; each process generates its own prompts, with no cross-host traffic;
* **across hosts** (``tp`` a multiple of L, the same L on every rollout process): a replica
  is the rollout devices of ``tp / L`` consecutive processes, tensor-parallel across them.
  Those processes pool their prompts, drive the replica together (every call a
  cross-host collective step, every decision taken on replicated values:
  rollout/driver.py) and each keeps its own rows (rollout/spanning.py).

Anything else is refused with one line naming ``rollout.tensor_parallel``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from distflow_jax.dag.spec import DagError


def replica_groups(devices: Sequence[int], tp: int, process_of: Callable[[int], int],
                   on: str = "placement.rollout") -> tuple[tuple[int, ...], ...]:
  """The processes of each replica, in process order: ``((p,), ...)`` for replicas inside
  hosts, groups of ``tp / L`` consecutive processes for replicas spanning them.  ``on``
  names where the devices come from (for the message)."""
  local: dict[int, int] = {}
  for d in devices:
    local[process_of(d)] = local.get(process_of(d), 0) + 1
  procs = sorted(local)
  if all(n % tp == 0 for n in local.values()):
    return tuple((p,) for p in procs)
  counts = sorted(set(local.values()))
  span = tp // counts[0] if len(counts) == 1 and tp % counts[0] == 0 else 0
  if span > 1 and len(procs) % span == 0:
    return tuple(tuple(procs[i:i + span]) for i in range(0, len(procs), span))
  per = ", ".join(f"process {p}: {local[p]}" for p in procs)
  raise DagError(
      f"rollout.tensor_parallel={tp} does not fit the {on} devices ({per}): a replica "
      f"either stays inside one host (tensor_parallel dividing each process's count) or "
      f"spans whole processes (tensor_parallel a multiple of a count every rollout process "
      f"shares, over a number of processes it divides)")


def group_of(groups: Sequence[tuple[int, ...]], process: int) -> tuple[int, ...]:
  """The processes that drive ``process``'s replica with it (``()``: it drives none)."""
  return next((g for g in groups if process in g), ())


def spans_hosts(groups: Sequence[tuple[int, ...]]) -> bool:
  return any(len(g) > 1 for g in groups)
