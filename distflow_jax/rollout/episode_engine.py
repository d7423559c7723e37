"""Episodes on the engine's slots: continuous batching across episodes at different turns.

The round loop of episodes.py waits, each turn, for the longest turn of the round.  Here
(the ``engine`` backend) a turn is a request of its own, and the host loop of
``driver.generate`` runs over turns instead of samples: a slot whose turn ends (the engine
stopped it, or the host sees a complete tool call in the turn's text after a chunk) stops
being read at once; the episode's environment answers (``turns.finish_turn``), and its
next turn continues in the same slot: the tokens its cache lacks (the turn's last token,
then the observation) are appended to the slot's KV cache (extend.py), not re-prefilled,
while the other slots hold other episodes' first, second or last turns.  An episode that
ends frees its slot for the queue's next episode (prefilled).  A slot the host freed
before the engine did keeps decoding unread tokens until it is refilled or reaches its
limit (its cache bound is kept).

Turn t of episode r draws from ``fold_in(fold_in(rng, t), request_ids[r])``, as in the
round loop, and every decision is a function of the tokens read back, so the greedy
episodes equal the round loop's and the reference backend's token for token.
"""

from __future__ import annotations


import jax
import numpy as np

from distflow_jax.rollout import driver, turns
from distflow_jax.rollout.engine.cache_growth import chunk_end
from distflow_jax.rollout.engine.extend import Extender
from distflow_jax.rollout.engine.sampling import request_keys


def _keys(rng: jax.Array, turn_of: np.ndarray, ids: np.ndarray, reqs: list[int]) -> np.ndarray:
  """Raw keys of the requests ``reqs`` (each at its episode's current turn)."""
  return np.stack([np.asarray(request_keys(jax.random.fold_in(rng, int(turn_of[r])),
                                           np.asarray([ids[r]], np.uint32)))[0]
                   for r in reqs])


def engine_episodes(backend, params, eps: list[turns.Episode], ids: np.ndarray,
                    rng: jax.Array, tc: turns.TurnContext) -> None:
  """Plays every live episode of ``eps`` to its end on ``backend.engine`` (module doc)."""
  engine = backend.engine
  b, k = engine.max_concurrent_decodes, engine.config.decode_steps
  fixed = engine.config.fixed_shapes
  live = [r for r, ep in enumerate(eps) if ep.live]
  # An episode's whole context must fit the slot's cache (positions are cache slots).
  need = max([len(eps[r].context) - len(eps[r].tokens) for r in live], default=0) + tc.width
  if live and need > engine.capacities[-1]:
    raise ValueError(f"episodes of up to {tc.width} response tokens after their prompts need "
                     f"a cache of {need} tokens, but the engine's holds "
                     f"{engine.capacities[-1]}; raise EngineConfig.episode_tokens (the "
                     f"episode width) or the largest prefill bucket")
  queues = driver.request_queues(live, ids, b, fixed)  # fixed: episode r in slot id % b
  slot_req = np.full((b,), -1, np.int64)
  # The engine's own view of each slot (prompt length, tokens made, limit, active), which
  # bounds the cache it writes (cache_growth.chunk_end), whether the host reads it or not.
  plen, gen = np.zeros((b,), np.int64), np.zeros((b,), np.int64)
  lim, active = np.ones((b,), np.int64), np.zeros((b,), bool)
  turn_of = np.zeros((len(eps),), np.int64)
  buf: dict[int, tuple[list, list, list]] = {}
  pending: dict[int, int] = {}  # slot -> where its episode's uncached tokens start
  extend = Extender.for_engine(engine)
  state = engine.start_state()
  while any(queues) or (slot_req >= 0).any():
    slots, reqs = driver.next_requests(queues, slot_req, fixed)
    started = None
    if pending:  # turns that continue in their slot: the new tokens appended to its cache
      slots_e = sorted(pending)
      reqs_e = [int(slot_req[x]) for x in slots_e]
      starts = [pending[x] for x in slots_e]
      limits = [min(engine.config.max_new_tokens, tc.width - len(eps[r].tokens)) for r in reqs_e]
      state = engine.fit(state, max(len(eps[r].context) for r in reqs_e))
      state, tok, lp, slp = extend(params, state, slots_e,
                                   [eps[r].context[st:] for r, st in zip(reqs_e, starts)],
                                   starts, _keys(rng, turn_of, ids, reqs_e), limits)
      tok, lp, slp = (np.asarray(x)[slots_e] for x in jax.device_get((tok, lp, slp)))
      for q, (x, r) in enumerate(zip(slots_e, reqs_e)):
        buf[r] = ([int(tok[q])], [float(lp[q])], [float(slp[q])])
      plen[slots_e] = [len(eps[r].context) for r in reqs_e]
      gen[slots_e], lim[slots_e], active[slots_e] = 1, limits, True
      pending.clear()
    if reqs:
      ctxs = [tuple(eps[r].context) for r in reqs]
      uniq = ctxs if fixed else list(dict.fromkeys(ctxs))  # equal contexts share a prefill
      src = list(range(len(reqs))) if fixed else [uniq.index(c) for c in ctxs]
      limits = [min(engine.config.max_new_tokens, tc.width - len(eps[r].tokens)) for r in reqs]
      state, tok, lp, slp = engine.prefill_insert(
          params, state, [list(c) for c in uniq], src, slots, _keys(rng, turn_of, ids, reqs),
          limits)
      slot_req[slots] = reqs
      plen[slots] = [len(c) for c in ctxs]
      gen[slots], lim[slots], active[slots] = 1, limits, True
      started = (reqs, tok, lp, slp)
    ends = [chunk_end(int(plen[s]), int(gen[s]), bool(active[s]), k, int(lim[s]))
            for s in range(b)]
    state = engine.fit(state, max(ends))
    state, out = engine.generate_steps(params, state)
    out = jax.device_get(out)
    if started is not None:
      tok, lp, slp = (np.asarray(x) for x in jax.device_get(started[1:]))
      for q, r in enumerate(started[0]):
        buf[r] = ([int(tok[q])], [float(lp[q])], [float(slp[q])])
    for s in range(b):
      valid = np.asarray(out.valid_BxK[s], bool)
      gen[s] += int(valid.sum())
      active[s] = bool(out.active_B[s])
      r = int(slot_req[s])
      if r < 0:
        continue
      t, lps, slps = buf[r]
      t.extend(out.tokens_BxK[s][valid].tolist())
      lps.extend(out.logprobs_BxK[s][valid].tolist())
      slps.extend(out.sampling_logprobs_BxK[s][valid].tolist())
      if active[s] and turns.cut_at_call(t, tc.tokenizer.decode, tc.parser) is None:
        continue  # the turn goes on
      del buf[r]
      ep = eps[r]
      cached = int(plen[s]) + int(gen[s]) - 1  # all but the last read token are in the cache
      before = len(ep.tokens)
      turns.finish_turn(ep, t, lps, slps, tc, int(ids[r]))
      if ep.live:  # the next turn continues in this slot, from what the cache keeps
        turn_of[r] += 1
        kept = int(plen[s]) + sum(ep.gen[before:])  # the turn's tokens up to its tool call
        pending[s] = min(cached, kept, len(ep.context) - 1)
      else:
        slot_req[s] = -1
