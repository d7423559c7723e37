"""One turn of a multi-turn episode, shared by the round loop (episodes.py) and the
engine's episode driver (episode_engine.py): the episode's host-side state, where a turn
ends (its first complete tool call), and what follows it (the environment's step, then
the observation or the episode's end).  See episodes.py for the whole picture."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from distflow_jax.envs import guard as env_guard, parsers


@dataclasses.dataclass
class Episode:
  context: list[int]          # prompt + response so far (the next turn's prompt)
  tokens: list[int] = dataclasses.field(default_factory=list)
  gen: list[bool] = dataclasses.field(default_factory=list)
  lps: list[float] = dataclasses.field(default_factory=list)
  slps: list[float] = dataclasses.field(default_factory=list)
  reward: float = 0.0
  # (index in the response of the turn's last generated token, the step's reward)
  turn_rewards: list = dataclasses.field(default_factory=list)
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


def observe(ep: Episode, obs: str, tokenizer, width: int) -> None:
  """Appends the observation's tokens, as many as fit; a cut one truncates the episode."""
  toks = tokenizer.encode(obs) if obs else []
  room = width - len(ep.tokens)
  if len(toks) >= room:  # no room left for another turn either
    toks, ep.truncated, ep.live = toks[:room], True, False
  ep.add(toks, False)


@dataclasses.dataclass(frozen=True)
class TurnContext:
  """What ending a turn needs (shared by the round loop and the engine's episode driver)."""
  parser: parsers.TagParser
  max_turns: int
  guard: env_guard.EnvGuard
  tokenizer: Any
  width: int
  ends_on_stop: Callable[[Sequence[int]], bool]  # EngineConfig.ends_on_stop
  turn_cap: int = 0  # a turn's most tokens (rollout.max_new_tokens); 0: only the width


def finish_turn(ep: Episode, toks: list[int], lps, slps, tc: TurnContext,
                sample_id: int) -> None:
  """Ends episode ``ep``'s turn that generated ``toks``: keeps what fits, up to its first
  tool call, asks the environment, then ends the episode or appends the observation."""
  k = min(len(toks), tc.width - len(ep.tokens))
  toks = toks[:k]
  cut = cut_at_call(toks, tc.tokenizer.decode, tc.parser)
  k = k if cut is None else cut
  ep.add(toks[:k], True, lps[:k], slps[:k])
  ep.turns += 1
  ep.stopped = cut is None and tc.ends_on_stop(toks[:k])
  full = len(ep.tokens) >= tc.width
  # A turn a limit cut (the per-turn cap or the episode's width) before it made a call or
  # stopped: not a finished answer, whatever the environment makes of it (it is told).
  cut_short = cut is None and not ep.stopped and (0 < tc.turn_cap <= len(toks) or full)
  step = tc.guard.step(ep.env, tc.tokenizer.decode(toks[:k]), sample_id,
                       truncated=cut_short)
  if step is None:
    ep.live = False
    return
  ep.reward += step.reward
  if k:  # the turn's reward sits on its last generated token (GAE sees it there)
    ep.turn_rewards.append((len(ep.tokens) - 1, step.reward))
  if step.done or cut is None or ep.turns >= tc.max_turns or full:
    ep.live = False
    # cut short, or full after a call the environment did not end the episode on
    ep.truncated = cut_short or (full and not step.done and not ep.stopped)
    return
  observe(ep, step.observation, tc.tokenizer, tc.width)
