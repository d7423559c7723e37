"""Multi-turn episodes (rollout/episodes.py): the engine's greedy episodes equal the reference
backend's token for token with a scripted environment; observation tokens are in the
sequence mask and out of the loss mask; an environment's failure ends the episode or stops."""

import functools

import jax
import numpy as np
import pytest

from distflow_jax.envs import guard, parsers
from distflow_jax.rollout import SamplingParams, backend, episode_engine, episodes, reference
from distflow_jax.rollout.engine import Engine, extend
from distflow_jax.rollout.engine.config import EngineConfig, replica_mesh
from test_rollout_engine import CFG, peaky_model
import plugin_envs

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3], [2, 7], [11, 12, 13]]
MORE = PROMPTS + [[5, 8], [13, 21, 34], [1, 2, 4, 8, 16], [60, 50, 40]]
WIDTH = 40


class ToyTokenizer:
  """Ids 0..63: id % 8 == 0 reads '<tool>', id % 8 == 1 '</tool>', others 'tN '; text
  encodes character by character (ord % 62 + 2 avoids the tag ids' text)."""

  def decode(self, ids, skip_special_tokens=True):
    return "".join("<tool>" if i % 8 == 0 else "</tool>" if i % 8 == 1 else f"t{i} "
                   for i in ids)

  def encode(self, text, add_special_tokens=False):
    return [ord(c) % 62 + 2 for c in text]


class OneTokenClose(ToyTokenizer):
  """The toy tokenizer with '</tool>' as one token (id 17), as Qwen2.5's has </tool_call>."""

  def encode(self, text, add_special_tokens=False):
    return [17] if text == "</tool>" else super().encode(text)


@functools.lru_cache(maxsize=None)
def _pair(sp=SamplingParams(0.0), fixed_shapes=False, stop_ids=(), stop_sequences=()):
  conf = EngineConfig(max_concurrent_decodes=4, prefill_buckets=(8, 16, 32, 48), max_new_tokens=8,
                      sampling=sp, decode_steps=3, fixed_shapes=fixed_shapes, stop_ids=stop_ids,
                      stop_sequences=stop_sequences)
  mesh = replica_mesh(1, jax.devices()[:1])
  eng = backend.EngineBackend(CFG, conf, mesh)
  return eng, reference.ReferenceSampler(CFG, conf, mesh)


def _setup(name="scripted", on_error=guard.OnEnvError.END, max_turns=4, timeout_s=10.0):
  from distflow_jax.envs import base
  return episodes.EnvSetup(name, base.env_factory(name), parsers.tool_parser("tag"),
                           max_turns, timeout_s, on_error)


def _run(be, model, env, n=2, continuous=True, prompts=PROMPTS):
  rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(len(prompts))]
  return episodes.run_episodes(be, be.load_params(model), prompts, rows, n, env=env,
                               tokenizer=ToyTokenizer(), width=WIDTH,
                               rng=jax.random.key(0), request_ids=np.arange(8) * 3 + 1,
                               continuous=continuous)


def _assert_same(got, want):
  for a, b in ((got.rollout, want.rollout), (got, want)):
    for f in ("tokens_RxN", "mask_RxN", "lengths_R", "stopped_R", "loss_mask_RxN",
              "reward_R", "turn_rewards_RxN", "turns_R", "truncated_R"):
      if hasattr(a, f):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
  np.testing.assert_allclose(got.rollout.logprobs_RxN, want.rollout.logprobs_RxN, atol=3e-5)


