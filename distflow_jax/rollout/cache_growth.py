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
"""

from __future__ import annotations

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
