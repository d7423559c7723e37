"""Multi-turn episodes over any rollout backend: generate a turn, cut it at its tool call,
ask the environment, append the observation, go on.

    env = EnvSetup.from_config(cfg.rollout)             # rollout.env, tool_parser, limits
    ep = run_episodes(backend, params, prompts, rows, n, env=env, tokenizer=tok,
                      rng=key, request_ids=ids, width=response.response_width(cfg.rollout))
    ep.rollout.tokens_RxN, ep.rollout.mask_RxN, ep.loss_mask_RxN, ep.reward_R

Episode r answers prompt r // n (as ``driver.generate``'s rows).  Its response is
everything after the prompt: the model's tokens of each turn and the environment's
observation tokens between them, at most ``width`` tokens (``rollout.max_episode_tokens``,
else ``rollout.max_new_tokens``: the training passes' response width), each turn at most
the backend's ``max_new_tokens`` (``rollout.max_new_tokens``).  ``mask_RxN`` marks all
of them (they are in the
sequence the passes read); ``loss_mask_RxN`` only the generated ones (the losses, KL and
advantages read it: observation tokens are never trained on); log-probs are 0 on
observation tokens.

Turn t of episode r draws with ``fold_in(rng, t)`` and request id ``request_ids[r]``.
The ``engine`` backend keeps each episode in its slot and appends the turn's new tokens to
the slot's KV cache (episode_engine.py, extend.py), with episodes at different turns
sharing the slots; any other backend plays rounds: one ``backend.generate`` call gives
every live episode its next turn, its prompt the episode's prompt + response so far,
re-prefilled.  A turn's text is cut
just after its first complete tool call (``rollout.tool_parser``); the tokens after it
are dropped.  Then the environment's ``step`` gets the turn's text (through ``EnvGuard``:
deadline and checks).  An episode ends when the environment says ``done``, the turn made
no tool call, the model emitted a stop token, ``rollout.max_turns`` turns were played,
its response is full or a turn reached its cap with no call and no stop (``truncated``),
or its environment failed (``rollout.on_env_error``).
Every decision is a function of the prompts, rows and tokens, so the engine and the
reference backend play the same greedy episodes token for token.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from distflow_jax.envs import base as env_base, guard as env_guard, parsers
from distflow_jax.rollout import driver, episode_engine, turns
from distflow_jax.rollout.engine_backend import EngineBackend


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
  turn_rewards_RxN: np.ndarray  # float32: each turn's reward on its last generated token
  turns_R: np.ndarray         # int32: turns the model played
  truncated_R: np.ndarray     # bool: ended because the response was full
  errors: int                 # episodes ended by an environment failure


def call_stops(rollout: Any, tokenizer) -> tuple[tuple[int, ...], ...]:
  """The tool parser's closing tag as a stop sequence of the run's rollout, when
  ``rollout.env`` is set (else none): its token ids, one (Qwen2.5's ``</tool_call>``: a stop
  id) or several (the ``tag`` parser's ``</tool>`` in the built-in tokenizer: matched in the
  decode loop against each slot's last tokens, ``decode.ends_sequence``), so a turn ends at
  its call inside the decode loop, not at the next chunk's end.  The model may spell the
  tag with other tokens; the host still finds those calls after each chunk."""
  if not rollout.env:
    return ()
  ids = tuple(int(i) for i in tokenizer.encode(parsers.tool_parser(rollout.tool_parser).close))
  return (ids,) if ids else ()


# Backends whose episodes batch turns of different episodes on their slots; others (the
# reference sampler, jetstream's orchestrator) play rounds, one generate call a turn.
CONTINUOUS = {EngineBackend: episode_engine.engine_episodes}


def run_episodes(backend, params, prompts: Sequence[Sequence[int]],
                 rows: Sequence[Mapping[str, Any]], n: int, *, env: EnvSetup, tokenizer,
                 width: int, rng: jax.Array | None = None,
                 request_ids: Sequence[int] | None = None, pad_id: int = 0,
                 continuous: bool = True) -> Episodes:
  """``n`` episodes per prompt (see module doc); ``rows[i]`` is prompt i's data row.
  ``continuous=False`` plays rounds on every backend (the engine's turns then wait for
  their round)."""
  num = len(prompts) * n
  ids = (np.arange(num, dtype=np.int64) if request_ids is None
         else np.asarray(request_ids, np.int64).reshape(-1))
  rng = jax.random.key(backend.config.seed) if rng is None else rng
  guard = env_guard.EnvGuard(env.name, env.timeout_s, env.on_error)
  turn_ctx = turns.TurnContext(env.parser, env.max_turns, guard, tokenizer, width,
                              backend.config.ends_on_stop, backend.config.max_new_tokens)
  eps = [turns.Episode(list(map(int, prompts[r // n]))) for r in range(num)]
  for r, ep in enumerate(eps):
    ep.env = guard.make(env.factory, int(ids[r]))
    obs = None if ep.env is None else guard.reset(ep.env, rows[r // n], int(ids[r]))
    if obs is None:
      ep.live = False
    else:
      turns.observe(ep, obs, tokenizer, width)
  driver_fn = CONTINUOUS.get(type(backend)) if continuous else None
  if driver_fn is not None:  # episodes at different turns share the engine's slots
    driver_fn(backend, params, eps, ids, rng, turn_ctx)
    return assemble(eps, n, width, pad_id, guard.errors)
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
      k = int(out.lengths_R[q])
      turns.finish_turn(eps[r], out.tokens_RxN[q, :k].tolist(), out.logprobs_RxN[q, :k],
                        out.sampling_logprobs_RxN[q, :k], turn_ctx, int(ids[r]))
    turn += 1
  return assemble(eps, n, width, pad_id, guard.errors)


def assemble(eps: list[turns.Episode], n: int, width: int, pad_id: int, errors: int) -> Episodes:
  num = len(eps)
  tokens = np.full((num, width), pad_id, np.int32)
  mask = np.zeros((num, width), bool)
  gen = np.zeros((num, width), bool)
  lp = np.zeros((num, width), np.float32)
  slp = np.zeros((num, width), np.float32)
  placed = np.zeros((num, width), np.float32)
  for r, ep in enumerate(eps):
    k = len(ep.tokens)
    tokens[r, :k], mask[r, :k], gen[r, :k] = ep.tokens, True, ep.gen
    lp[r, :k], slp[r, :k] = ep.lps, ep.slps
    for i, reward in ep.turn_rewards:
      placed[r, i] += reward
  ro = driver.Rollout(prompt_index_R=np.arange(num, dtype=np.int32) // n, tokens_RxN=tokens,
                      mask_RxN=mask, logprobs_RxN=lp, sampling_logprobs_RxN=slp,
                      lengths_R=mask.sum(1).astype(np.int32),
                      stopped_R=np.array([ep.stopped for ep in eps], bool))
  return Episodes(ro, gen, np.array([ep.reward for ep in eps], np.float32), placed,
                  np.array([ep.turns for ep in eps], np.int32),
                  np.array([ep.truncated for ep in eps], bool), errors)
