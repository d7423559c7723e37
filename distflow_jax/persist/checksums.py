"""Checkpoint integrity: a checksum of every saved array, the same on any mesh.

Orbax and tensorstore keep no checksums of the values: bytes flipped inside an
OCDBT data file decode to other numbers, and a run resumed from them would train on
them without a word.  So a save also stores a checksum of every array in the step's
``meta`` (committed atomically with the arrays), and a restore compares.

An array's checksum is two 32-bit sums, over its elements, of a hash of the
element's bits and its global position.  Each device adds up its own block
(one jitted program per mesh over all of its arrays, cached by their shapes and
shardings; replicas count zero)
with no communication between devices, and the processes' parts are added on
the host (``all_figures``).  The sums are modular integer arithmetic (exact in
any order) and the position is global, so the figure does not depend on the
mesh or the process count: a checkpoint restored onto another one verifies
against the figure of its save.  ``host_figures`` gives the same figures from
a host array (export).

The file record and the checks of a step's files are in ``checkpoint_files``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from distflow_jax import groups

_SEEDS = (0x9E3779B9, 0x7F4A7C15)  # one per 32-bit lane
_CHUNK = 1 << 22  # host checksums work through this many elements at a time


def path_name(k: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def flatten(tree: Any) -> dict[str, Any]:
  """``{"actor.params.embed.embedding.value": leaf}``."""
  return {".".join(path_name(k) for k in path): x
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# ---- array checksums --------------------------------------------------------------------------

def _fmix(h, xp):
  """murmur3's 32-bit finaliser (uint32 -> uint32)."""
  h = h ^ (h >> 16)
  h = h * xp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * xp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _lanes(bits, index, xp):
  return [xp.sum(_fmix(bits ^ _fmix(index ^ xp.uint32(s), xp), xp), dtype=xp.uint32)
          for s in _SEEDS]


def _device_bits(x):
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  n = x.dtype.itemsize
  if n >= 4:
    return lax.bitcast_convert_type(x, jnp.uint32)  # 8-byte types: a trailing axis of 2
  return lax.bitcast_convert_type(x, {2: jnp.uint16, 1: jnp.uint8}[n]).astype(jnp.uint32)


def _block_figures(x, starts, shape):
  """``[lane 0, lane 1, non-finite count]`` of one block of an array of global ``shape``
  whose first element sits at ``starts``."""
  bits = _device_bits(x)
  shape = tuple(shape) + bits.shape[x.ndim:]  # 8-byte types: a trailing axis of 2
  index, stride = jnp.zeros(bits.shape, jnp.uint32), 1
  for d in reversed(range(bits.ndim)):  # the flat global position, modulo 2**32
    pos = lax.broadcasted_iota(jnp.uint32, bits.shape, d)
    if d < x.ndim:
      pos = pos + starts[d]
    index = index + pos * jnp.uint32(stride % 2**32)
    stride *= shape[d]
  bad = (jnp.sum(~jnp.isfinite(x), dtype=jnp.uint32) if jnp.issubdtype(x.dtype, jnp.inexact)
         else jnp.uint32(0))
  return jnp.stack(_lanes(bits, index, jnp) + [bad])


def _axes(entry: Any) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@functools.lru_cache(maxsize=None)
def _sharded(mesh: Any, specs: tuple[PartitionSpec, ...], shapes: tuple[tuple[int, ...], ...]
             ) -> Any:
  """One program for every array on ``mesh`` (array i of global ``shapes[i]`` laid out as
  ``specs[i]``): each device's figures of its block of each, without any communication:
  an array with one row of figures per device and array (zeros on replicas, so that each
  block counts once)."""
  names = tuple(mesh.axis_names)

  def figures(x, spec, shape):
    dims = [_axes(spec[d] if d < len(spec) else None) for d in range(len(shape))]
    used = {a for axes in dims for a in axes}
    starts = []
    for d, axes in enumerate(dims):
      i = jnp.uint32(0)
      for a in axes:  # the block's index along d (several axes: major to minor)
        i = i * jnp.uint32(mesh.shape[a]) + lax.axis_index(a).astype(jnp.uint32)
      starts.append(i * jnp.uint32(x.shape[d]))
    first = jnp.bool_(True)
    for a in names:
      if a not in used:
        first = first & (lax.axis_index(a) == 0)
    return jnp.where(first, _block_figures(x, starts, shape), jnp.uint32(0))

  def block(*xs):
    rows = jnp.stack([figures(x, sp, sh) for x, sp, sh in zip(xs, specs, shapes)])
    return rows.reshape((1,) * len(names) + rows.shape)

  return jax.jit(jax.shard_map(block, mesh=mesh, in_specs=specs,
                               out_specs=PartitionSpec(*names), check_vma=False))


