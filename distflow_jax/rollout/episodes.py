"""Multi-turn episodes over any rollout backend: generate a turn, cut it at its tool call,
ask the environment, append the observation, go on (issue 35, first form).

    env = EnvSetup.from_config(cfg.rollout)             # rollout.env, tool_parser, limits
    ep = run_episodes(backend, params, prompts, rows, n, env=env, tokenizer=tok,
                      rng=key, request_ids=ids, width=cfg.rollout.max_new_tokens)
    ep.rollout.tokens_RxN, ep.rollout.mask_RxN, ep.loss_mask_RxN, ep.reward_R

Episode r answers prompt r // n (as ``driver.generate``'s rows).  Its response is
everything after the prompt: the model's tokens of each turn and the environment's
observation tokens between them, at most ``width`` tokens (``rollout.max_new_tokens``:
the training passes' response width).  ``mask_RxN`` marks all of them (they are in the
sequence the passes read); ``loss_mask_RxN`` only the generated ones (the losses, KL and
advantages read it: observation tokens are never trained on); log-probs are 0 on
observation tokens.

Each round generates one turn for every live episode in one ``backend.generate`` call
(continuous batching over the engine's slots inside the call), with prompt = the
episode's prompt + response so far, re-prefilled (the KV cache is not kept across turns
yet), request ids = the episodes' own, rng folded with the turn.  A turn's text is cut
just after its first complete tool call (``rollout.tool_parser``); the tokens after it
are dropped.  Then the environment's ``step`` gets the turn's text (through ``EnvGuard``:
deadline and checks).  An episode ends when the environment says ``done``, the turn made
no tool call, the model emitted a stop token, ``rollout.max_turns`` turns were played,
its response is full (``truncated``), or its environment failed (``rollout.on_env_error``).
Every decision is a function of the prompts, rows and tokens, so the engine and the
reference backend play the same greedy episodes token for token.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from distflow_jax.envs import base as env_base, guard as env_guard, parsers
from distflow_jax.rollout import driver


@dataclasses.dataclass(frozen=True)
class EnvSetup:
  """What the episode loop needs from ``rollout.env*`` (see config/defaults.py)."""
  name: str
  factory: Callable[[], env_base.Environment]
  parser: parsers.TagParser
  max_turns: int
  timeout_s: float
  on_error: env_guard.OnEnvError

  @classmethod
  def from_config(cls, rollout: Any) -> "EnvSetup":
    name = rollout.env
    return cls(name, env_base.env_factory(name), parsers.tool_parser(rollout.tool_parser),
               int(rollout.max_turns), float(rollout.env_timeout_s),
               env_guard.OnEnvError(rollout.on_env_error))


@dataclasses.dataclass(frozen=True)
class Episodes:
  rollout: driver.Rollout     # tokens / mask (generated + observation) / log-probs, width N
  loss_mask_RxN: np.ndarray   # bool: generated tokens only
  reward_R: np.ndarray        # float32: the environment's rewards summed over the episode
  turns_R: np.ndarray         # int32: turns the model played
  truncated_R: np.ndarray     # bool: ended because the response was full
  errors: int                 # episodes ended by an environment failure


@dataclasses.dataclass
class _Episode:
  context: list[int]          # prompt + response so far (the next turn's prompt)
  tokens: list[int] = dataclasses.field(default_factory=list)
  gen: list[bool] = dataclasses.field(default_factory=list)
  lps: list[float] = dataclasses.field(default_factory=list)
  slps: list[float] = dataclasses.field(default_factory=list)
  reward: float = 0.0
  turns: int = 0
  live: bool = True
  truncated: bool = False
  stopped: bool = False
  env: Any = None

  def add(self, toks, gen: bool, lps=None, slps=None) -> None:
    zeros = [0.0] * len(toks)
    self.tokens += toks
    self.context += toks
    self.gen += [gen] * len(toks)
    self.lps += zeros if lps is None else list(lps)
    self.slps += zeros if slps is None else list(slps)


def cut_at_call(toks: Sequence[int], decode: Callable[[list[int]], str],
                parser: parsers.TagParser) -> int | None:
  """The fewest leading tokens of ``toks`` whose text holds a complete tool call (None: the
  turn made none).  Binary search: a longer prefix's text extends a shorter one's."""
  if parser.call_end(decode(list(toks))) is None:
    return None
  lo, hi = 1, len(toks)
  while lo < hi:
    mid = (lo + hi) // 2
    if parser.call_end(decode(list(toks[:mid]))) is None:
      lo = mid + 1
    else:
      hi = mid
  return lo


def _observe(ep: _Episode, obs: str, tokenizer, width: int) -> None:
  """Appends the observation's tokens, as many as fit; a cut one truncates the episode."""
  toks = tokenizer.encode(obs) if obs else []
  room = width - len(ep.tokens)
  if len(toks) >= room:  # no room left for another turn either
    toks, ep.truncated, ep.live = toks[:room], True, False
  ep.add(toks, False)


