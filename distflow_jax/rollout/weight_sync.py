"""Weight sync: the actor's parameters, in their training layout, into a rollout layout.

The training layout spans every device of every host (FSDP, say); a rollout
replica lives on one host's devices.  The move is:

1. one jitted all-gather that replicates each parameter over the training
   mesh (a collective: every process of that mesh runs it, in the same order);
2. each host picks its own full copies (`addressable_shards`), wraps them as
   an array replicated on the replica's mesh, no copy;
3. one jitted reshard on the replica's mesh into its layout (tensor-parallel
   slices; local, no cross-host traffic).

Both jitted functions are built once per (training layout, rollout layout)
and reused, so from the second sync on nothing compiles (`compile_count`).
When the replica's devices do not hold a training copy (disaggregated
placement), step 2 falls back to a device-to-device transfer.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P


def _replicated(sh: jax.sharding.Sharding) -> jax.sharding.Sharding:
  if isinstance(sh, NamedSharding):
    return NamedSharding(sh.mesh, P())
  if sh.is_fully_replicated:
    return sh
  raise ValueError(f"weight sync: cannot replicate a parameter with sharding {sh}; "
                   "use NamedSharding (mesh + PartitionSpec) for the training layout")


def _identity(xs):
  return xs


class WeightSync:
  """Reusable resharder into fixed destination shardings (a pytree matching the params)."""

  def __init__(self, dst_shardings: Any):
    self.dst_shardings = dst_shardings
    self._gathers: dict[Any, Any] = {}
    self._dst_leaves = jax.tree.leaves(dst_shardings)
    self._local = [NamedSharding(s.mesh, P()) for s in self._dst_leaves]
    self._to_dst = jax.jit(_identity, out_shardings=self._dst_leaves)

  def _gather_fn(self, leaves: list[jax.Array]):
    key = tuple(x.sharding for x in leaves)
    if key not in self._gathers:
      self._gathers[key] = jax.jit(_identity, out_shardings=[_replicated(s) for s in key])
    return self._gathers[key]

  def __call__(self, train_params: Any) -> Any:
    leaves, treedef = jax.tree.flatten(train_params)
    if len(leaves) != len(self._dst_leaves):
      raise ValueError(f"weight sync: the actor has {len(leaves)} parameter arrays, the rollout "
                       f"layout {len(self._dst_leaves)}; are they the same model?")
    full = self._gather_fn(leaves)(leaves)
    local = []
    for x, dst, rep in zip(full, self._dst_leaves, self._local):
      copies = {s.device: s.data for s in x.addressable_shards}
      devices = list(rep.mesh.devices.flat)
      if all(d in copies for d in devices):
        local.append(jax.make_array_from_single_device_arrays(
            x.shape, rep, [copies[d] for d in devices]))
      elif copies:
        local.append(jax.device_put(next(iter(copies.values())), rep))
      else:
        raise ValueError("weight sync: this process holds no copy of the actor's parameters; "
                         "the training mesh must include a device of every rollout host")
    return jax.tree.unflatten(treedef, self._to_dst(local))

  def compile_count(self) -> int:
    """Executables built so far (stays put after the first sync of a given layout)."""
    return self._to_dst._cache_size() + sum(f._cache_size() for f in self._gathers.values())


def reshard(train_params: Any, dst_shardings: Any) -> Any:
  """One-off sync (builds a fresh `WeightSync`; keep one around to reuse compiles)."""
  return WeightSync(dst_shardings)(train_params)