def mesh_programs(arrays: dict[str, Any]) -> list[tuple[list[str], Any, tuple]]:
  """``[(names, program, arguments)]``: one program per mesh over the NamedSharding
  ``arrays`` (real or ``ShapeDtypeStruct``) laid out on it (``_sharded``)."""
  by_mesh: dict[Any, list[str]] = {}
  for name, x in arrays.items():
    by_mesh.setdefault(x.sharding.mesh, []).append(name)
  out = []
  for mesh, names in by_mesh.items():
    xs = tuple(arrays[n] for n in names)
    out.append((names, _sharded(mesh, tuple(x.sharding.spec for x in xs),
                                tuple(x.shape for x in xs)), xs))
  return out


def _sharded_figures(arrays: dict[str, jax.Array]) -> dict[str, list[Any]]:
  """``{name: [figure rows of each addressable device]}`` of NamedSharding ``arrays``."""
  parts: dict[str, list[Any]] = {}
  for names, fn, xs in mesh_programs(arrays):
    rows = [np.asarray(s.data).reshape(-1, len(names), 3) for s in fn(*xs).addressable_shards]
    for i, n in enumerate(names):
      parts[n] = [r[:, i] for r in rows]
  return parts


_single = jax.jit(_block_figures, static_argnums=2)


def array_figures(tree: Any) -> dict[str, list[int]]:
  """``{name: [lane 0, lane 1, non-finite count]}`` of this process's part of every array.

  On the devices, with no communication (so nothing for processes to wait on
  or to order); ``all_figures`` adds the processes' parts up.  Host leaves
  count on process 0.
  """
  parts: dict[str, list[Any]] = {}
  named: dict[str, jax.Array] = {}
  for name, x in flatten(tree).items():
    if not isinstance(x, jax.Array):
      if groups.is_leader():
        parts[name] = [host_figures(np.asarray(x))]
    elif isinstance(x.sharding, NamedSharding):
      if x.sharding.addressable_devices:
        named[name] = x
    else:  # another kind of sharding: block by block
      parts[name] = [_single(s.data, np.array([i.start or 0 for i in s.index], np.uint32),
                             x.shape) for s in x.addressable_shards if s.replica_id == 0]
  parts.update(_sharded_figures(named))
  return {name: _add(row for f in fs for row in np.asarray(f).reshape(-1, 3).tolist())
          for name, fs in parts.items()}


def _add(figures: Any) -> list[int]:
  total = [0, 0, 0]
  for a, b, bad in figures:
    total = [(total[0] + int(a)) % 2**32, (total[1] + int(b)) % 2**32, total[2] + int(bad)]
  return total


def checksum(figures: list[int]) -> str:
  return f"{figures[0]:08x}{figures[1]:08x}"


def gather_json(obj: Any) -> list[Any]:
  """Every process's JSON-able ``obj``, in process order (a collective among the calling
  thread's process group, ``groups.within``; every process outside one)."""
  group = groups.current()
  if jax.process_count() == 1 or (group is not None and len(group) == 1):
    return [obj]
  data = np.frombuffer(json.dumps(obj, sort_keys=True).encode(), np.uint8)
  sizes = groups.allgather(np.array([data.size], np.int32))
  # Padded to a power of two: the gather compiles once per size, so a few sizes in a run.
  padded = np.zeros(1 << max(10, (int(sizes.max()) - 1).bit_length()), np.uint8)
  padded[:data.size] = data
  rows = groups.allgather(padded)
  return [json.loads(bytes(rows[i, :int(sizes[i, 0])])) for i in range(rows.shape[0])]


