"""The pure, jittable pieces of the engine: prefill, insert, a fixed-length decode chunk.

A decode batch is `B` slots; each slot holds one request at its own length
in a shared KV cache (`[B, Hkv, S, Dh]` per layer).  Positions equal cache slots
(prompts are right padded and the pads have key position -1), so a slot's
next token always sits at cache slot `index_B[b]`.

`decode_chunk` runs exactly K decode steps in one compiled loop with a static trip
count, so there is one host round trip per K tokens, not per token, and the compiled
program holds no data-dependent branch or loop predicate (on a GPU either copies a
predicate to the host and blocks).  The host decides between calls whether to go on
and refills freed slots then (continuous batching at chunk granularity).  Finished
and empty slots still flow through the batched forward (shapes are fixed) but their
results are marked invalid and their state does not move.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax import struct

from distflow_jax.models.transformer import KVCache, forward, init_cache, positions_from_mask
from distflow_jax.rollout.engine.sampling import SamplingParams, sample


@struct.dataclass
class DecodeState:
  """Everything a decode step transforms; every array has the slot axis first (after L)."""
  cache: KVCache          # k/v L x [B, Hkv, S, Dh], pos [B, S]
  tokens_B: jax.Array     # int32: the last sampled token, the next step's input
  index_B: jax.Array      # int32: its position (= cache slot)
  generated_B: jax.Array  # int32: tokens generated so far (the prefill's first token counts)
  limit_B: jax.Array      # int32: max new tokens of the request in the slot
  active_B: jax.Array     # bool: the slot holds an unfinished request
  keys_Bx2: jax.Array     # uint32: the request's PRNG key data
  recent_BxJ: jax.Array   # int32: the request's last J generated tokens, -1 before its first


@struct.dataclass
class Prefix:
  """A prefilled batch of prompts: an L x `[P, Hkv, T, Dh]` cache and each row's next-token logits."""
  cache: KVCache
  logits_PxV: jax.Array   # float32 logits after each prompt's last real token
  lengths_P: jax.Array    # int32 true prompt lengths
  tokens_P: jax.Array     # int32 first sampled token of each row (JetStream's prefill result)
  logprobs_P: jax.Array   # float32 its untruncated log-prob at the sampling temperature
  keys_Px2: jax.Array     # uint32 the request key it was drawn with


@struct.dataclass
class StepOutput:
  """Per-slot results of K decode steps; `valid_BxK` marks the real ones."""
  tokens_BxK: jax.Array
  logprobs_BxK: jax.Array
  sampling_logprobs_BxK: jax.Array
  valid_BxK: jax.Array
  active_B: jax.Array     # after the chunk


def empty_state(cfg, batch: int, max_len: int, history: int = 1) -> DecodeState:
  """All slots free; ``history``: the generated tokens each slot keeps for stop sequences
  (``EngineConfig.history``)."""
  zeros = jnp.zeros((batch,), jnp.int32)
  return DecodeState(cache=init_cache(cfg, batch, max_len), tokens_B=zeros, index_B=zeros,
                     generated_B=zeros, limit_B=zeros, active_B=jnp.zeros((batch,), bool),
                     keys_Bx2=jnp.zeros((batch, 2), jnp.uint32),
                     recent_BxJ=jnp.full((batch, history), -1, jnp.int32))


def is_stop(tokens: jax.Array, stop_ids: Sequence[int]) -> jax.Array:
  if not stop_ids:
    return jnp.zeros(tokens.shape, bool)
  return jnp.isin(tokens, jnp.asarray(stop_ids, jnp.int32))


def started_history(first_Q: jax.Array, history: int) -> jax.Array:
  """``[Q, history]``: a request's recent tokens just after its first one was drawn."""
  pad = jnp.full((first_Q.shape[0], history - 1), -1, jnp.int32)
  return jnp.concatenate([pad, first_Q[:, None].astype(jnp.int32)], axis=1)


