"""Driver: continuous batching with more requests than slots, schedule-independent results,
groups of n samples, per-call max_new_tokens."""

import dataclasses

import jax
import numpy as np
import pytest

from distflow_jax.rollout import Engine, generate, replica_mesh
from test_rollout_engine import CFG, SAMPLED, engine, full_forward_greedy, peaky_model

PROMPTS = [[5, 9, 1], [2] * 11, [7, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9], [60, 61], [33] * 16,
           [4, 8, 15, 16, 23, 42], [10], [19, 29, 39, 49]]


class CountingEngine:
  """Counts the engine's entry-point calls (a view on the real engine, not a stand-in)."""

  def __init__(self, eng):
    self._eng, self.calls = eng, {"prefill_insert": 0, "generate_steps": 0}

  def __getattr__(self, name):
    attr = getattr(self._eng, name)
    if name in self.calls:
      def counted(*a, **k):
        self.calls[name] += 1
        return attr(*a, **k)
      return counted
    return attr


@pytest.mark.timeout(300)
def test_more_requests_than_slots_each_completes_once_as_if_alone():
  model = peaky_model()
  stop = full_forward_greedy(model, PROMPTS[0], 8)[2]  # a token greedy decoding does emit
  eng = engine(slots=3, new=8, stop_ids=(stop,))
  params = eng.load_params(model)
  counted = CountingEngine(eng)
  out = generate(counted, params, PROMPTS)
  assert counted.calls["prefill_insert"] >= 3  # freed slots were refilled
  assert out.tokens_RxN.shape == (len(PROMPTS), 8)
  np.testing.assert_array_equal(out.prompt_index_R, np.arange(len(PROMPTS)))
  assert len(set(out.lengths_R.tolist())) > 1  # some stopped early: refills mid-flight
  for r, prompt in enumerate(PROMPTS):
    alone = generate(eng, params, [prompt])
    k = alone.lengths_R[0]
    assert out.lengths_R[r] == k
    np.testing.assert_array_equal(out.tokens_RxN[r], alone.tokens_RxN[0])
    np.testing.assert_allclose(out.logprobs_RxN[r], alone.logprobs_RxN[0], atol=1e-5)
    free = full_forward_greedy(model, prompt, 8)
    want = free[:free.index(stop) + 1] if stop in free else free
    assert out.tokens_RxN[r, :k].tolist() == want
    assert out.stopped_R[r] == (stop in free)


@pytest.mark.timeout(300)
def test_sampling_does_not_depend_on_the_schedule():
  model = peaky_model(2, sharpness=1.0)
  few = engine(SAMPLED, slots=2)
  many = engine(SAMPLED)
  prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]  # one prefill bucket: fewer compiles
  a = generate(few, few.load_params(model), prompts, n=2, rng=jax.random.key(11))
  b = generate(many, many.load_params(model), prompts, n=2, rng=jax.random.key(11))
  np.testing.assert_array_equal(a.tokens_RxN, b.tokens_RxN)
  np.testing.assert_allclose(a.logprobs_RxN, b.logprobs_RxN, atol=1e-5)
  np.testing.assert_array_equal(a.prompt_index_R, np.repeat(np.arange(3), 2))
  # the two samples of a prompt are distinct draws
  assert (a.tokens_RxN[0::2] != a.tokens_RxN[1::2]).any()
  c = generate(few, few.load_params(model), prompts, n=2, rng=jax.random.key(12))
  assert (c.tokens_RxN != a.tokens_RxN).any()
  # a request's stream follows its id: the last prompt's samples alone, under their ids
  d = generate(many, many.load_params(model), prompts[2:], n=2, rng=jax.random.key(11),
               request_ids=[4, 5])
  np.testing.assert_array_equal(d.tokens_RxN, a.tokens_RxN[4:])
  with pytest.raises(ValueError, match="request_ids"):
    generate(many, None, prompts, n=2, request_ids=[1, 2])


@pytest.mark.timeout(300)
def test_groups_share_prefill_and_respect_max_new_tokens():
  model = peaky_model()
  eng = engine()
  params = eng.load_params(model)
  counted = CountingEngine(eng)
  out = generate(counted, params, PROMPTS[:2], n=4, max_new_tokens=5)
  assert counted.calls["prefill_insert"] == 2  # 4 samples of a prompt start together
  assert out.tokens_RxN.shape == (8, 5) and (out.lengths_R == 5).all()
  for r in range(8):  # greedy: the 4 samples of a prompt agree
    assert out.tokens_RxN[r].tolist() == full_forward_greedy(model, PROMPTS[r // 4], 5)


@pytest.mark.timeout(300)
def test_fixed_shapes_make_each_request_independent_of_its_neighbours():
  """trainer.deterministic's engine: a request's tokens and log-probs are bitwise the same
  whichever other requests share the replica (slot and prefill row follow its id)."""
  model = peaky_model(2, sharpness=1.0)
  cfg = dataclasses.replace(engine(SAMPLED).config, fixed_shapes=True)
  eng = Engine(CFG, cfg, replica_mesh(1, jax.devices()[:1]))
  params = eng.load_params(model)
  prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]
  every = generate(eng, params, prompts, n=2, rng=jax.random.key(3))
  for i in range(3):
    alone = generate(eng, params, prompts[i:i + 1], n=2, rng=jax.random.key(3),
                     request_ids=[2 * i, 2 * i + 1])
    np.testing.assert_array_equal(alone.tokens_RxN, every.tokens_RxN[2 * i:2 * i + 2])
    np.testing.assert_array_equal(alone.logprobs_RxN, every.logprobs_RxN[2 * i:2 * i + 2])
