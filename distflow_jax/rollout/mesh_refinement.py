"""The common refinement of device meshes, on which the weight sync writes its reshards.

The weight sync (rollout/weight_sync.py, step 2) reshards each parameter from the
training mesh into a global mesh over the same devices, in the same flat order.  Each
axis of a mesh spans a range of strides of that order (its bounds: suffix products of
the mesh's shape); when all the meshes' bounds, sorted, each divide the next, every mesh
is a coarsening of one ``Refinement``, with a fine axis between each two consecutive
bounds.  On it a layout is the fine axes splitting each dimension, and ``via`` gives the
intermediate layout that moves each axis changing dimension first (an all-to-all, at the
shard's size) and gathers the rest after.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

FINE = "_sync"  # prefix of the refinement mesh's axis names


def _suffix_products(shape: Sequence[int]) -> list[int]:
  return [math.prod(shape[i:]) for i in range(len(shape) + 1)]


@dataclasses.dataclass(frozen=True)
class Refinement:
  """The coarsest mesh (same devices, same flat order) whose axes refine every given
  mesh's axes; ``axes[(mesh index, axis name)]`` is the tuple of fine axes an axis spans
  (major to minor).  None from ``of`` when the meshes' axis boundaries do not nest."""
  mesh: Mesh
  axes: dict[tuple[int, str], tuple[str, ...]]

  @classmethod
  def of(cls, devices: np.ndarray, meshes: Sequence[tuple[Sequence[str], Sequence[int]]]
         ) -> "Refinement | None":
    bounds = sorted({b for _, shape in meshes for b in _suffix_products(shape)})
    if any(b2 % b1 for b1, b2 in zip(bounds, bounds[1:])):
      return None
    strides = bounds[:-1]  # fine axis k has stride strides[k] and size bounds[k+1] // it
    sizes = [b2 // b1 for b1, b2 in zip(bounds, bounds[1:])]
    keep = [k for k, s in enumerate(sizes) if s > 1]
    names = {k: f"{FINE}{k}" for k in keep}
    mesh = Mesh(np.asarray(devices).reshape([sizes[k] for k in reversed(keep)] or [1]),
                tuple(names[k] for k in reversed(keep)) or (f"{FINE}0",),
                axis_types=(jax.sharding.AxisType.Auto,) * max(len(keep), 1))
    axes = {}
    for m, (axis_names, shape) in enumerate(meshes):
      for i, (name, size) in enumerate(zip(axis_names, shape)):
        lo = math.prod(shape[i + 1:])
        axes[(m, name)] = tuple(names[k] for k in reversed(keep)
                                if lo <= strides[k] < lo * size)
    return cls(mesh, axes)

  def spec(self, m: int, spec: P, ndim: int) -> tuple[tuple[str, ...], ...]:
    """Mesh ``m``'s ``spec`` as one tuple of fine axes per dimension."""
    out = []
    for d in range(ndim):
      entry = spec[d] if d < len(spec) else None
      names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
      out.append(tuple(a for n in names for a in self.axes[(m, n)]))
    return tuple(out)

  def sharding(self, dims: tuple[tuple[str, ...], ...]) -> NamedSharding:
    return NamedSharding(self.mesh, P(*[d if d else None for d in dims]))

  def size(self, axes: Sequence[str]) -> int:
    return math.prod(self.mesh.shape[a] for a in axes)


def via(ref: Refinement, shape: Sequence[int], src: tuple[tuple[str, ...], ...],
        dst: tuple[tuple[str, ...], ...]) -> NamedSharding | None:
  """The intermediate layout from ``src`` to ``dst`` (fine axes per dimension): each axis
  that changes dimension moved first (an all-to-all at the shard's size), the axes the
  destination drops still in place (gathered after).  None when no step is needed or
  the dimensions do not divide."""
  dst_all = {a for d in dst for a in d}
  mid = tuple(tuple(a for a in s if a not in dst_all) + d for s, d in zip(src, dst))
  if mid in (src, dst) or any(n % ref.size(m) for n, m in zip(shape, mid)):
    return None
  return ref.sharding(mid)
