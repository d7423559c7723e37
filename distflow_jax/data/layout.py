"""Data layouts: which devices hold which samples.

A layout is a mesh plus the mesh axes that shard the sample (leading) axis;
the other mesh axes replicate it.  Two layouts are *equivalent* for a batch of
``B`` samples when every device holds the same rows under both, whatever the
mesh shapes or axis names; then a node-to-node hand-over moves nothing.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Layout:
  """``mesh`` with the sample axis sharded over ``axes`` (``()`` replicates)."""
  mesh: Mesh
  axes: tuple[str, ...] = ()

  def __post_init__(self):
    axes = (self.axes,) if isinstance(self.axes, str) else tuple(self.axes)
    object.__setattr__(self, "axes", axes)
    for a in axes:
      if a not in self.mesh.axis_names:
        raise ValueError(f"layout axis {a!r} is not a mesh axis; mesh axes are "
                         f"{list(self.mesh.axis_names)}")
    if len(set(axes)) != len(axes):
      raise ValueError(f"layout axes {axes} name an axis twice")

  @property
  def sharding(self) -> NamedSharding:
    """Sharding of a sample-leading array (trailing dims are replicated)."""
    return NamedSharding(self.mesh, P(self.axes if self.axes else None))

  @property
  def num_shards(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.axes)

  @property
  def devices(self) -> frozenset:
    return frozenset(self.mesh.devices.flat)

  def check_rows(self, num_rows: int) -> int:
    """Returns rows per shard; raises if ``num_rows`` does not split evenly."""
    if num_rows % self.num_shards:
      raise ValueError(
          f"{num_rows} samples do not split evenly over the {self.num_shards} "
          f"shards of layout axes {self.axes} (mesh {dict(self.mesh.shape)}); "
          f"use a multiple of {self.num_shards}")
    return num_rows // self.num_shards

  def device_rows(self, num_rows: int) -> dict[jax.Device, tuple[int, int]]:
    """``device -> (start, stop)`` of the sample rows it holds."""
    self.check_rows(num_rows)
    out = {}
    for dev, idx in self.sharding.devices_indices_map((num_rows,)).items():
      sl = idx[0]
      start = 0 if sl.start is None else sl.start
      stop = num_rows if sl.stop is None else sl.stop
      out[dev] = (start, stop)
    return out

  def shard_of(self, num_rows: int) -> dict[jax.Device, int]:
    """``device -> shard index``; shard ``k`` holds rows ``[k*M, (k+1)*M)``."""
    per = self.check_rows(num_rows)
    return {d: start // per for d, (start, _) in self.device_rows(num_rows).items()}

  def __repr__(self) -> str:
    return f"Layout(mesh={dict(self.mesh.shape)}, axes={self.axes})"


def equivalent(a: Layout, b: Layout, num_rows: int) -> bool:
  """True when every device holds the same sample rows under both layouts."""
  if a is b or (a.mesh == b.mesh and a.axes == b.axes):
    return True
  if a.devices != b.devices:
    return False
  if num_rows % a.num_shards or num_rows % b.num_shards:
    return False
  return a.device_rows(num_rows) == b.device_rows(num_rows)


def placed_as(x: jax.Array, layout: Layout) -> bool:
  """Whether every device holds the rows of ``x`` that ``layout`` gives it."""
  num_rows = x.shape[0]
  if num_rows % layout.num_shards:
    return False
  got = {}
  for dev, idx in x.sharding.devices_indices_map(x.shape).items():
    sl = idx[0]
    got[dev] = (0 if sl.start is None else sl.start,
                num_rows if sl.stop is None else sl.stop)
  return got == layout.device_rows(num_rows)


def host_major_mesh(axis_names: tuple[str, str] = ("host", "local")) -> Mesh:
  """``[process_count, local_device_count]`` mesh of all devices, hosts first.

  With ``Layout(mesh, ("host",))`` each host holds its own samples, replicated
  over its local devices (a rollout replica per host); with
  ``Layout(mesh, ("host", "local"))`` every device holds its own slice.
  """
  devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  n_proc = jax.process_count()
  grid = np.array(devs, dtype=object).reshape(n_proc, len(devs) // n_proc)
  return Mesh(grid, axis_names,
              axis_types=(jax.sharding.AxisType.Auto,) * 2)


def flat_mesh(axis_name: str = "fsdp") -> Mesh:
  """1-D mesh of all devices in process-major order."""
  devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  return Mesh(np.array(devs, dtype=object), (axis_name,),
              axis_types=(jax.sharding.AxisType.Auto,))
