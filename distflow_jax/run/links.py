"""Which shardings each cross-process copy of a run on disjoint processes names (run/disjoint.py),
for any device counts: the rollout's R, the actor's A, the first training node's T, each
pair a multiple one of the other.

A cross-process copy pairs a sharding with its mirror, the same mesh shape and spec over
as many devices of the other group (run/transfer.py).  So each copy moves m = min of the
two counts' worth of shards, and each side first turns its own layout into such m-device
parts, inside its own group (a program on its main thread, or no copy at all):

* weights, R = c·A: the actor's arrays are copied c times, once onto each block of A
  rollout devices.  The rollout side's actor mesh is the actor's with ``data`` c times as
  long (a parameter never shards over ``data``), whose blocks the c copies are.
* weights, A = c·R: the training side reshards the actor onto the actor's mesh with each
  axis cut into blocks × inner (``data``, then ``fsdp``, then ``tensor`` take up c), every
  parameter replicated over the blocks (one program at the step's start, the snapshot's).
  Block 0, R devices shaped as the inner mesh, is copied once: the rollout side's actor
  mesh is that inner mesh.
* batches, R = c·T: the rollout side lays the rows over its devices in order (one
  program) and copies each block of T devices' rows (rows b·n/c to (b+1)·n/c) onto the T
  training devices; the training side concatenates the c parts.
* batches, T = c·R: the rollout side cuts the rows into c parts, each over its R devices
  (one program); part b goes to the b-th block of R training devices, and the training
  side puts the blocks together as one array over its T devices (no copy).

The training side's ``place`` program then moves the rows onto the first training node's
layout, where the chain's usual re-partition takes them on.  With R = A = T this is the
plain mirror copy (c = 1, no extra program).  A copy moves each parameter c times for
R = c·A (once onto each block; each holds a whole model, as a rollout replica needs), once
otherwise (``plan`` prints the bytes).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from distflow_jax.config.async_checks import ratio
from distflow_jax.run import transfer

ROWS = "rows"  # the axis of the one-dimensional meshes a batch's parts travel on


def block_counts(shape: tuple[int, ...], c: int) -> tuple[int, ...] | None:
  """Blocks per mesh axis: ``g[i]`` divides ``shape[i]`` and their product is ``c``, the
  first axes taking what they can first (the actor's mesh cut for a rollout of fewer
  devices); None when ``c`` does not divide the mesh's size (taken
  greedily, each prime factor of ``c`` is absorbed whenever it divides the size)."""
  out = []
  for n in shape:
    g = math.gcd(n, c)
    out.append(g)
    c //= g
  return tuple(out) if c == 1 else None


def _spec_axes(sharding: NamedSharding) -> set[str]:
  names: set[str] = set()
  for entry in sharding.spec:
    if entry is not None:
      names.update(entry if isinstance(entry, tuple) else (entry,))
  return names


def _mesh(devices: list, shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
  return Mesh(np.array(devices, dtype=object).reshape(shape), names,
              axis_types=(AxisType.Auto,) * len(names))


def _rows(devices: list) -> NamedSharding:
  return NamedSharding(_mesh(devices, (len(devices),), (ROWS,)), jax.sharding.PartitionSpec(ROWS))


def sub_array(x: jax.Array, sharding: NamedSharding, shape: tuple[int, ...] | None = None
              ) -> jax.Array:
  """``x``'s shards on ``sharding``'s devices as one array of that sharding (no copy)."""
  devices = sharding.device_set
  shards = [s.data for s in x.addressable_shards if s.device in devices]
  return jax.make_array_from_single_device_arrays(tuple(x.shape if shape is None else shape),
                                                  sharding, shards)


def assembled(parts: list[jax.Array], sharding: NamedSharding, shape: tuple[int, ...]
              ) -> jax.Array:
  """Arrays on disjoint device sets as one array of ``sharding`` over all of them."""
  shards = [s.data for p in parts for s in p.addressable_shards]
  return jax.make_array_from_single_device_arrays(tuple(shape), sharding, shards)


@dataclasses.dataclass
class WeightLinks:
  """How one version of the actor goes from the training devices to the rollout's."""
  grow: bool      # R = c·A: c copies, one onto each rollout block; else one block's copy
  src: Any        # the sharding tree each copy is sent from (the actor's, or block 0's)
  dst: list[Any]  # per copy, the sharding tree it lands on
  snap: Any       # the training side's snapshot shardings (None: the actor's own)
  final: Any      # the rollout side's actor shardings, on ``mesh``
  mesh: Mesh      # the rollout side's actor mesh

  @classmethod
  def of(cls, shardings: Any, mesh: Mesh, rollout: list) -> "WeightLinks":
    """``shardings``: the actor's parameters' tree; ``mesh`` the actor's; ``rollout`` the
    rollout's devices in order."""
    a, r = mesh.devices.size, len(rollout)
    c = ratio(a, r)
    if c is None:
      raise ValueError(f"the rollout's {r} devices and the actor's {a}: one count must be a "
                       f"multiple of the other")
    names, shape = tuple(mesh.axis_names), tuple(mesh.devices.shape)
    if r >= a:
      if c == 1:
        out_shape, out_names = shape, names
      elif names[0] == "data":
        out_shape, out_names = (shape[0] * c, *shape[1:]), names
      elif "data" not in names:
        out_shape, out_names = (c, *shape), ("data", *names)
      else:
        raise ValueError(f"the actor's mesh {dict(zip(names, shape))} has 'data' after other "
                         f"axes: its rollout blocks would not be whole")
      named = sorted({n for s in jax.tree.leaves(shardings) for n in _spec_axes(s)})
      if c > 1 and "data" in named:
        raise ValueError("a parameter of the actor is sharded over the mesh axis 'data', so "
                         f"the rollout's {r} devices cannot hold {c} copies of the actor's "
                         f"{a}-device layout; give the rollout as many devices as the actor")
      out = _mesh(rollout, out_shape, out_names)
      dst = [jax.tree.map(lambda s, b=b: transfer.mirror(s, rollout[b * a:(b + 1) * a]),
                          shardings) for b in range(c)]
      final = jax.tree.map(lambda s: NamedSharding(out, s.spec), shardings)
      return cls(True, shardings, dst, None, final, out)
    g = block_counts(shape, c)
    if g is None:
      raise ValueError(f"the actor's mesh {dict(zip(names, shape))} does not cut into {c} "
                       f"blocks of the rollout's {r} devices")
    inner = tuple(n // k for n, k in zip(shape, g))
    split = _mesh(list(mesh.devices.flat), tuple(x for pair in zip(g, inner) for x in pair),
                  tuple(x for n in names for x in (f"{n}_block", n)))
    block0 = split.devices[tuple(0 if i % 2 == 0 else slice(None) for i in range(2 * len(g)))]
    home = _mesh(list(block0.flat), inner, names)
    out = _mesh(rollout, inner, names)
    src = jax.tree.map(lambda s: NamedSharding(home, s.spec), shardings)
    final = jax.tree.map(lambda s: NamedSharding(out, s.spec), shardings)
    snap = jax.tree.map(lambda s: NamedSharding(split, s.spec), shardings)
    return cls(False, src, [final], snap, final, out)

  def blocks(self, snapshot: Any) -> list[Any]:
    """The trees a training process sends for one version (``snapshot``: the actor's
    arrays, or on ``snap`` when set)."""
    if self.grow:
      return [snapshot] * len(self.dst)
    return [jax.tree.map(sub_array, snapshot, self.src)]

  def receive(self, held: Any) -> Any:
    """A rollout process's side of one version's copies (``held``: placeholders of the
    actor's arrays, which hold no shard here); the actor on ``final``."""
    if self.grow:
      parts = [transfer.copy(held, dst) for dst in self.dst]
      if len(parts) == 1:
        return parts[0]
      return jax.tree.map(lambda s, *ps: assembled(list(ps), s, ps[0].shape), self.final,
                          *parts)
    src = jax.tree.map(lambda x, s: transfer.placeholder(x.shape, x.dtype, s), held, self.src)
    return transfer.copy(src, self.dst[0])


@dataclasses.dataclass
class BatchLinks:
  """How a batch goes from the rollout devices (R) to the first training node's (T)."""
  parts: int               # c
  src: list[NamedSharding]  # per part, its sharding on the rollout side
  dst: list[NamedSharding]  # per part, where it lands
  whole: NamedSharding | None  # T = c·R: the parts as one array over the T devices
  split: Any               # the rollout side's program (None: the batch is the one part)
  cut: bool                # R = c·T: each part is a block of the split's rows

  @classmethod
  def of(cls, rollout_sharding: NamedSharding, train_devices: list) -> "BatchLinks":
    rollout = list(rollout_sharding.mesh.devices.flat)
    r, t = len(rollout), len(train_devices)
    c = ratio(r, t)
    if c is None:
      raise ValueError(f"the rollout's {r} devices and the first training node's {t}: one "
                       f"count must be a multiple of the other")
    if c == 1:
      return cls(1, [rollout_sharding], [transfer.mirror(rollout_sharding, train_devices)],
                 None, None, False)
    rows = _rows(rollout)
    if r > t:
      src = [_rows(rollout[b * t:(b + 1) * t]) for b in range(c)]
      return cls(c, src, [_rows(train_devices)] * c, None,
                 jax.jit(lambda d: jax.tree.map(lambda x: x.copy(), d), out_shardings=rows),
                 True)

    def cut(d):  # c parts of the rows, each over the rollout's devices
      return [{k: v[b * (v.shape[0] // c):(b + 1) * (v.shape[0] // c)] for k, v in d.items()}
              for b in range(c)]
    dst = [_rows(train_devices[b * r:(b + 1) * r]) for b in range(c)]
    return cls(c, [rows] * c, dst, _rows(train_devices), jax.jit(cut, out_shardings=rows),
               False)

  def make_parts(self, data: dict[str, jax.Array]) -> list[dict[str, jax.Array]]:
    """The rollout side's parts of a batch (every rollout process, in batch order: the
    split is a program over the rollout's devices)."""
    if self.split is None:
      return [data]
    out = self.split(data)
    if not self.cut:
      return out
    return [{k: sub_array(v, s, (v.shape[0] // self.parts, *v.shape[1:]))
             for k, v in out.items()} for s in self.src]

  def part_shape(self, shape: list[int]) -> tuple[int, ...]:
    return (shape[0] // self.parts, *shape[1:]) if self.parts > 1 else tuple(shape)

  def joined(self, parts: list[list[jax.Array]], shapes: list[list[int]]) -> list[list[jax.Array]]:
    """The training side's received parts per field (``parts[b][i]``: part b of field i)
    as each field's list of arrays for ``place``: the c parts (R = c·T) or one array."""
    fields = list(zip(*parts))
    if self.whole is None:
      return [list(f) for f in fields]
    return [[assembled(list(f), self.whole, tuple(s))] for f, s in zip(fields, shapes)]


def place_program(train_sharding: NamedSharding):
  """The training side's ``place``: each field's parts, concatenated in order, onto the
  first training node's layout (one part: moved as it is)."""
  def place(d):
    return {k: v[0] if len(v) == 1 else jnp.concatenate(v) for k, v in d.items()}
  return jax.jit(place, out_shardings=train_sharding)