def test_engine_episodes_equal_reference_token_for_token(monkeypatch):
  model = peaky_model()
  eng, ref = _pair()
  plugin_envs.Scripted.log.clear()
  turns_started = []  # the turn of each request of each prefill on the engine's slots
  keys = episode_engine._keys
  monkeypatch.setattr(episode_engine, "_keys", lambda rng, turn_of, ids, reqs: (
      turns_started.append([int(turn_of[r]) for r in reqs]), keys(rng, turn_of, ids, reqs))[1])
  got = _run(eng, model, _setup())
  log = list(plugin_envs.Scripted.log)
  want = _run(ref, model, _setup())
  _assert_same(got, want)
  _assert_same(_run(eng, model, _setup(), continuous=False), want)  # and in rounds
  # Eight different prompts on 4 slots: later turns are appended to their slot's cache
  # (extend.py: every call with a turn > 0 is an append, no prefill), and a new episode's
  # first turn started after others had gone on to later turns (episodes at different turns
  # decode side by side); still equal to the reference's rounds.
  turns_started.clear()
  appended = []
  call = extend.Extender.__call__
  monkeypatch.setattr(extend.Extender, "__call__", lambda self, *a: (
      appended.append(list(a[2])), call(self, *a))[1])
  prefilled = []
  pi = eng.engine.prefill_insert
  monkeypatch.setattr(eng.engine, "prefill_insert", lambda *a, **k: (
      prefilled.append(list(a[4])), pi(*a, **k))[1])
  more = _run(eng, model, _setup(), n=1, prompts=MORE)
  later = [i for i, t in enumerate(turns_started) if min(t) > 0]
  assert len(later) == len(appended) >= 1 and sum(map(len, prefilled)) == len(MORE)
  assert any(0 in t for t in turns_started[later[0]:]), turns_started
  _assert_same(more, _run(ref, model, _setup(), n=1, prompts=MORE))
  # Multi-turn happened: some episode played several turns, and observation tokens sit
  # between generated ones, in the sequence mask and out of the loss mask.
  assert got.turns_R.max() >= 2, got.turns_R
  tok = ToyTokenizer()
  obs = got.rollout.mask_RxN & ~got.loss_mask_RxN
  assert obs.any() and (got.loss_mask_RxN <= got.rollout.mask_RxN).all()
  assert (got.rollout.logprobs_RxN[obs] == 0).all()
  assert (got.rollout.logprobs_RxN[got.loss_mask_RxN] != 0).all()
  for r in range(8):
    toks = got.rollout.tokens_RxN[r][got.rollout.mask_RxN[r]].tolist()
    gen = got.loss_mask_RxN[r][got.rollout.mask_RxN[r]].tolist()
    # Every observation is the environment's text, tokenized: reset's first.
    assert toks[:len(tok.encode(" obs0 "))] == tok.encode(" obs0 ") and not gen[0]
  # Each turn was cut just after its first call: every step text but an episode's last
  # ends with '</tool>' and holds one call.
  p = parsers.tool_parser("tag")
  steps = [t for kind, t in log if kind == "step"]
  assert len(steps) == got.turns_R.sum()
  assert all(p.call_end(s) in (None, len(s)) for s in steps)
  calls = sum(p.call_end(s) == len(s) for s in steps)
  # The reward is the scripted environment's: 1 per turn that made a call, each on its
  # turn's last generated token.
  assert calls >= 2 and got.reward_R.sum() == calls
  np.testing.assert_array_equal(got.turn_rewards_RxN.sum(1), got.reward_R)
  assert (got.loss_mask_RxN[got.turn_rewards_RxN != 0]).all()
  assert ((got.turn_rewards_RxN != 0).sum(1) > 1).any()  # several turns rewarded


@pytest.mark.parametrize("sp,fixed", [(SamplingParams(0.0), True),
                                      (SamplingParams(0.8, top_p=0.9, top_k=20), False)])
def test_sampled_and_fixed_shape_episodes_equal_reference(sp, fixed):
  """Turn t of episode r draws with fold_in(rng, t) and r's request id on every backend, so
  sampled episodes match too; fixed shapes (trainer.deterministic: episode r in slot
  id % slots) play the same episodes."""
  model = peaky_model(1, sharpness=1.0 if sp.temperature else 5.0)
  eng, ref = _pair(sp, fixed)
  got = _run(eng, model, _setup(), n=1, prompts=MORE)
  _assert_same(got, _run(ref, model, _setup(), n=1, prompts=MORE))
  assert got.turns_R.max() >= 2


def test_a_one_token_closing_tag_ends_turns_in_the_decode_loop():
  import ml_collections
  from distflow_jax.models.tokenizer import Tokenizer
  rollout = ml_collections.ConfigDict(dict(env="scripted", tool_parser="tag"))
  assert episodes.call_stops(rollout, OneTokenClose()) == ((17,),)
  assert EngineConfig(stop_sequences=((17,),)).stop_ids == (17,)  # one token: a stop id
  builtin = Tokenizer.builtin()
  (close,) = episodes.call_stops(rollout, builtin)  # several tokens: a stop sequence
  assert len(close) > 1 and builtin.decode(list(close)) == "</tool>"
  rollout.env = ""
  assert episodes.call_stops(rollout, OneTokenClose()) == ()
  # With it among the stop ids the engine ends a turn on the tag itself; the episodes are
  # still the reference's, and a turn ended on it (an observation or the end follows).
  model = peaky_model()
  eng, ref = _pair(stop_ids=(17,))
  got = _run(eng, model, _setup(), n=1, prompts=MORE)
  _assert_same(got, _run(ref, model, _setup(), n=1, prompts=MORE))
  ro, gen = got.rollout, got.loss_mask_RxN
  at = [(r, i) for r in range(8) for i in np.flatnonzero(gen[r] & (ro.tokens_RxN[r] == 17))]
  assert at and all(i + 1 == WIDTH or not gen[r, i + 1] for r, i in at), at