def ends_sequence(recent_BxJ: jax.Array, tok_B: jax.Array,
                  stop_sequences: Sequence[Sequence[int]]) -> jax.Array:
  """Whether each slot's generated tokens, ``tok_B`` appended to its ``recent_BxJ``, end with
  one of ``stop_sequences``: a fixed-length suffix compare per sequence (a mask, no branch;
  -1 before a request's first token matches no token)."""
  if not stop_sequences:
    return jnp.zeros(tok_B.shape, bool)
  window_BxW = jnp.concatenate([recent_BxJ, tok_B[:, None].astype(jnp.int32)], axis=1)
  hit_B = jnp.zeros(tok_B.shape, bool)
  for seq in stop_sequences:
    want = jnp.asarray(seq, jnp.int32)[None, :]
    hit_B = hit_B | jnp.all(window_BxW[:, -len(seq):] == want, axis=1)
  return hit_B


def prefill_logits(graphdef: nnx.GraphDef, params: nnx.State, tokens_PxT: jax.Array,
                   lengths_P: jax.Array) -> tuple[KVCache, jax.Array]:
  """Runs right-padded prompts; returns their L x `[P, Hkv, T, Dh]` cache and last-token logits.

  Only the P last hidden states are unembedded, never `[P, T, V]`.
  """
  p, t = tokens_PxT.shape
  model = nnx.merge(graphdef, params)
  mask_PxT = jnp.arange(t)[None, :] < lengths_P[:, None]
  cache = init_cache(model.cfg, p, t)
  hidden_PxTxD, cache = forward(graphdef, params, tokens_PxT, positions_from_mask(mask_PxT),
                                mask_PxT, cache, jnp.zeros((p,), jnp.int32), return_hidden=True)
  last_PxD = jnp.take_along_axis(hidden_PxTxD, (lengths_P - 1)[:, None, None], axis=1)[:, 0]
  logits_PxV = jnp.einsum("pd,dv->pv", last_PxD, model.unembed_matrix(),
                          preferred_element_type=jnp.float32)
  return cache, logits_PxV


def prefill(graphdef: nnx.GraphDef, params: nnx.State, tokens_PxT: jax.Array,
            lengths_P: jax.Array, keys_Px2: jax.Array, *, sp: SamplingParams) -> Prefix:
  """Prefill plus the first sampled token of each row (JetStream's `prefill`)."""
  cache, logits_PxV = prefill_logits(graphdef, params, tokens_PxT, lengths_P)
  tok_P, lp_P, _ = sample(logits_PxV, keys_Px2, jnp.zeros_like(lengths_P), sp)
  return Prefix(cache=cache, logits_PxV=logits_PxV, lengths_P=lengths_P, tokens_P=tok_P,
                logprobs_P=lp_P, keys_Px2=keys_Px2)


def insert_rows(state: DecodeState, prefix_cache: KVCache, src_Q: jax.Array, slots_Q: jax.Array,
                first_tokens_Q: jax.Array, lengths_Q: jax.Array, keys_Qx2: jax.Array,
                limits_Q: jax.Array, *, stop_ids: Sequence[int]) -> DecodeState:
  """Copies prefix rows `src_Q` into decode slots `slots_Q` and arms them.

  A slot index >= B is a padding row and is dropped, so Q can stay fixed.
  The slots' key positions past the prompt are reset to -1, so nothing of
  the previous occupant stays visible.
  """
  t, s = prefix_cache.max_len, state.cache.max_len
  if t > s:
    raise ValueError(f"insert: prefix of {t} tokens does not fit a decode cache of {s} slots")
  c = state.cache

  def put_rows(dst, src):
    return dst.at[slots_Q, :, :t].set(src[src_Q].astype(dst.dtype), mode="drop")
  k = tuple(map(put_rows, c.k, prefix_cache.k))
  v = tuple(map(put_rows, c.v, prefix_cache.v))
  pos_QxS = jnp.pad(prefix_cache.pos[src_Q], ((0, 0), (0, s - t)), constant_values=-1)
  pos = c.pos.at[slots_Q].set(pos_QxS, mode="drop")
  active_Q = ~is_stop(first_tokens_Q, stop_ids) & (limits_Q > 1)

  def put(x, val):
    return x.at[slots_Q].set(val.astype(x.dtype), mode="drop")

  return DecodeState(
      cache=KVCache(k=k, v=v, pos=pos), tokens_B=put(state.tokens_B, first_tokens_Q),
      index_B=put(state.index_B, lengths_Q), generated_B=put(state.generated_B,
                                                             jnp.ones_like(lengths_Q)),
      limit_B=put(state.limit_B, limits_Q), active_B=put(state.active_B, active_Q),
      keys_Bx2=put(state.keys_Bx2, keys_Qx2),
      recent_BxJ=put(state.recent_BxJ,
                     started_history(first_tokens_Q, state.recent_BxJ.shape[1])))


