"""Appending tokens to slots' KV caches: a multi-turn episode's next turn without a re-prefill.

    ext = Extender.for_engine(engine)
    state, tok, lp, slp = ext(params, state, slots, rows, starts, keys_Qx2, limits)

Slot ``slots[q]`` holds an episode whose first ``starts[q]`` tokens are in its cache; the
tokens ``rows[q]`` (the end of the model's turn not yet written, then the environment's
observation) are run through the model at positions ``starts[q]...``, attending to the
cached keys and values and to each other, and written into the cache there.  The slot is
then armed with the first token of the next turn, drawn from the logits after the last
appended token with the turn's key at step 0 (as a prefill draws it), and a new limit.
Cache entries at and after the appended tokens' end are cleared (the previous turn's
unread tokens after its tool call).  Rows not named keep their state: their writes go
past the cache and are dropped.

One program per appended-length bucket (powers of two from 8) and cache capacity; with
fixed shapes (``trainer.deterministic``) one length, the cache's, for every call.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from distflow_jax.models.transformer import KVCache, forward
from distflow_jax.rollout.engine.decode import DecodeState, is_stop, started_history
from distflow_jax.rollout.engine.config import decode_state_shardings
from distflow_jax.rollout.engine.sampling import SamplingParams, sample


def extend_rows(graphdef: nnx.GraphDef, params: nnx.State, state: DecodeState,
                tokens_BxM: jax.Array, starts_B: jax.Array, lens_B: jax.Array,
                keys_Bx2: jax.Array, limits_B: jax.Array, *, sp: SamplingParams,
                stop_ids: Sequence[int]) -> tuple[DecodeState, jax.Array, jax.Array, jax.Array]:
  """Rows with ``lens_B > 0`` append ``tokens_BxM[b, :lens_B[b]]`` (see module doc)."""
  b, m = tokens_BxM.shape
  s = state.cache.max_len
  sel_B = lens_B > 0
  mask_BxM = jnp.arange(m)[None, :] < lens_B[:, None]
  positions_BxM = starts_B[:, None] + jnp.arange(m, dtype=jnp.int32)[None, :]
  write_at_B = jnp.where(sel_B, starts_B, s)  # past the cache: the writes are dropped
  hidden_BxMxD, cache = forward(graphdef, params, tokens_BxM, positions_BxM, mask_BxM,
                                state.cache, write_at_B, return_hidden=True)
  model = nnx.merge(graphdef, params)
  last_BxD = jnp.take_along_axis(hidden_BxMxD, jnp.maximum(lens_B - 1, 0)[:, None, None],
                                 axis=1)[:, 0]
  logits_BxV = jnp.einsum("bd,dv->bv", last_BxD, model.unembed_matrix(),
                          preferred_element_type=jnp.float32)
  tok_B, lp_B, slp_B = sample(logits_BxV, keys_Bx2, jnp.zeros((b,), jnp.int32), sp)
  end_B = starts_B + lens_B
  stale_BxS = sel_B[:, None] & (jnp.arange(s)[None, :] >= end_B[:, None])
  cache = KVCache(k=cache.k, v=cache.v, pos=jnp.where(stale_BxS, -1, cache.pos))

  def put(old, new):
    return jnp.where(sel_B.reshape((b,) + (1,) * (old.ndim - 1)), new.astype(old.dtype), old)

  state = DecodeState(
      cache=cache, tokens_B=put(state.tokens_B, tok_B), index_B=put(state.index_B, end_B),
      generated_B=put(state.generated_B, jnp.ones((b,), jnp.int32)),
      limit_B=put(state.limit_B, limits_B),
      active_B=put(state.active_B, ~is_stop(tok_B, stop_ids) & (limits_B > 1)),
      keys_Bx2=put(state.keys_Bx2, keys_Bx2),
      recent_BxJ=put(state.recent_BxJ, started_history(tok_B, state.recent_BxJ.shape[1])))
  return state, tok_B, lp_B, slp_B


def bucket(length: int) -> int:
  """The appended-length bucket of ``length`` tokens: a power of two, at least 8."""
  return max(8, 1 << (max(length, 1) - 1).bit_length())


def append_lengths(config) -> tuple[int, ...]:
  """Every appended length ``Extender`` pads to for an engine of ``config``: none without
  episodes (``episode_tokens`` 0); with fixed shapes the cache's bucket alone; else the
  buckets up to the episode's response (an append is the end of a turn and an
  observation, after the episode's prompt: at most ``episode_tokens`` tokens)."""
  if not config.episode_tokens:
    return ()
  if config.fixed_shapes:
    return (bucket(config.cache_len),)
  top = bucket(config.episode_tokens)
  return tuple(1 << i for i in range(3, top.bit_length()))


class Extender:
  """``extend_rows`` jitted for one engine (its graph, sampling, stop ids, shardings)."""

  def __init__(self, engine):
    c = engine.config
    sh = decode_state_shardings(engine.mesh, engine.model_cfg)
    rep = NamedSharding(engine.mesh, P())
    self.slots = engine.max_concurrent_decodes
    # Fixed shapes (trainer.deterministic): one length for every call, so a slot's numbers
    # never depend on what the other slots append beside it.
    self.fixed_len = bucket(c.cache_len) if c.fixed_shapes else 0
    self.lengths = append_lengths(c)
    self._fn = jax.jit(functools.partial(extend_rows, engine.graphdef, sp=c.sampling,
                                         stop_ids=c.stop_ids),
                       donate_argnums=(1,), out_shardings=(sh, rep, rep, rep))

  @classmethod
  def for_engine(cls, engine) -> "Extender":
    """The engine's own (``Engine.extender``), so its programs compile once per run."""
    return engine.extender

  def programs(self, params_sig, states: dict) -> list[tuple[str, object, tuple, tuple]]:
    """``(name, jitted, abstract args, group)`` of every append program: each appended
    length (``append_lengths``) at each cache capacity of ``states`` that can hold it."""
    b = self.slots
    ints, keys = np.zeros((b,), np.int32), np.zeros((b, 2), np.uint32)
    return [(f"append[len={m},cap={c}]", self._fn,
             (params_sig, st, np.zeros((b, m), np.int32), ints, ints, keys, ints), ("append", m))
            for m in self.lengths for c, st in states.items() if m // 2 < c]

  def __call__(self, params, state: DecodeState, slots: Sequence[int],
               rows: Sequence[Sequence[int]], starts: Sequence[int], keys_Qx2: np.ndarray,
               limits: Sequence[int]):
    b = self.slots
    m = self.fixed_len or bucket(max(len(r) for r in rows))
    tokens = np.zeros((b, m), np.int32)
    starts_b, lens = np.zeros((b,), np.int32), np.zeros((b,), np.int32)
    keys, lim = np.zeros((b, 2), np.uint32), np.ones((b,), np.int32)
    for q, s in enumerate(slots):
      tokens[s, :len(rows[q])] = rows[q]
      starts_b[s], lens[s], keys[s], lim[s] = starts[q], len(rows[q]), keys_Qx2[q], limits[q]
    return self._fn(params, state, tokens, starts_b, lens, keys, lim)
