"""The decode cache can grow (opt-in, `EngineConfig.grow_cache`): capacities, the grow
step and the host's bound.

By default the engine keeps one full-size cache for the run (the longest prompt bucket
plus `max_new_tokens`), so it compiles one decode program.  Where that costs too much
memory early on, `grow_cache` starts the cache at a smaller capacity and grows it along
a ladder of at most 8 capacities (`ladder`: multiples of max(16, S / 8)).  Decode
attention reads a row's whole cache with the keys past its own position masked to
weight exactly 0 (models/attention.py), so a grown cache gives the numbers (tokens and
log-probs) of the full-size one bitwise; each capacity has its own decode, insert and
grow program, all made ahead by `Engine.precompile`, none holding a conditional.

The engine starts each `generate` at the smallest capacity; before each decode
chunk the driver gives `chunk_end`, an upper bound of the slots the chunk can
write, computed on the host from what it already read back (no extra sync), and
the engine pads the cache along the sequence axis to the next capacity that
holds it (`grow_state`, one step of the ladder at a time so only len(capacities) - 1
grow variants exist).  Memory is then slots x the longest active row's capacity
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

from distflow_jax.models.transformer import KVCache
from distflow_jax.rollout.engine.decode import DecodeState


def ladder(s: int) -> tuple[int, ...]:
  """The capacities a growing cache of at most S slots steps through (the last is S):
  multiples of max(16, S / 8), so at most 8 of them."""
  step = max(16, -(-s // 8))
  return tuple(range(step, s, step)) + (s,)


def capacities(cache_len: int, first_need: int, grow: bool) -> tuple[int, ...]:
  """The cache lengths an engine uses: the ladder of `cache_len` from the first capacity
  that holds `first_need` slots (the longest prompt bucket plus one chunk), or
  (cache_len,)."""
  if not grow:
    return (cache_len,)
  return tuple(w for w in ladder(cache_len) if w >= min(first_need, cache_len))


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
  prompt_len + generated (counted too, so a grown cache drops no write the full-size
  cache keeps).
  """
  if not active:
    return prompt_len + generated
  return prompt_len + min(generated - 1 + steps, limit)
