"""Process groups: the processes a piece of work runs on, when not every process does.

An asynchronous run on disjoint processes (run/disjoint.py) gives the rollout stage to
some processes and the training to the others.  Host-side gathers (a metric's sums, the
longest prompt, ...) must then run among the group alone: a gather over every process
would wait forever for a process that never calls it.  ``within(processes)`` names the
group for the calling thread (a context variable: the rollout thread and the trainer's
thread each see their own); ``allgather`` gathers over it.  Outside ``within`` the group
is every process, as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator, Sequence

import numpy as np

_GROUP: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar(
    "distflow_process_group", default=None)


@contextlib.contextmanager
def within(processes: Sequence[int] | None) -> Iterator[None]:
  """Host-side gathers in this block (this thread) run among ``processes`` (None: all)."""
  token = _GROUP.set(None if processes is None else tuple(sorted(processes)))
  try:
    yield
  finally:
    _GROUP.reset(token)


def current() -> tuple[int, ...] | None:
  """The calling thread's group (None: every process)."""
  return _GROUP.get()


def allgather(local: np.ndarray) -> np.ndarray:
  """``[group size, ...]``: every group member's copy of a small host array, in process
  order (one all-gather among the group; every member must call it, in the same order)."""
  import jax
  from jax.experimental import multihost_utils
  group = current()
  if group is None or len(group) == jax.process_count():
    return np.asarray(multihost_utils.process_allgather(local))
  if jax.process_index() not in group:
    raise RuntimeError(f"process {jax.process_index()} gathers in group {list(group)}, "
                       f"which it is not part of")
  if len(group) == 1:
    return local[None]
  mesh, gather = _gatherer(group)
  from jax.sharding import NamedSharding, PartitionSpec as P
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("p")), local[None])
  return np.asarray(gather(x).addressable_data(0))


@functools.lru_cache(maxsize=None)
def _gatherer(group: tuple[int, ...]):
  """The group's mesh (one device per member: the first of its own) and its compiled
  all-gather (built once per group: no compile per call)."""
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  firsts = {}
  for d in jax.devices():
    if d.process_index in group and d.process_index not in firsts:
      firsts[d.process_index] = d
  mesh = Mesh(np.array([firsts[p] for p in group]), ("p",))
  return mesh, jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, P()))


def leader() -> int:
  """The calling thread's group's first process (0 outside ``within``): the one that
  writes a group's shared files (a checkpoint's record, its tokenizer, metrics)."""
  group = current()
  return 0 if group is None else group[0]


def is_leader() -> bool:
  import jax
  return jax.process_index() == leader()


def orbax_options():
  """Orbax's multiprocessing options for the calling thread's group: its saves and
  restores synchronise among the group alone (outside ``within``: every process)."""
  import orbax.checkpoint as ocp
  group = current()
  if group is None:
    return ocp.options.MultiprocessingOptions()
  return ocp.options.MultiprocessingOptions(
      primary_host=group[0], active_processes=set(group),
      barrier_sync_key_prefix="group-" + "-".join(map(str, group)))
