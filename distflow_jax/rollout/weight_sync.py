"""Weight sync: the actor's parameters, in their training layout, into a rollout layout.

The training layout spans every device of every host (FSDP, say); a rollout replica
lives on one host's devices, tensor-parallel over them.  The sync goes straight into the
rollout layout, with no whole-model gather on any device:

1. The training mesh's devices, in its own order, are cut into blocks of one replica's
   size, each block inside one process (a host holds one block per replica it could
   run), or, for replicas spanning processes, blocks that share no process (each
   process then wraps its own part of its block).  A *global* sharding over the training
   devices places, on each block, exactly the shards of the rollout layout (the
   rollout's PartitionSpec on a mesh ``(blocks, *replica axes)``: split over ``tensor``
   inside a block, replicated across blocks).
2. One jitted identity (a collective: every process of the training mesh runs it, in
   the same order) reshards each parameter into that global sharding.  It is written on
   the common refinement of both meshes (rollout/mesh_refinement.py), moving each axis
   that changes dimension first (an all-to-all, at the shard's size) and gathering the
   rest after, so no device holds more of a parameter than its rollout shard plus one
   step's buffers: XLA left alone replicates the whole parameter and slices it
   ("Involuntary full rematerialization": 3x the whole parameter per device on XLA:CPU).
3. Each host wraps its own block's shards as arrays on the replica's mesh
   (``jax.make_array_from_single_device_arrays``): no copy where the replica's devices
   are the block's in the same arrangement (the run's case: the replica is built from
   the host's actor devices in order), one local reshard otherwise.

Each device then receives only its rollout shard (``params / tensor_parallel``).  The
previous sync's result is released (deleted) before the new one is made, so old and new
rollout weights never coexist; a caller must not use a rollout's weights after the next
sync of the same ``WeightSync``.

Fallback, when the training devices do not cut into per-process blocks of the replica's
size, or a parameter is not on the training mesh (disaggregated or odd placements,
unsharded inputs): the old route, one all-gather replicating that parameter over its
own devices, each host picking its copy, then a local reshard; that costs the whole
parameter on every training device while it runs.

``bytes_moved`` is the size of the arrays the last call resharded (whole arrays, not per
device): what a sync of this tree costs in traffic, before any device already held its
shard.

The jitted functions are built once per (training layout, rollout layout) and reused,
so from the second sync on nothing compiles (``compile_count``).  ``lower`` compiles the
same program on abstract shapes for ``plan --memory``, with the processes of a simulated
topology (``process_of``).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distflow_jax.rollout.mesh_refinement import FINE, Refinement, via


def _replicated(sh: jax.sharding.Sharding) -> jax.sharding.Sharding:
  if isinstance(sh, NamedSharding):
    return NamedSharding(sh.mesh, P())
  if sh.is_fully_replicated:
    return sh
  raise ValueError(f"weight sync: cannot replicate a parameter with sharding {sh}; "
                   "use NamedSharding (mesh + PartitionSpec) for the training layout")


def _own_devices(sh: NamedSharding) -> list[jax.Device]:
  """The devices of ``sh``'s mesh that this process holds, in the mesh's order."""
  me = jax.process_index()
  return [d for d in sh.mesh.devices.flat if d.process_index == me]


def _identity(xs):
  return xs


def _index_key(idx: tuple[slice, ...], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
  return tuple(s.indices(n)[:2] for s, n in zip(idx, shape))


def _chunk_key(path: tuple) -> tuple:
  """Consecutive parameters with the same key sync in one step: a layer's (the path up to
  its index), else each parameter alone (embedding, head, a stacked weight)."""
  names = tuple(next((str(getattr(k, a)) for a in ("key", "name", "idx") if hasattr(k, a)),
                     str(k)) for k in path)
  cut = next((i for i, n in enumerate(names) if n.isdigit()), None)
  return names[:cut + 1] if cut is not None else names


def _joins(path: tuple, shape: tuple[int, ...], chunk_head: tuple) -> bool:
  """Whether a parameter syncs in the step of the chunk that ``chunk_head`` opened: the same
  layer, or a vector outside the layers (the final norm's scale) after another parameter
  outside them: it adds a vector to that step's buffers and saves a program."""
  key, head = _chunk_key(path), _chunk_key(chunk_head)
  if key == head:
    return True
  outside = not any(n.isdigit() for n in key + head)
  return outside and len(shape) <= 1


@dataclasses.dataclass(frozen=True)
class SyncMemory:
  """Bytes per training device of one sync, from the compiled steps: ``output`` the
  synced arrays (the rollout shard of each direct parameter, the whole of each fallback
  one), ``temp`` the largest step's buffers, ``steps`` the collective calls, ``direct``
  whether every parameter goes straight into the rollout layout."""
  output: int
  temp: int
  steps: int
  direct: bool


@dataclasses.dataclass
class _Route:
  """How one training layout syncs: the collective steps (``chunks``: leaf indices and
  the jitted reshard of those leaves), which leaves go straight into the rollout layout
  (``direct``; the others take the fallback's replicated gather, then ``to_dst``, a
  local reshard of those leaves) and the blocks."""
  chunks: list[tuple[list[int], Any]]
  direct: list[bool]
  to_dst: Any
  blocks: list[list[Any]]       # devices of each block, in the training mesh's order


class WeightSync:
  """Reusable resharder into fixed destination shardings (a pytree matching the params).

  ``process_of(device) -> process``: which process holds a device (default the device's
  own ``process_index``; ``plan --memory`` passes its simulated topology's)."""

  def __init__(self, dst_shardings: Any,
               process_of: Callable[[jax.Device], int] | None = None):
    self.dst_shardings = dst_shardings
    self._dst_leaves = jax.tree.leaves(dst_shardings)
    self._local = [NamedSharding(s.mesh, P()) for s in self._dst_leaves]
    self._process_of = process_of or (lambda d: d.process_index)
    self._routes: dict[Any, _Route] = {}
    self._fns: dict[Any, Any] = {}   # one jitted step per distinct chunk signature
    self._previous: list[weakref.ref] = []
    self.bytes_moved = 0
    meshes = {s.mesh for s in self._dst_leaves if isinstance(s, NamedSharding)}
    one = len(meshes) == 1 and all(isinstance(s, NamedSharding) for s in self._dst_leaves)
    self._replica: Mesh | None = next(iter(meshes)) if one else None

  # ---- routing -------------------------------------------------------------------------

  def _blocks(self, train_mesh: Mesh) -> list[list[jax.Device]] | None:
    """The training mesh's devices, in its order, cut into replica-sized blocks that each
    stay in one process, or (a replica spanning processes) that share no process with
    another block; None when they do not cut so."""
    devices = list(train_mesh.devices.flat)
    size = self._replica.size
    if len(devices) % size:
      return None
    blocks = [devices[i:i + size] for i in range(0, len(devices), size)]
    owners = [{self._process_of(d) for d in b} for b in blocks]
    if all(len(o) == 1 for o in owners):
      return blocks
    if sum(map(len, owners)) == len(set().union(*owners)):  # no process in two blocks
      return blocks
    return None

  def _step(self, leaves: list[Any], mids: list[Any], outs: list[Any]) -> Any:
    sig = tuple((tuple(x.shape), str(x.dtype), x.sharding, m, o)
                for x, m, o in zip(leaves, mids, outs))
    if sig not in self._fns:
      def reshard(xs, mids=tuple(mids)):
        return [x if m is None else jax.lax.with_sharding_constraint(x, m)
                for x, m in zip(xs, mids)]
      self._fns[sig] = jax.jit(reshard, out_shardings=list(outs))
    return self._fns[sig]

  def _route(self, leaves: Sequence[Any], paths: Sequence[tuple]) -> _Route:
    shapes = [tuple(x.shape) for x in leaves]
    shardings = [x.sharding for x in leaves]
    key = (tuple(shapes), tuple(shardings))
    if key in self._routes:
      return self._routes[key]
    meshes = {s.mesh for s in shardings if isinstance(s, NamedSharding)}
    train_mesh = max(meshes, key=lambda m: m.size) if meshes and self._replica else None
    blocks = self._blocks(train_mesh) if train_mesh is not None else None
    ref = None
    if blocks is not None:  # the global mesh: (blocks, *replica axes), the training order
      rep = self._replica
      glob = ((f"{FINE}_blocks",) + tuple(rep.axis_names),
              (len(blocks),) + tuple(rep.devices.shape))
      ref = Refinement.of(train_mesh.devices, [
          (train_mesh.axis_names, tuple(train_mesh.devices.shape)), glob])
    direct, out, mids = [], [], []
    for shape, sh, dst in zip(shapes, shardings, self._dst_leaves):
      ok = ref is not None and isinstance(sh, NamedSharding) and sh.mesh == train_mesh
      if ok:  # the rollout spec on the global mesh: replicated across blocks
        src, want = ref.spec(0, sh.spec, len(shape)), ref.spec(1, dst.spec, len(shape))
        ok = all(n % ref.size(d) == 0 for n, d in zip(shape, want))
      direct.append(ok)
      out.append(ref.sharding(want) if ok else _replicated(sh))
      mids.append(via(ref, shape, src, want) if ok else None)
    groups: list[list[int]] = []
    for i, path in enumerate(paths):
      if groups and _joins(path, shapes[i], paths[groups[-1][0]]):
        groups[-1].append(i)
      else:
        groups.append([i])
    chunks = [(g, self._step([leaves[i] for i in g], [mids[i] for i in g],
                             [out[i] for i in g])) for g in groups]
    rest = [d for d, ok in zip(self._dst_leaves, direct) if not ok]
    route = _Route(chunks, direct, jax.jit(_identity, out_shardings=rest), blocks or [])
    self._routes[key] = route
    return route

  # ---- the sync ------------------------------------------------------------------------

  def release_previous(self, keep: Sequence[Any] = ()) -> None:
    """Deletes the previous sync's arrays still alive (except those in ``keep``)."""
    keep_ids = {id(x) for x in keep}
    for ref in self._previous:
      x = ref()
      if x is not None and id(x) not in keep_ids and not x.is_deleted():
        x.delete()
    self._previous = []

  def __call__(self, train_params: Any) -> Any:
    flat, treedef = jax.tree_util.tree_flatten_with_path(train_params)
    paths, leaves = [p for p, _ in flat], [x for _, x in flat]
    if len(leaves) != len(self._dst_leaves):
      raise ValueError(f"weight sync: the actor has {len(leaves)} parameter arrays, the rollout "
                       f"layout {len(self._dst_leaves)}; are they the same model?")
    self.release_previous(keep=leaves)  # old and new rollout weights never coexist
    route = self._route(leaves, paths)
    result: list[Any] = [None] * len(leaves)
    rest: dict[int, jax.Array] = {}
    for idx, fn in route.chunks:
      # One collective step per chunk, waited for: the device holds one step's buffers
      # at a time, and CPU collectives never pile up (see DESIGN.md).
      moved = jax.block_until_ready(fn([leaves[i] for i in idx]))
      for i, x in zip(idx, moved):
        shards = {s.device: s.data for s in x.addressable_shards}
        if route.direct[i]:
          result[i] = self._from_block(x, shards, self._dst_leaves[i], route.blocks)
          continue
        rep = self._local[i]
        mine = _own_devices(rep)  # the replica's devices on this process (all, or its part)
        if shards and mine:
          one = next(iter(shards.values()))
          rest[i] = jax.make_array_from_single_device_arrays(
              x.shape, rep, [shards[d] if d in shards else jax.device_put(one, d)
                             for d in mine])
        else:
          raise ValueError("weight sync: this process holds no copy of the actor's "
                           "parameters; the training mesh must include a device of every "
                           "rollout host")
      del moved
    if rest:  # the fallback's leaves: one local reshard into the rollout layout
      placed = route.to_dst([rest[i] for i in sorted(rest)])
      for i, x in zip(sorted(rest), placed):
        result[i] = x
    self._previous = [weakref.ref(x) for x in result]
    self.bytes_moved = sum(x.size * x.dtype.itemsize for x in leaves)
    return jax.tree.unflatten(treedef, result)

  def _from_block(self, x: jax.Array, shards: dict, dst: NamedSharding,
                  blocks: list[list[jax.Device]]) -> jax.Array:
    """This host's rollout-layout array from its block's shards of ``x``: no copy where
    each destination device already holds its own shard, else one local move."""
    want = dst.devices_indices_map(x.shape)
    have = x.sharding.devices_indices_map(x.shape)
    mine = _own_devices(dst)  # a replica spanning processes: this process's part of it
    if all(d in shards and _index_key(have[d], x.shape) == _index_key(want[d], x.shape)
           for d in mine):
      return jax.make_array_from_single_device_arrays(x.shape, dst, [shards[d] for d in mine])
    block = next((b for b in blocks if set(b) == set(want)), None)
    block = block or next((b for b in blocks if all(d in shards for d in b)), None)
    if block is None:
      raise ValueError("weight sync: this process holds no block of the actor's parameters; "
                       "the training mesh must include the devices of every rollout host")
    mesh = Mesh(np.asarray(block, dtype=object).reshape(dst.mesh.devices.shape),
                dst.mesh.axis_names, axis_types=dst.mesh.axis_types)
    arr = jax.make_array_from_single_device_arrays(
        x.shape, NamedSharding(mesh, dst.spec),
        [shards[d] for d in mesh.devices.flat if d.process_index == jax.process_index()])
    return jax.device_put(arr, dst)

  # ---- for plan --memory ---------------------------------------------------------------

  def memory(self, train_params: Any) -> SyncMemory:
    """Each training device's bytes while the sync of (abstract, sharded) ``train_params``
    runs: every step compiled on abstract shapes (each distinct step once),
    ``memory_analysis()`` summed over the steps' outputs, the largest step's temp."""
    flat, _ = jax.tree_util.tree_flatten_with_path(train_params)
    leaves = [x for _, x in flat]
    route = self._route(leaves, [p for p, _ in flat])
    output, temp, seen = 0, 0, {}
    for idx, fn in route.chunks:
      args = [leaves[i] for i in idx]
      key = (id(fn), tuple((x.shape, x.dtype, x.sharding) for x in args))
      if key not in seen:
        m = fn.lower(args).compile().memory_analysis()
        seen[key] = (int(m.output_size_in_bytes), int(m.temp_size_in_bytes))
      output += seen[key][0]
      temp = max(temp, seen[key][1])
    return SyncMemory(output, temp, len(route.chunks), all(route.direct))

  def programs(self, train_params: Any) -> list[tuple[str, Any, tuple]]:
    """The sync's distinct collective steps for (abstract, sharded) ``train_params``, as
    ``(name, jitted, args)``: each step that another only repeats (the layers) once."""
    flat, _ = jax.tree_util.tree_flatten_with_path(train_params)
    leaves = [x for _, x in flat]
    route = self._route(leaves, [p for p, _ in flat])
    out, seen = [], set()
    for idx, fn in route.chunks:
      if id(fn) in seen:
        continue
      seen.add(id(fn))
      name = "/".join(_chunk_key(flat[idx[0]][0]))
      out.append((f"reshard[{name}]", fn, ([leaves[i] for i in idx],)))
    return out

  def compile_count(self) -> int:
    """Executables built so far (stays put after the first sync of a given layout)."""
    return (sum(f._cache_size() for f in self._fns.values())
            + sum(r.to_dst._cache_size() for r in self._routes.values()))


def reshard(train_params: Any, dst_shardings: Any) -> Any:
  """One-off sync (builds a fresh `WeightSync`; keep one around to reuse compiles)."""
  return WeightSync(dst_shardings)(train_params)