def prefill_sample(graphdef: nnx.GraphDef, params: nnx.State, tokens_PxT: jax.Array,
                   lengths_P: jax.Array, src_Q: jax.Array, keys_Qx2: jax.Array, *,
                   sp: SamplingParams
                   ) -> tuple[KVCache, jax.Array, jax.Array, jax.Array, jax.Array]:
  """Prefills P prompts once and draws the first token of Q requests on them (n samples
  share a prefill): request q continues prompt row `src_Q[q]` with its own key.

  Returns the prompts' cache, each request's prompt length, and its first token, logprob
  and sampling logprob `[Q]`; `insert_rows` then starts the requests.  The two are
  separate calls so that the model's prefill compiles once per prompt shape whatever
  the decode cache's capacity (cache_growth.py); the insert only moves data.
  """
  cache, logits_PxV = prefill_logits(graphdef, params, tokens_PxT, lengths_P)
  tok_Q, lp_Q, slp_Q = sample(logits_PxV[src_Q], keys_Qx2, jnp.zeros_like(src_Q), sp)
  return cache, lengths_P[src_Q], tok_Q, lp_Q, slp_Q


def decode_chunk(graphdef: nnx.GraphDef, params: nnx.State, state: DecodeState, *,
                 sp: SamplingParams, stop_ids: Sequence[int], num_steps: int,
                 stop_sequences: Sequence[Sequence[int]] = ()
                 ) -> tuple[DecodeState, StepOutput]:
  """Exactly `num_steps` decode steps for every slot, in one `lax.scan` (a static trip
  count: no data-dependent loop predicate, no conditional).

  A request finishes on a stop token or at the end of a stop sequence (kept, with their
  logprobs; ``ends_sequence`` over the slot's last tokens) or when it has
  `limit` tokens; from then on its slot flows through the batched forward (shapes are
  fixed) without moving and its results are marked invalid.  Whether to call again (a
  slot left to refill, rows still active) is the host's decision between calls.
  """
  b = state.tokens_B.shape[0]

  def step(st: DecodeState, _):
    logits_Bx1xV, cache = forward(graphdef, params, st.tokens_B[:, None], st.index_B[:, None],
                                  jnp.ones((b, 1), bool), st.cache, st.index_B)
    tok_B, lp_B, slp_B = sample(logits_Bx1xV[:, 0], st.keys_Bx2, st.generated_B, sp)
    live = st.active_B
    generated = st.generated_B + live.astype(jnp.int32)
    done = (is_stop(tok_B, stop_ids) | ends_sequence(st.recent_BxJ, tok_B, stop_sequences)
            | (generated >= st.limit_B))
    recent = jnp.concatenate([st.recent_BxJ[:, 1:], tok_B[:, None].astype(jnp.int32)], axis=1)
    st = st.replace(cache=cache, tokens_B=jnp.where(live, tok_B, st.tokens_B),
                    index_B=st.index_B + live.astype(jnp.int32), generated_B=generated,
                    active_B=live & ~done,
                    recent_BxJ=jnp.where(live[:, None], recent, st.recent_BxJ))
    return st, (jnp.where(live, tok_B, 0), jnp.where(live, lp_B, 0.0),
                jnp.where(live, slp_B, 0.0), live)

  state, (tok_KxB, lp_KxB, slp_KxB, valid_KxB) = jax.lax.scan(step, state, None,
                                                              length=num_steps)
  return state, StepOutput(tokens_BxK=tok_KxB.T, logprobs_BxK=lp_KxB.T,
                           sampling_logprobs_BxK=slp_KxB.T, valid_BxK=valid_KxB.T,
                           active_B=state.active_B)