def test_max_turns_bounds_the_episodes():
  model = peaky_model()
  eng, _ = _pair()
  got = _run(eng, model, _setup(max_turns=1))
  assert (got.turns_R == 1).all()
  obs = got.rollout.mask_RxN & ~got.loss_mask_RxN
  # only reset's observation: nothing after the first turn
  assert (obs.sum(1) == len(ToyTokenizer().encode(" obs0 "))).all()


@pytest.mark.parametrize("name", ["raises", "not_text", "nan_reward", "hangs"])
def test_a_failing_environment_ends_its_episodes_and_counts_them(name):
  model = peaky_model()
  eng, _ = _pair()
  got = _run(eng, model, _setup(name, timeout_s=0.5))
  assert got.errors == 8 and (got.turns_R == 1).all()
  with pytest.raises(guard.EnvFailure, match=f"environment {name!r} .* sample id 1"):
    _run(eng, model, _setup(name, on_error=guard.OnEnvError.STOP, timeout_s=0.5))


def _decoded(monkeypatch, eng):
  """Counts the tokens the engine's decode loop produces (valid ones, read or not)."""
  count = [0]
  steps = eng.engine.generate_steps

  def counted(*a):
    state, out = steps(*a)
    count[0] += int(np.asarray(out.valid_BxK).sum())
    return state, out
  monkeypatch.setattr(eng.engine, "generate_steps", counted)
  return count


def test_a_closing_tag_of_several_tokens_ends_turns_in_the_decode_loop(monkeypatch):
  """A stop sequence of two tokens (a closing tag that is not one token) ends a turn in the
  decode loop at its last token: the episodes equal the reference's (which stops there
  too), every turn that holds the sequence ends on it, and the engine decodes fewer tokens
  than without it (none after the tag in vain)."""
  model = peaky_model()
  eng, ref = _pair()
  plain = _run(eng, model, _setup(), n=1, prompts=MORE)
  ro, gen = plain.rollout, plain.loss_mask_RxN
  # each (token, '</tool>') pair the model writes ends a call: the tags of two tokens here
  pairs = [(int(ro.tokens_RxN[r, i - 1]), int(ro.tokens_RxN[r, i]))
           for r in range(8) for i in range(1, WIDTH)
           if gen[r, i - 1] and gen[r, i] and ro.tokens_RxN[r, i] % 8 == 1]
  assert pairs, "the model wrote no closing tag after a generated token"
  seqs = tuple(sorted(set(pairs)))
  eng2, ref2 = _pair(stop_sequences=seqs)
  decoded = _decoded(monkeypatch, eng2)
  got = _run(eng2, model, _setup(), n=1, prompts=MORE)
  _assert_same(got, _run(ref2, model, _setup(), n=1, prompts=MORE))
  plain_decoded = _decoded(monkeypatch, eng)
  _run(eng, model, _setup(), n=1, prompts=MORE)
  assert decoded[0] < plain_decoded[0], (decoded, plain_decoded)
  ro, gen = got.rollout, got.loss_mask_RxN
  at = [(r, i) for r in range(8) for i in range(1, WIDTH)
        if gen[r, i - 1] and gen[r, i] and (ro.tokens_RxN[r, i - 1], ro.tokens_RxN[r, i]) in seqs]
  assert at and all(i + 1 == WIDTH or not gen[r, i + 1] for r, i in at), at


