"""Episodes on the engine's slots: continuous batching across episodes at different turns.

The round loop of episodes.py waits, each turn, for the longest turn of the round.  Here
(the ``engine`` backend) a turn is a request of its own, and the host loop of
``driver.generate`` runs over turns instead of samples: a slot whose turn ends (the engine
stopped it, or the host sees a complete tool call in the turn's text after a chunk) is
freed at once; the episode's environment answers (``turns.finish_turn``), and its next
turn joins the queue, to be prefilled (prompt + episode so far, re-prefilled: the KV
cache is not kept across turns yet) into the next free slot, next to other episodes'
first, second or last turns.  A slot the host freed before the engine did keeps decoding
unread tokens until it is refilled or reaches its limit (its cache bound is kept).

Turn t of episode r draws from ``fold_in(fold_in(rng, t), request_ids[r])``, as in the
round loop, and every decision is a function of the tokens read back, so the greedy
episodes equal the round loop's and the reference backend's token for token.
"""

from __future__ import annotations

import collections

import jax
import numpy as np

from distflow_jax.rollout import turns
from distflow_jax.rollout.cache_growth import chunk_end
from distflow_jax.rollout.sampling import request_keys


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
  # Fixed shapes: episode r always decodes in slot id % b (see EngineConfig, driver.py).
  queues = ([collections.deque(r for r in live if ids[r] % b == s) for s in range(b)]
            if fixed else [collections.deque(live)])
  slot_req = np.full((b,), -1, np.int64)
  # The engine's own view of each slot (prompt length, tokens made, limit, active), which
  # bounds the cache it writes (cache_growth.chunk_end), whether the host reads it or not.
  plen, gen = np.zeros((b,), np.int64), np.zeros((b,), np.int64)
  lim, active = np.ones((b,), np.int64), np.zeros((b,), bool)
  turn_of = np.zeros((len(eps),), np.int64)
  buf: dict[int, tuple[list, list, list]] = {}
  state = engine.start_state()
  while any(queues) or (slot_req >= 0).any():
    free = np.flatnonzero(slot_req < 0)
    if fixed:
      slots = np.array([s for s in free if queues[s]], np.int64)
      reqs = [queues[s].popleft() for s in slots]
    else:
      reqs = [queues[0].popleft() for _ in range(min(len(free), len(queues[0])))]
      slots = free[:len(reqs)]
    started = None
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
      slot_req[s] = -1
      del buf[r]
      ep = eps[r]
      turns.finish_turn(ep, t, lps, slps, tc, int(ids[r]))
      if ep.live:
        turn_of[r] += 1
        queues[int(ids[r] % b) if fixed else 0].append(r)
