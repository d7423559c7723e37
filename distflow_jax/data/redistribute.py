"""Moving a batch between data layouts: fast path, all_to_all, or via process 0.

* Fast path: when the destination layout puts the same rows on the same
  devices as the source, the very same arrays come back (nothing is copied,
  nothing compiles, no collective runs).
* Distributed re-partition: every leaf of the batch is packed into one byte
  matrix per device, a local gather orders it into per-destination blocks,
  and a single ``all_to_all`` inside ``jax.shard_map`` delivers it; a local
  gather on the receiver puts the rows in destination order.
* Centralized baseline: what a single-controller framework does.  Every
  device's rows go to device 0 (on process 0), are re-ordered there and sent
  back out, all through point-to-point ``ppermute``s.  Same results; all
  traffic and the whole batch go through one process.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distflow_jax.data import layout as layout_lib
from distflow_jax.data.layout import Layout
from distflow_jax.data.plan import RepartitionPlan, make_repartition_plan

_AXIS = "redistribute"


class Mode(enum.Enum):
  DISTRIBUTED = "distributed"
  CENTRALIZED = "centralized"


def parse_mode(mode: "Mode | str") -> Mode:
  if isinstance(mode, Mode):
    return mode
  try:
    return Mode(mode)
  except ValueError:
    raise ValueError(f"unknown re-partition mode {mode!r}; valid modes: "
                     f"{[m.value for m in Mode]}") from None


def row_bytes(tree: Any) -> int:
  """Bytes of one sample across all leaves."""
  return sum(math.prod(x.shape[1:]) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


# --- packing every leaf into one uint8 matrix, so one collective moves all ---

def _pack(leaves: list[jax.Array]) -> jax.Array:
  cols = []
  for x in leaves:
    if x.dtype == jnp.bool_:
      x = x.astype(jnp.uint8)
    if x.dtype != jnp.uint8:  # wider types gain a trailing byte axis
      x = jax.lax.bitcast_convert_type(x, jnp.uint8)
    cols.append(x.reshape(x.shape[0], -1))
  return jnp.concatenate(cols, axis=1)


def _unpack(buf: jax.Array, like: list[jax.ShapeDtypeStruct]) -> list[jax.Array]:
  out, col = [], 0
  rows = buf.shape[0]
  for spec in like:
    dtype = jnp.dtype(spec.dtype)
    store = jnp.uint8 if dtype == jnp.bool_ else dtype
    width = math.prod(spec.shape[1:]) * jnp.dtype(store).itemsize
    x = buf[:, col:col + width]
    col += width
    if jnp.dtype(store).itemsize > 1:
      x = x.reshape(rows, *spec.shape[1:], jnp.dtype(store).itemsize)
    else:
      x = x.reshape(rows, *spec.shape[1:])
    if store != jnp.uint8:
      x = jax.lax.bitcast_convert_type(x, store)
    out.append(x != 0 if dtype == jnp.bool_ else x)
  return out


@functools.lru_cache(maxsize=64)
def _program(mesh: Mesh, mode: Mode, like: tuple[jax.ShapeDtypeStruct, ...]):
  """The jitted re-partition for one flat mesh, mode and leaf signature."""
  like = list(like)
  num_dev = mesh.devices.size

  def distributed(send_idx, recv_idx, *leaves):
    buf = _pack(list(leaves))[send_idx[0]]           # [N*C, F] blocks by destination
    got = jax.lax.all_to_all(buf, _AXIS, 0, 0, tiled=True)  # [N*C, F] by sender
    return tuple(_unpack(got[recv_idx[0]], like))

  def centralized(gather_idx, *leaves):
    mine = _pack(list(leaves))                        # [R, F]
    me = jax.lax.axis_index(_AXIS)
    parts = [mine] + [jax.lax.ppermute(mine, _AXIS, [(k, 0)])
                      for k in range(1, num_dev)]
    whole = jnp.concatenate(parts)                    # the batch, on device 0
    out = whole[gather_idx]                           # [N, M, F] processed there
    res = out[0]
    for k in range(1, num_dev):
      res = jnp.where(me == k, jax.lax.ppermute(out[k], _AXIS, [(0, k)]), res)
    return tuple(_unpack(res, like))

  if mode is Mode.DISTRIBUTED:
    body, idx_specs = distributed, (P(_AXIS), P(_AXIS))
  else:
    body, idx_specs = centralized, (P(),)
  n_leaves = len(like)
  return jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=idx_specs + (P(_AXIS),) * n_leaves,
      out_specs=(P(_AXIS),) * n_leaves, check_vma=False))


def _flat_mesh(plan: RepartitionPlan) -> Mesh:
  return Mesh(np.array(plan.senders, dtype=object), (_AXIS,),
              axis_types=(jax.sharding.AxisType.Auto,))


def _to_senders(x: jax.Array, plan: RepartitionPlan, mesh: Mesh) -> jax.Array:
  """Re-labels ``x`` as sender blocks on the flat mesh; local slices only."""
  r = plan.rows_per_sender
  pos = {d: i for i, d in enumerate(plan.senders)}
  blocks = []
  for s in x.addressable_shards:
    start = s.index[0].start or 0
    off = pos[s.device] * r - start
    data = s.data
    blocks.append(data if (off == 0 and data.shape[0] == r) else data[off:off + r])
  return jax.make_array_from_single_device_arrays(
      (plan.num_devices * r,) + x.shape[1:], NamedSharding(mesh, P(_AXIS)), blocks)


def _from_receivers(y: jax.Array, plan: RepartitionPlan, dst: Layout) -> jax.Array:
  """Re-labels per-position output blocks as the destination layout; no copy."""
  shape = (plan.num_rows,) + y.shape[1:]
  return jax.make_array_from_single_device_arrays(
      shape, dst.sharding, [s.data for s in y.addressable_shards])


def _index_array(idx: np.ndarray, mesh: Mesh, spec: P) -> jax.Array:
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(idx.shape, sharding, lambda i: idx[i])


def _check_tree(tree: Any, src: Layout) -> tuple[list, Any, int]:
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    raise ValueError("the batch has no arrays to move")
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(tree)[0]]
  num_rows = leaves[0].shape[0]
  for path, x in zip(paths, leaves):
    if not isinstance(x, jax.Array) or x.ndim == 0 or x.shape[0] != num_rows:
      raise ValueError(f"batch leaf {path} must be a jax.Array with leading "
                       f"sample axis {num_rows}, got "
                       f"{getattr(x, 'shape', type(x))}")
    if not layout_lib.placed_as(x, src):
      raise ValueError(f"batch leaf {path} is not placed as the source layout "
                       f"{src}: its sharding is {x.sharding}")
  return leaves, treedef, num_rows


def redistribute(tree: Any, lengths_B: np.ndarray, src: Layout, dst: Layout,
                 *, mode: Mode | str = Mode.DISTRIBUTED,
                 group_size: int = 1,
                 on_plan: Callable[[Any, RepartitionPlan], None] | None = None
                 ) -> tuple[Any, np.ndarray]:
  """Moves a sample-leading pytree from ``src`` to ``dst``.

  Args:
    tree: pytree of global ``jax.Array``s, each ``[B, ...]`` placed as ``src``.
    lengths_B: token count per sample, identical on every process (see
      :func:`replicate_lengths`); only used when samples move.
    src, dst: layouts on the same devices.
    mode: ``"distributed"`` (one all_to_all) or ``"centralized"`` (through
      process 0; it always moves, as a single-controller framework would).
    group_size: keep runs of this many consecutive samples together.
    on_plan: called with ``(tree, plan)`` before a plan runs (not on the fast path):
      the run records the move's shapes (``state/warm_shapes.py``).

  Returns:
    ``(tree placed as dst, perm_B)`` where output row ``j`` is input row
    ``perm_B[j]``.  On the fast path ``tree`` is returned itself.
  """
  mode = parse_mode(mode)
  leaves, treedef, num_rows = _check_tree(tree, src)
  if mode is Mode.DISTRIBUTED and layout_lib.equivalent(src, dst, num_rows):
    identity = np.arange(num_rows)
    if src.mesh == dst.mesh and src.axes == dst.axes:
      return tree, identity
    return jax.tree.unflatten(treedef, [
        jax.make_array_from_single_device_arrays(
            x.shape, dst.sharding, [s.data for s in x.addressable_shards])
        for x in leaves]), identity
  plan = make_repartition_plan(np.asarray(lengths_B), src, dst, group_size=group_size)
  if on_plan is not None:
    on_plan(tree, plan)
  return execute(tree, plan, dst, mode), plan.perm_B


def _prepare(tree: Any, plan: RepartitionPlan, mode: Mode):
  """The jitted program and its arguments for ``tree`` under ``plan``."""
  leaves, treedef = jax.tree.flatten(tree)
  mesh = _flat_mesh(plan)
  flat = [_to_senders(x, plan, mesh) for x in leaves]
  like = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves)
  if mode is Mode.DISTRIBUTED:
    idx = (_index_array(plan.send_idx_NxNC, mesh, P(_AXIS)),
           _index_array(plan.recv_idx_NxM, mesh, P(_AXIS)))
  else:
    idx = (_index_array(plan.gather_idx_NxM, mesh, P()),)
  return _program(mesh, mode, like), (*idx, *flat), treedef


def abstract_call(tree: Any, plan: RepartitionPlan, mode: Mode | str = Mode.DISTRIBUTED
                  ) -> tuple[Any, tuple]:
  """The jitted re-partition ``execute`` runs for a tree shaped as ``tree`` (arrays or
  ``ShapeDtypeStruct``s) under ``plan``, and its arguments as ``ShapeDtypeStruct``s with
  their shardings: ``plan --lower`` lowers it for a target device (nothing is allocated)."""
  mode = parse_mode(mode)
  leaves = jax.tree.leaves(tree)
  mesh = _flat_mesh(plan)
  rows = plan.num_devices * plan.rows_per_sender
  on = NamedSharding(mesh, P(_AXIS))
  flat = tuple(jax.ShapeDtypeStruct((rows,) + tuple(x.shape[1:]), x.dtype, sharding=on)
               for x in leaves)
  like = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves)

  def idx(a: np.ndarray, spec: P) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
  if mode is Mode.DISTRIBUTED:
    ids = (idx(plan.send_idx_NxNC, P(_AXIS)), idx(plan.recv_idx_NxM, P(_AXIS)))
  else:
    ids = (idx(plan.gather_idx_NxM, P()),)
  return _program(mesh, mode, like), (*ids, *flat)


def rehearse(tree: Any, plan: RepartitionPlan, dst: Layout,
             mode: Mode | str = Mode.DISTRIBUTED) -> None:
  """Runs ``plan`` on zeros shaped and placed as ``tree``'s ``ShapeDtypeStruct`` leaves
  (with shardings): compiles every program a real move of those shapes runs, the
  jitted exchange and the per-device slices around it (state/warm_shapes.py).  A
  collective: every process rehearses the same moves in the same order."""
  def zeros(s: jax.ShapeDtypeStruct) -> jax.Array:
    whole = np.broadcast_to(np.zeros((), s.dtype), s.shape)  # a view: no memory
    return jax.make_array_from_callback(s.shape, s.sharding, lambda idx: whole[idx])
  jax.block_until_ready(execute(jax.tree.map(zeros, tree), plan, dst, mode))


def execute(tree: Any, plan: RepartitionPlan, dst: Layout,
            mode: Mode | str = Mode.DISTRIBUTED) -> Any:
  """Runs a precomputed plan (no fast-path check)."""
  fn, args, treedef = _prepare(tree, plan, parse_mode(mode))
  out = fn(*args)
  return jax.tree.unflatten(treedef, [_from_receivers(y, plan, dst) for y in out])


def compiled_text(tree: Any, plan: RepartitionPlan, mode: Mode | str = Mode.DISTRIBUTED) -> str:
  """HLO of the compiled re-partition program (to count its collectives)."""
  fn, args, _ = _prepare(tree, plan, parse_mode(mode))
  return fn.lower(*args).compile().as_text()


def replicate_lengths(lengths: jax.Array) -> np.ndarray:
  """The full ``[B]`` lengths on every process (one small all-gather)."""
  if not isinstance(lengths, jax.Array) or lengths.is_fully_addressable:
    return np.asarray(lengths)
  return np.asarray(multihost_utils.process_allgather(lengths, tiled=True))