def test_a_stop_sequence_ends_single_turn_requests_like_the_reference():
  """Without episodes too: a request ends at the first occurrence of a stop sequence in its
  generated tokens (stopped), on the engine as on the reference; the decode program holds
  no conditional (the match is a mask)."""
  from distflow_jax.rollout import driver
  model = peaky_model()
  eng, ref = _pair()
  params = eng.load_params(model)
  plain = driver.generate(eng.engine, params, MORE, 1, rng=jax.random.key(1))
  toks = [plain.tokens_RxN[r, :plain.lengths_R[r]].tolist() for r in range(8)]
  pairs = [tuple(t[i:i + 2]) for t in toks for i in range(1, len(t) - 2)]  # not at the end
  seq = max(set(pairs), key=pairs.count)
  eng2, ref2 = _pair(stop_sequences=(seq,))
  got = driver.generate(eng2.engine, params, MORE, 1, rng=jax.random.key(1))
  want = ref2.generate(ref2.load_params(model), MORE, 1, rng=jax.random.key(1))
  for f in ("tokens_RxN", "mask_RxN", "lengths_R", "stopped_R"):
    np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)
  for r, t in enumerate(toks):
    first = next((i + 2 for i in range(len(t) - 1) if tuple(t[i:i + 2]) == seq), None)
    if first is None:
      assert got.lengths_R[r] == plain.lengths_R[r]
    else:
      assert got.lengths_R[r] == first and got.stopped_R[r], (r, t, seq)
  assert (got.lengths_R < plain.lengths_R).any()
  state = eng2.engine.start_state()
  text = eng2.engine._chunk.lower(params, state).as_text()
  assert "stablehlo.case" not in text and "stablehlo.if" not in text


def test_a_turn_cut_at_its_cap_truncates_the_episode():
  """An episode is truncated when a limit cuts it: its response full (the episode's width)
  or a turn at the per-turn cap (rollout.max_new_tokens) with no tool call and no stop,
  even when the environment then says done (it took the cut text for an answer); a turn
  that stops early or answers short of the cap is not.  An environment whose step takes
  ``truncated`` is told which turns were cut; one that takes only the text is unchanged."""
  from distflow_jax.rollout import turns
  g = guard.EnvGuard("scripted", 10.0, guard.OnEnvError.END)
  stop = EngineConfig(stop_ids=(63,)).ends_on_stop

  def play(toks, width=40, cap=8, done_after=3, env=plugin_envs.Scripted):
    plugin_envs.Scripted.turns = done_after
    try:
      ep = turns.Episode([5, 6])
      ep.env = g.make(env, 0)
      tc = turns.TurnContext(parsers.tool_parser("tag"), 4, g, ToyTokenizer(), width, stop,
                             cap)
      turns.finish_turn(ep, toks, [0.0] * len(toks), [0.0] * len(toks), tc, 0)
      return ep
    finally:
      plugin_envs.Scripted.turns = 3
  capped = play([2, 3, 4, 5, 6, 7, 10, 11])  # 8 tokens, no call, no stop
  assert not capped.live and capped.truncated
  assert not play([2, 3, 63]).truncated  # stopped
  assert not play([2, 3, 4]).truncated  # ended short of its cap (a turn that answered)
  # the env is done on it: still a cut answer (issue 52: it used to count as finished)
  assert play([2, 3, 4, 5, 6, 7, 10, 11], done_after=1).truncated
  assert not play([2, 3, 4], done_after=1).truncated  # an answer short of the cap
  assert play([2, 3, 4, 5], width=4).truncated  # the response full
  called = play([8, 3, 9, 4])  # '<tool>' t3 '</tool>': a call, the episode goes on
  assert called.live and not called.truncated
  plugin_envs.Scripted.log.clear()
  told = play([2, 3, 4, 5, 6, 7, 10, 11], done_after=1, env=plugin_envs.ScoresCut)
  assert told.truncated and told.reward == -1.0
  assert ("truncated", True) in plugin_envs.Scripted.log
  plugin_envs.Scripted.log.clear()
  answered = play([2, 3, 4], done_after=1, env=plugin_envs.ScoresCut)
  assert not answered.truncated and answered.reward == 0.0
  assert ("truncated", False) in plugin_envs.Scripted.log
  assert guard.takes_truncated(plugin_envs.ScoresCut)
  assert not guard.takes_truncated(plugin_envs.Scripted)


def test_episodes_wider_than_the_engine_cache_are_refused():
  """An episode's positions are its slot's cache slots: a width the cache cannot hold after
  the prompts is refused before anything decodes (EngineConfig.episode_tokens sizes it)."""
  model = peaky_model()
  eng, _ = _pair()  # cache: the largest prompt bucket 48 + 8 new tokens
  rows = [{"prompt": "p", "answer": "0"}] * len(PROMPTS)
  with pytest.raises(ValueError, match="need a cache of 1[0-9][0-9] tokens, but the engine's "
                                       "holds 56"):
    episodes.run_episodes(eng, eng.load_params(model), PROMPTS, rows, 1, env=_setup(),
                          tokenizer=ToyTokenizer(), width=100, rng=jax.random.key(0))
