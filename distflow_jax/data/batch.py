"""A batch: sample-leading arrays plus host-side fields that never move.

``Batch.data`` is the pytree that jitted functions and re-partitions see: a
dict of arrays with the sample on the leading axis, always including
``sample_id`` (global, unique) and ``group_id`` (the prompt a sample came from;
the ``n`` GRPO samples of one prompt share it).  ``Batch.host`` holds Python
values (prompt text, ground truth, data source) for the prompts *this process
loaded*, keyed by group id; those stay here while the arrays travel, and the
sample's ``group_id`` finds them again.

Batch is deliberately not a registered pytree: host fields as pytree metadata
would either be lost by ``tree.map`` or make every jitted call retrace.  Pass
``batch.data`` to jitted functions and rebuild with :meth:`Batch.replace`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import numpy as np

from distflow_jax.data import redistribute as rd
from distflow_jax.data.layout import Layout
from distflow_jax.data.fields import GROUP_ID, SAMPLE_ID



@dataclasses.dataclass(frozen=True)
class Batch:
  data: Mapping[str, Any]
  host: Mapping[int, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    for key in (SAMPLE_ID, GROUP_ID):
      if key not in self.data:
        raise ValueError(f"a Batch needs a {key!r} array; got keys "
                         f"{sorted(self.data)}")
    sizes = {k: np.shape(v)[0] if np.ndim(v) else None for k, v in self.data.items()}
    num = sizes[SAMPLE_ID]
    bad = {k: s for k, s in sizes.items() if s != num}
    if bad:
      raise ValueError(f"every Batch array must have the {num} samples of "
                       f"{SAMPLE_ID!r} on its leading axis; mismatched: {bad}")

  @property
  def num_samples(self) -> int:
    return int(np.shape(self.data[SAMPLE_ID])[0])

  def replace(self, **arrays: Any) -> "Batch":
    """A batch with some arrays added or replaced; host fields kept."""
    return Batch({**self.data, **arrays}, self.host)

  def map(self, fn: Callable[[Any], Any]) -> "Batch":
    return Batch(jax.tree.map(fn, dict(self.data)), self.host)

  def host_fields(self, group_ids: Any) -> list[Mapping[str, Any] | None]:
    """Host fields of each given group id (None where another process has them)."""
    return [self.host.get(int(g)) for g in np.asarray(group_ids).reshape(-1)]


def expand_groups(batch: Batch, n: int) -> Batch:
  """Repeats every prompt ``n`` times in place (host-local arrays).

  Sample ``j`` of prompt ``p`` gets ``sample_id = p * n + j`` and
  ``group_id = p``; a group's samples are adjacent, so any layout that
  shards whole hosts keeps them on the host that loaded the prompt.
  """
  if n < 1:
    raise ValueError(f"group size n must be >= 1, got {n}")
  data = {k: np.repeat(np.asarray(v), n, axis=0) for k, v in batch.data.items()}
  prompt_ids = np.asarray(batch.data[SAMPLE_ID]).astype(np.int64)
  ids = (prompt_ids[:, None] * n + np.arange(n)[None, :]).reshape(-1)
  if ids.size and ids.max() > np.iinfo(np.int32).max:
    raise ValueError(f"sample ids up to {ids.max()} overflow int32; use fewer "
                     f"records per epoch or a smaller group size")
  data[SAMPLE_ID] = ids.astype(np.int32)
  data[GROUP_ID] = np.repeat(prompt_ids, n).astype(np.int32)
  return Batch(data, batch.host)


def to_global(batch: Batch, layout: Layout) -> Batch:
  """Places this process's rows into global arrays laid out as ``layout``.

  Rows of the global batch are the processes' rows in the order of the
  layout's shards; no data moves between hosts (each host's rows must be the
  ones ``layout`` assigns to its devices, e.g. a host-major layout).
  """
  data = {k: jax.make_array_from_process_local_data(layout.sharding, np.asarray(v))
          for k, v in batch.data.items()}
  return Batch(data, batch.host)


def to_local(batch: Batch) -> Batch:
  """This process's rows of every global array, as numpy (in row order)."""
  def local(x):
    if not isinstance(x, jax.Array):
      return np.asarray(x)
    seen, parts = set(), []
    for s in sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0):
      start = s.index[0].start or 0
      if start not in seen:
        seen.add(start)
        parts.append(np.asarray(s.data))
    return np.concatenate(parts)
  return Batch({k: local(v) for k, v in batch.data.items()}, batch.host)


def redistribute_batch(batch: Batch, lengths_B: np.ndarray, src: Layout,
                       dst: Layout, *, mode: rd.Mode | str = rd.Mode.DISTRIBUTED,
                       group_size: int = 1, on_plan=None) -> tuple[Batch, np.ndarray]:
  """Moves the arrays of ``batch`` to ``dst``; host fields stay where they are.

  ``group_size=n`` keeps each GRPO group (``n`` adjacent samples, see
  :func:`expand_groups`) on one destination shard.
  """
  data = dict(batch.data)
  if src.devices != dst.devices:
    # Other devices (a rollout apart from training): each array first moves as it is
    # split, rows in order, onto dst's devices (one transfer), then the re-partition runs
    # among those.
    data = {k: jax.device_put(v, dst.sharding) if isinstance(v, jax.Array) else v
            for k, v in data.items()}
    src = dst
  data, perm = rd.redistribute(data, lengths_B, src, dst, mode=mode,
                               group_size=group_size, on_plan=on_plan)
  return Batch(data, batch.host), perm
