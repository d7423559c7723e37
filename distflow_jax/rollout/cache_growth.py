"""The decode cache grows by windows: capacities, the grow step and the host's bound.

Why windows and not pages: decode attention already reads only the smallest of
`models.attention.decode_windows(S)` that holds every written slot (S = the
longest prompt bucket + max_new_tokens).  A cache whose length is one of those
windows therefore holds everything a step reads, and the read slices have the
same shapes and contents as in a full-size cache: the numbers (tokens and
log-probs) are bitwise those of the full-size cache, with no gather through a
page table and no new attention kernel.  The capacities are a bounded set (at
most 8: the windows from the first one that holds the longest prompt bucket
plus one decode chunk), so decode, insert and grow compile at most that many
variants, all made ahead by `Engine.precompile`.

The engine starts each `generate` at the smallest capacity; before each decode
chunk the driver gives `chunk_end`, an upper bound of the slots the chunk can
write, computed on the host from what it already read back (no extra sync), and
the engine pads the cache along the sequence axis to the next capacity that
holds it (`grow_state`, one window at a time so only len(capacities) - 1 grow
variants exist).  Memory is then slots x the longest active row's window
instead of slots x S.  `fixed_shapes` (trainer.deterministic) keeps one
full-size capacity.

The engine grows with `Grower`, layer by layer: each layer's keys and values are padded
by one jitted call, waited for, and the old layer's buffers deleted before the next
layer, so the old and the new cache never coexist whole: a growth holds the new cache
plus one old layer, not old + new.  (Donation would not free them: a padded buffer has
another shape, so jax declines it, "Some donated buffers were not usable", and keeps the
input alive.)  The old state's cache is unusable afterwards; its other fields are
shared with the new state.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from distflow_jax.models.attention import decode_windows
from distflow_jax.models.transformer import KVCache
from distflow_jax.rollout.decode import DecodeState


def capacities(cache_len: int, first_need: int, grow: bool) -> tuple[int, ...]:
  """The cache lengths an engine uses: the windows of `cache_len` from the first that
  holds `first_need` slots (the longest prompt bucket plus one chunk), or (cache_len,)."""
  if not grow:
    return (cache_len,)
  return tuple(w for w in decode_windows(cache_len) if w >= min(first_need, cache_len))


def capacity_for(caps: tuple[int, ...], end: int) -> int:
  """The smallest capacity that holds `end` slots (the largest when none does)."""
  return next((c for c in caps if c >= end), caps[-1])


def grow_state(state: DecodeState, capacity: int) -> DecodeState:
  """`state` with its cache padded along the sequence axis to `capacity` slots (new k/v
  zero, key positions -1: empty, as `init_cache` leaves them)."""
  c = state.cache
  extra = capacity - c.max_len
  if extra < 0:
    raise ValueError(f"grow_state: cannot shrink a cache of {c.max_len} slots to {capacity}")
  kv = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, extra), (0, 0)))  # noqa: E731
  pos = jnp.pad(c.pos, ((0, 0), (0, extra)), constant_values=-1)
  return state.replace(cache=KVCache(k=tuple(map(kv, c.k)), v=tuple(map(kv, c.v)), pos=pos))


def _pad_kv(x: jax.Array, capacity: int) -> jax.Array:
  return jnp.pad(x, ((0, 0), (0, 0), (0, capacity - x.shape[2]), (0, 0)))


def _pad_pos(pos: jax.Array, capacity: int) -> jax.Array:
  return jnp.pad(pos, ((0, 0), (0, capacity - pos.shape[1])), constant_values=-1)


class Grower:
  """`grow_state` as the engine runs it: one layer at a time, the old layer released as
  its padded copy is made (see the module doc); the same numbers as `grow_state`.

  It keeps the engine's jitted-function surface for its grow step: ``lower(state,
  capacity).compile()`` and ``trace(state, capacity).lower(...)`` cover both programs
  (one layer's keys or values, the key positions) and ``_cache_size()`` counts the
  layer program's variants (one per capacity step, as the one-call grow had)."""

  def __init__(self, state_shardings: DecodeState):
    self._kv = jax.jit(_pad_kv, static_argnums=1, out_shardings=state_shardings.cache.k[0])
    self._pos = jax.jit(_pad_pos, static_argnums=1, out_shardings=state_shardings.cache.pos)

  def __call__(self, state: DecodeState, capacity: int) -> DecodeState:
    c = state.cache
    if capacity < c.max_len:
      raise ValueError(f"grow: cannot shrink a cache of {c.max_len} slots to {capacity}")

    def grow(fn, old):
      new = jax.block_until_ready(fn(old, capacity))
      old.delete()
      return new
    k, v = [], []
    for old_k, old_v in zip(c.k, c.v):
      k.append(grow(self._kv, old_k))
      v.append(grow(self._kv, old_v))
    return state.replace(cache=KVCache(k=tuple(k), v=tuple(v), pos=grow(self._pos, c.pos)))

  def _parts(self, state: Any) -> list[tuple[Any, Any]]:
    return [(self._kv, state.cache.k[0]), (self._pos, state.cache.pos)]

  def lower(self, state: Any, capacity: int) -> "_Programs":
    return _Programs([fn.lower(x, capacity) for fn, x in self._parts(state)])

  def trace(self, state: Any, capacity: int) -> "_Programs":
    return _Programs([fn.trace(x, capacity) for fn, x in self._parts(state)])

  def _cache_size(self) -> int:
    return self._kv._cache_size()


class _Programs:
  """Several traced / lowered / compiled programs acting as one."""

  def __init__(self, parts: list[Any]):
    self.parts = parts

  def lower(self, *args, **kwargs) -> "_Programs":
    return _Programs([p.lower(*args, **kwargs) for p in self.parts])

  def compile(self, *args, **kwargs) -> "_Programs":
    return _Programs([p.compile(*args, **kwargs) for p in self.parts])

  def as_text(self, *args, **kwargs) -> str:
    return "\n".join(p.as_text(*args, **kwargs) for p in self.parts)


def chunk_end(prompt_len: int, generated: int, active: bool, steps: int, limit: int) -> int:
  """One past the last cache slot a slot's row can write in the next `steps` decode steps.

  Its next write goes to slot prompt_len + generated - 1 and one more per step while it
  is active; a finished (or finishing) row keeps rewriting the slot after its last token,
  prompt_len + generated, and that counts too: the windowed attention's `end` is taken
  over every row, so the grown cache must hold it to pick the full cache's window.
  """
  if not active:
    return prompt_len + generated
  return prompt_len + min(generated - 1 + steps, limit)