def run_episodes(backend, params, prompts: Sequence[Sequence[int]],
                 rows: Sequence[Mapping[str, Any]], n: int, *, env: EnvSetup, tokenizer,
                 width: int, rng: jax.Array | None = None,
                 request_ids: Sequence[int] | None = None, pad_id: int = 0) -> Episodes:
  """``n`` episodes per prompt (see module doc); ``rows[i]`` is prompt i's data row."""
  num = len(prompts) * n
  ids = (np.arange(num, dtype=np.int64) if request_ids is None
         else np.asarray(request_ids, np.int64).reshape(-1))
  rng = jax.random.key(backend.config.seed) if rng is None else rng
  stop = set(backend.config.stop_ids)
  guard = env_guard.EnvGuard(env.name, env.timeout_s, env.on_error)
  eps = [_Episode(list(map(int, prompts[r // n]))) for r in range(num)]
  for r, ep in enumerate(eps):
    ep.env = guard.make(env.factory, int(ids[r]))
    obs = None if ep.env is None else guard.reset(ep.env, rows[r // n], int(ids[r]))
    if obs is None:
      ep.live = False
    else:
      _observe(ep, obs, tokenizer, width)
  turn = 0
  while True:
    live = [r for r in range(num) if eps[r].live]
    if not live:
      break
    budget = min(backend.config.max_new_tokens, max(width - len(eps[r].tokens) for r in live))
    out = backend.generate(params, [eps[r].context for r in live], 1,
                           rng=jax.random.fold_in(rng, turn), request_ids=ids[live],
                           pad_id=pad_id, max_new_tokens=budget)
    for q, r in enumerate(live):
      ep = eps[r]
      k = min(int(out.lengths_R[q]), width - len(ep.tokens))
      toks = out.tokens_RxN[q, :k].tolist()
      cut = cut_at_call(toks, tokenizer.decode, env.parser)
      k = k if cut is None else cut
      ep.add(toks[:k], True, out.logprobs_RxN[q, :k], out.sampling_logprobs_RxN[q, :k])
      ep.turns += 1
      ep.stopped = cut is None and bool(toks) and toks[k - 1] in stop
      step = guard.step(ep.env, tokenizer.decode(toks[:k]), int(ids[r]))
      if step is None:
        ep.live = False
        continue
      ep.reward += step.reward
      full = len(ep.tokens) >= width
      if step.done or cut is None or ep.turns >= env.max_turns or full:
        ep.live = False
        ep.truncated = full and not step.done and not ep.stopped
        continue
      _observe(ep, step.observation, tokenizer, width)
    turn += 1
  return _assemble(eps, n, width, pad_id, guard.errors)


def _assemble(eps: list[_Episode], n: int, width: int, pad_id: int, errors: int) -> Episodes:
  num = len(eps)
  tokens = np.full((num, width), pad_id, np.int32)
  mask = np.zeros((num, width), bool)
  gen = np.zeros((num, width), bool)
  lp = np.zeros((num, width), np.float32)
  slp = np.zeros((num, width), np.float32)
  for r, ep in enumerate(eps):
    k = len(ep.tokens)
    tokens[r, :k], mask[r, :k], gen[r, :k] = ep.tokens, True, ep.gen
    lp[r, :k], slp[r, :k] = ep.lps, ep.slps
  ro = driver.Rollout(prompt_index_R=np.arange(num, dtype=np.int32) // n, tokens_RxN=tokens,
                      mask_RxN=mask, logprobs_RxN=lp, sampling_logprobs_RxN=slp,
                      lengths_R=mask.sum(1).astype(np.int32),
                      stopped_R=np.array([ep.stopped for ep in eps], bool))
  return Episodes(ro, gen, np.array([ep.reward for ep in eps], np.float32),
                  np.array([ep.turns for ep in eps], np.int32),
                  np.array([ep.truncated for ep in eps], bool), errors)
