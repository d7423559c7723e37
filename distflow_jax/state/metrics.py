"""Step metrics: local (sum, count) pairs, reduced across hosts by weight.

Each process adds the sums and counts of its own rows; ``reduce`` gathers the
small vectors of every process (one all-gather) and divides once, so a mean
over hosts is exact whatever each host holds.  Timings are summed within
a step on each host, then the maximum over hosts is kept (the slowest host
sets the pace).  Only process 0 writes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from distflow_jax import groups


def gather_processes(local: np.ndarray) -> np.ndarray:
  """``[process_count, ...]``: every process's copy of a small array (one all-gather);
  inside ``groups.within`` the group's processes' alone (``[group size, ...]``).

  Exact for 64-bit values too: JAX without x64 would turn float64 into float32 (so a
  metric's sums would lose bits, and token counts past 2**24 their integer value), so
  8-byte values travel as pairs of uint32 and are viewed back."""
  local = np.ascontiguousarray(local)
  import jax

  if jax.process_count() == 1:
    return local[None]
  if local.dtype.itemsize != 8:
    return groups.allgather(local)
  raw = groups.allgather(local.reshape(-1).view(np.uint32))
  return raw.reshape(raw.shape[0], -1).view(local.dtype).reshape(raw.shape[0], *local.shape)


@dataclasses.dataclass
class Metrics:
  sums: dict[str, float] = dataclasses.field(default_factory=dict)
  counts: dict[str, float] = dataclasses.field(default_factory=dict)
  maxima: dict[str, float] = dataclasses.field(default_factory=dict)

  def add(self, name: str, total: float, count: float = 1.0) -> None:
    self.sums[name] = self.sums.get(name, 0.0) + float(total)
    self.counts[name] = self.counts.get(name, 0.0) + float(count)

  def add_mean(self, name: str, values: np.ndarray) -> None:
    values = np.asarray(values, np.float64).reshape(-1)
    self.add(name, float(values.sum()), float(values.size))

  def add_time(self, name: str, seconds: float) -> None:
    """Accumulates a duration within this step (a node may run several times)."""
    self.maxima[name] = self.maxima.get(name, 0.0) + float(seconds)

  def set_max(self, name: str, value: float) -> None:
    self.maxima[name] = max(self.maxima.get(name, float("-inf")), float(value))

  def merge(self, other: "Metrics") -> None:
    """Adds ``other``'s records to these: sums and counts add, maxima keep the larger (a
    node's metrics into its step's; nodes record no timings, the executor does)."""
    for name, total in other.sums.items():
      self.add(name, total, other.counts[name])
    for name, value in other.maxima.items():
      self.set_max(name, value)

  def reduce(self) -> dict[str, float]:
    """Means over all processes (every process must call it, in the same order)."""
    names = sorted(self.sums)
    maxes = sorted(self.maxima)
    local = np.array([self.sums[n] for n in names] + [self.counts[n] for n in names]
                     + [self.maxima[n] for n in maxes], np.float64)
    gathered = gather_processes(local).astype(np.float64)
    k = len(names)
    sums = gathered[:, :k].sum(0)
    counts = gathered[:, k:2 * k].sum(0)
    mx = gathered[:, 2 * k:].max(0) if maxes else np.zeros(0)
    out = {n: (float(s / c) if c else float("nan")) for n, s, c in zip(names, sums, counts)}
    out.update({n: float(v) for n, v in zip(maxes, mx)})
    return out


class JsonlWriter:
  """Appends one JSON object per line; only process 0 writes."""

  def __init__(self, path: str, enabled: bool):
    self.path = path
    self.enabled = enabled
    if enabled:
      os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

  def write(self, record: dict[str, Any]) -> None:
    if not self.enabled:
      return
    with open(self.path, "a") as f:
      f.write(json.dumps(record, sort_keys=True) + "\n")


class Writers:
  """Sends each row to several writers (metrics.jsonl, TensorBoard events)."""

  def __init__(self, *writers: Any):
    self.writers = writers

  def write(self, record: dict[str, Any]) -> None:
    for w in self.writers:
      w.write(record)


def trim_metrics(path: str, step: int) -> None:
  """Drops records of steps after ``step`` (written before a crash, about to be redone)."""
  if not os.path.isfile(path):
    return
  with open(path) as f:
    lines = f.readlines()
  keep = []
  for line in lines:
    try:
      if json.loads(line).get("step", 0) > step:
        continue
    except json.JSONDecodeError:
      continue  # a line cut short by the crash
    keep.append(line)
  if len(keep) != len(lines):
    with open(path + ".tmp", "w") as f:
      f.writelines(keep)
    os.replace(path + ".tmp", path)