def agree(problem: str | None) -> str | None:
  """The first process's problem, on every process (a collective, as ``gather_json``)."""
  return next((p for p in gather_json(problem) if p), None)


def all_figures(tree: Any) -> dict[str, list[int]]:
  """``array_figures`` of every array, added up over the processes (a collective)."""
  parts: dict[str, list[list[int]]] = {}
  for figures in gather_json(array_figures(tree)):
    for name, f in figures.items():
      parts.setdefault(name, []).append(f)
  return {name: _add(fs) for name, fs in parts.items()}


def checksums(tree: Any) -> dict[str, str]:
  """``{name: checksum}`` of every array of ``tree`` (a collective)."""
  return {n: checksum(f) for n, f in all_figures(tree).items()}


def sections(trees: dict[str, Any]) -> dict[str, dict[str, str]]:
  """``{section: {name: checksum}}`` of several trees at once (a collective): one program
  per mesh over all of their arrays, so a save's trained state, reference and LoRA base
  checksum in one program, with the names each tree alone would give."""
  out: dict[str, dict[str, str]] = {k: {} for k in trees}
  for name, s in checksums(trees).items():
    head, _, rest = name.partition(".")
    out[head][rest] = s
  return out


def _host_bits(x: np.ndarray) -> np.ndarray:
  x = np.ascontiguousarray(x).reshape(-1)
  if x.dtype == np.bool_:
    return x.astype(np.uint32)
  if x.dtype.itemsize >= 4:
    return x.view(np.uint32)
  return x.view({2: np.uint16, 1: np.uint8}[x.dtype.itemsize]).astype(np.uint32)


def host_figures(x: np.ndarray) -> list[int]:
  """``array_figures``'s figures of a host array."""
  x = np.asarray(x)
  bits, sums = _host_bits(x), [0, 0]
  for start in range(0, bits.size, _CHUNK):
    b = bits[start:start + _CHUNK]
    index = np.arange(start, start + b.size, dtype=np.uint64).astype(np.uint32)
    for i, s in enumerate(_lanes(b, index, np)):
      sums[i] = (sums[i] + int(s)) % 2**32
  bad = int((~np.isfinite(x)).sum()) if jnp.issubdtype(x.dtype, jnp.inexact) else 0
  return sums + [bad]


def check(where: str, saved: dict[str, str] | None, tree: Any,
          log: Callable[[str], None]) -> str | None:
  """What is wrong with restored arrays (a collective); says so when nothing can be checked."""
  if saved is None:
    log(f"checkpoint: {where} has no checksums (an older version saved it); its arrays are "
        f"not verified")
  return verify(saved, all_figures(tree))


def verify(saved: dict[str, str] | None, figures: dict[str, list[int]]) -> str | None:
  """What is wrong with restored arrays, given the checksums saved with them (or None)."""
  if saved is None:  # a checkpoint of an older version: a NaN is the only tell
    return non_finite(figures)
  bad = mismatched(saved, figures)
  return describe_mismatch(bad) if bad else None


def mismatched(saved: dict[str, str], figures: dict[str, list[int]]) -> list[str]:
  """The arrays whose checksum differs from the saved one (parameters first)."""
  bad = [n for n in saved if n in figures and checksum(figures[n]) != saved[n]]
  return sorted(bad, key=lambda n: (".opt_state." in n, n))


def describe_mismatch(bad: list[str]) -> str:
  more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
  return (f"array {bad[0]}{more} does not match the checksum saved with it (the files "
          f"changed after the save)")


def non_finite(figures: dict[str, list[int]]) -> str | None:
  """For a checkpoint without checksums: the first array holding NaN or inf, if any."""
  bad = [n for n in sorted(figures) if figures[n][2]]
  if not bad:
    return None
  return (f"array {bad[0]} holds {figures[bad[0]][2]} non-finite value(s) and the checkpoint "
          f"has no checksums to tell damage from divergence")
