"""Batch generation for RL: n samples per prompt, continuous batching over the engine's slots.

    out = generate(engine, params, prompts, n=4, rng=jax.random.key(step))
    out.tokens_RxN, out.mask_RxN, out.logprobs_RxN    # row r = sample r % n of prompt r // n

The host loop keeps the slots busy: it starts as many pending requests as
there are free slots (the samples of one prompt share one prefill), runs the
engine's compiled decode chunk of K tokens (one program, no conditional), and
between chunks frees the finished slots, refills them, and stops once no
request is left.  Each chunk's results are read back (a sync point every K
tokens, which also keeps CPU collectives from piling up).

Every decision is a function of the prompts and of the values read back, so
all processes that drive one replica take the same decisions and issue the
same jitted calls in the same order.  The same holds for a growing decode
cache's capacity (`grow_cache`): before each chunk the host bounds the slots it
can write from the lengths it has read (`cache_growth.chunk_end`) and the
engine grows the cache to hold them.  With the default per-host replica each
host generates its own prompts without any cross-host traffic.

The response of a request is its sampled tokens up to and including the stop
token (or `max_new_tokens` of them); `logprobs_RxN` are the untruncated log-probs at
the sampling temperature (what a teacher-forced forward at that temperature gives;
temperature 1 for greedy), the truncated ones are `sampling_logprobs_RxN`.  Padding is
`pad_id`, mask False and logprob 0.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, NamedTuple, Sequence

import jax
import numpy as np

from distflow_jax.rollout.engine.cache_growth import chunk_end
from distflow_jax.rollout.engine import Engine, EngineConfig
from distflow_jax.rollout.engine.sampling import request_keys


@dataclasses.dataclass(frozen=True)
class Rollout:
  """Responses of R = prompts x n requests, padded to N = max_new_tokens."""
  prompt_index_R: np.ndarray     # int32: the prompt each row answers
  tokens_RxN: np.ndarray         # int32
  mask_RxN: np.ndarray           # bool: real response tokens
  logprobs_RxN: np.ndarray       # float32: untruncated, at the sampling temperature
  sampling_logprobs_RxN: np.ndarray  # float32: log-probs under the sampling distribution
  lengths_R: np.ndarray          # int32
  stopped_R: np.ndarray          # bool: ended on a stop token (else hit max_new_tokens)

  @property
  def num_tokens(self) -> int:
    return int(self.lengths_R.sum())


class Requests(NamedTuple):
  """A checked `generate` call: what every backend needs to serve it identically."""
  prompts: list[list[int]]
  max_new_tokens: int    # the response budget of this call
  ids_R: np.ndarray      # uint32 request ids, row r = sample r % n of prompt r // n
  keys_Rx2: np.ndarray   # uint32 raw key of each request's PRNG stream


def prepare_requests(cfg: EngineConfig, prompts: Sequence[Sequence[int]], n: int, *,
                     max_new_tokens: int | None = None, rng: jax.Array | None = None,
                     request_ids: Sequence[int] | None = None) -> Requests:
  """Checks a `generate` call against `cfg` and derives each request's key (see `generate`).

  Shared by the rollout backends (`backend`), so they refuse the same calls
  and request r draws from `fold_in(rng, request_ids[r])` in all of them.
  """
  n_max = cfg.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
  if not 0 < n_max <= cfg.max_new_tokens:
    raise ValueError(f"generate: max_new_tokens={max_new_tokens} must be in "
                     f"[1, {cfg.max_new_tokens}] (the engine's cache size)")
  if n <= 0:
    raise ValueError(f"generate: n={n} samples per prompt must be positive")
  prompts = [list(map(int, p)) for p in prompts]
  for i, p in enumerate(prompts):
    if not p:
      raise ValueError(f"generate: prompt {i} is empty")
    cfg.bucket_for(len(p))  # fail before anything runs
  num = len(prompts) * n
  if rng is None:
    rng = jax.random.key(cfg.seed)
  ids = (np.arange(num, dtype=np.uint32) if request_ids is None
         else np.asarray(request_ids, dtype=np.uint32).reshape(-1))
  if ids.shape != (num,):
    raise ValueError(f"generate: {ids.size} request_ids for {num} requests "
                     f"({len(prompts)} prompts x n={n})")
  return Requests(prompts, n_max, ids, np.asarray(request_keys(rng, ids)))


def request_queues(requests, ids: np.ndarray, b: int, fixed: bool) -> list[collections.deque]:
  """The waiting requests: with fixed shapes one queue per slot (request r always decodes in
  slot ids[r] % b, so its numbers never depend on which others share the replica), else
  one queue that any free slot takes from."""
  requests = list(requests)
  if fixed:
    return [collections.deque(r for r in requests if ids[r] % b == s) for s in range(b)]
  return [collections.deque(requests)]


def next_requests(queues: list[collections.deque], slot_req: np.ndarray,
                  fixed: bool) -> tuple[np.ndarray, list[int]]:
  """``(slots, requests)``: the free slots (``slot_req < 0``) filled from ``queues``."""
  free = np.flatnonzero(slot_req < 0)
  if fixed:
    slots = np.array([s for s in free if queues[s]], np.int64)
    return slots, [queues[s].popleft() for s in slots]
  reqs = [queues[0].popleft() for _ in range(min(len(free), len(queues[0])))]
  return free[:len(reqs)], reqs


def generate(engine: Engine, params, prompts: Sequence[Sequence[int]], n: int = 1, *,
             max_new_tokens: int | None = None, rng: jax.Array | None = None,
             pad_id: int = 0, request_ids: Sequence[int] | None = None) -> Rollout:
  """Generates `n` responses per prompt with continuous batching (see module doc).

  `rng` seeds the requests' PRNG streams (request r draws with
  `fold_in(rng, request_ids[r])`, by default `fold_in(rng, r)`).  Global ids
  (e.g. sample ids) make the samples independent of how prompts are spread
  over hosts; with local indices, give each host its own (e.g. folded with the process
  index) or they will sample alike.  Default: the engine's seed.
  """
  req = prepare_requests(engine.config, prompts, n, max_new_tokens=max_new_tokens, rng=rng,
                         request_ids=request_ids)
  prompts, n_max, ids, keys_Rx2 = req.prompts, req.max_new_tokens, req.ids_R, req.keys_Rx2
  num = len(prompts) * n

  toks: list[list[int]] = [[] for _ in range(num)]
  lps: list[list[float]] = [[] for _ in range(num)]
  slps: list[list[float]] = [[] for _ in range(num)]
  b = engine.max_concurrent_decodes
  fixed = engine.config.fixed_shapes
  # Fixed shapes: request r always decodes in slot id % b and prefills in that row, so its
  # numbers never depend on which other requests share the replica (see EngineConfig).
  queues = request_queues(range(num), ids, b, fixed)
  slot_req = np.full((b,), -1, np.int64)
  slot_end = np.ones((b,), np.int64)  # a free slot's row keeps writing below this slot
  state = engine.start_state()
  while any(queues) or (slot_req >= 0).any():
    started = None
    slots, reqs = next_requests(queues, slot_req, fixed)
    if reqs:
      if fixed:
        plist, src = [prompts[r // n] for r in reqs], list(range(len(reqs)))
      else:  # the samples of a prompt share one prefill
        groups = list(dict.fromkeys(r // n for r in reqs))
        plist, src = [prompts[g] for g in groups], [groups.index(r // n) for r in reqs]
      state, tok, lp, slp = engine.prefill_insert(
          params, state, plist, src, slots, keys_Rx2[reqs], [n_max] * len(reqs))
      slot_req[slots] = reqs
      started = (reqs, tok, lp, slp)
    k = engine.config.decode_steps
    for s in np.flatnonzero(slot_req >= 0):  # the first token of a started one is not read yet
      r = slot_req[s]
      g = len(toks[r]) + (started is not None and r in started[0])
      slot_end[s] = chunk_end(len(prompts[r // n]), g, True, k, n_max)
    state = engine.fit(state, int(slot_end.max()))
    state, out = engine.generate_steps(params, state)
    out = jax.device_get(out)
    if started is not None:
      reqs = started[0]
      tok, lp, slp = (np.asarray(x) for x in jax.device_get(started[1:]))
      for q, r in enumerate(reqs):
        toks[r].append(int(tok[q]))
        lps[r].append(float(lp[q]))
        slps[r].append(float(slp[q]))
    for s in np.flatnonzero(slot_req >= 0):
      r = slot_req[s]
      valid = out.valid_BxK[s]
      toks[r].extend(out.tokens_BxK[s][valid].tolist())
      lps[r].extend(out.logprobs_BxK[s][valid].tolist())
      slps[r].extend(out.sampling_logprobs_BxK[s][valid].tolist())
      if not out.active_B[s]:
        slot_req[s] = -1
        slot_end[s] = chunk_end(len(prompts[r // n]), len(toks[r]), False, k, n_max)
  return assemble(toks, lps, slps, n, n_max, engine.config.ends_on_stop, pad_id)


def assemble(toks: list[list[int]], lps: list[list[float]], slps: list[list[float]], n: int,
             n_max: int, ends_on_stop: Callable[[Sequence[int]], bool], pad_id: int) -> Rollout:
  """A `Rollout` from each request's tokens, log-probs and sampling log-probs (ragged)."""
  num = len(toks)
  tokens = np.full((num, n_max), pad_id, np.int32)
  mask = np.zeros((num, n_max), bool)
  lp = np.zeros((num, n_max), np.float32)
  slp = np.zeros((num, n_max), np.float32)
  lengths = np.zeros((num,), np.int32)
  stopped = np.zeros((num,), bool)
  for r in range(num):
    k = len(toks[r])
    if not 0 < k <= n_max:
      raise RuntimeError(f"generate: request {r} produced {k} tokens, expected 1..{n_max}")
    tokens[r, :k], mask[r, :k], lp[r, :k], slp[r, :k] = toks[r], True, lps[r], slps[r]
    lengths[r] = k
    stopped[r] = ends_on_stop(toks[r])
  return Rollout(prompt_index_R=np.arange(num, dtype=np.int32) // n, tokens_RxN=tokens,
                 mask_RxN=mask, logprobs_RxN=lp, sampling_logprobs_RxN=slp, lengths_R=lengths,
                 stopped_R=stopped)
