"""The decode cache can grow (opt-in, rollout/engine/cache_growth.py): the tokens of the
full-size cache and its log-probs to float32 rounding (greedy and sampled, rows crossing
several capacities, requests started mid-way by continuous batching), the cache starts
small and grows, the default, fixed shapes and grow off keep one full-size cache, and
nothing compiles after `precompile`."""

import functools

import jax
import numpy as np
import pytest

from test_rollout_engine import CFG, peaky_model

from distflow_jax.rollout import Engine, EngineConfig, SamplingParams, generate, replica_mesh
from distflow_jax.rollout.engine import cache_growth
from distflow_jax.run import compile_cache

# S = 16 + 120 = 136: windows of 17; the first capacity holds bucket 16 + one chunk of 4.
NEW, STOP = 120, (0,)
PROMPTS = [[48, 54, 1, 4, 60, 4, 40, 10, 20, 22, 51, 37, 24], [25, 25, 13, 59, 2, 39, 40],
           [47, 25, 18, 38, 26, 14, 9, 10], [52, 17, 52, 6, 63],
           [48, 1, 19, 36, 25, 50, 52, 30, 20, 20, 15, 40, 33, 2, 10, 58]]


def _engine(temperature, grow, buckets=(8, 16), **kw):
  return Engine(CFG, EngineConfig(max_concurrent_decodes=4, prefill_buckets=buckets,
                                  max_new_tokens=NEW, sampling=SamplingParams(temperature),
                                  decode_steps=4, stop_ids=STOP, grow_cache=grow, **kw),
                replica_mesh(1, jax.devices()[:1]))


engine = functools.lru_cache(maxsize=None)(_engine)


@functools.lru_cache(maxsize=None)
def params():
  return engine(0.0, True).load_params(peaky_model())


def _capacities_seen(eng, monkeypatch):
  """Records the cache length of every state the driver decodes with (after `fit`)."""
  seen, fit = [], eng.fit

  def spy(state, end):
    state = fit(state, end)
    seen.append(state.cache.max_len)
    return state
  monkeypatch.setattr(eng, "fit", spy)
  return seen


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_growing_cache_gives_the_full_size_cache_results(temperature, monkeypatch):
  grow, full = engine(temperature, True), engine(temperature, False)
  assert full.capacities == (full.config.cache_len,) == (136,)
  assert grow.capacities == (34, 51, 68, 85, 102, 119, 136)  # ladder(136) from 20
  assert grow.start_state().cache.max_len == 34  # starts small
  seen = _capacities_seen(grow, monkeypatch)
  # 10 requests on 4 slots: 6 start mid-way, in slots freed by others.
  got = generate(grow, params(), PROMPTS, n=2, rng=jax.random.key(1))
  want = generate(full, params(), PROMPTS, n=2, rng=jax.random.key(1))
  for name in ("tokens_RxN", "mask_RxN", "lengths_R"):
    np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
  # Attention over a shorter cache sums its (exactly zero) masked tail in another order.
  for name in ("logprobs_RxN", "sampling_logprobs_RxN"):
    np.testing.assert_allclose(getattr(got, name), getattr(want, name), atol=3e-5, rtol=0,
                               err_msg=name)
  assert seen == sorted(seen) and seen[0] == 34, seen
  assert len(set(seen)) >= 4, seen  # the longest row crossed several capacities
  if temperature:  # long-tailed: early stops beside rows that run to the limit
    assert got.lengths_R.min() < 20 and got.lengths_R.max() == NEW, got.lengths_R
    assert seen[-1] == 136


def test_the_ladder_covers_the_cache_in_at_most_eight_steps():
  assert cache_growth.ladder(16) == (16,)
  assert cache_growth.ladder(64) == (16, 32, 48, 64)
  assert cache_growth.ladder(100) == (16, 32, 48, 64, 80, 96, 100)
  w = cache_growth.ladder(2048)
  assert w == tuple(range(256, 2049, 256)) and len(w) == 8


def test_fixed_shapes_and_grow_off_keep_one_full_size_cache():
  default = Engine(CFG, EngineConfig(max_concurrent_decodes=4, prefill_buckets=(8, 16),
                                     max_new_tokens=NEW), replica_mesh(1, jax.devices()[:1]))
  for eng in (default, _engine(0.0, True, fixed_shapes=True), _engine(0.0, False)):
    assert eng.capacities == (eng.config.cache_len,)
    assert eng.start_state().cache.max_len == eng.config.cache_len
  eng = engine(0.0, True)
  assert eng.init_decode_state().cache.max_len == 136  # JetStream's API: full size
  assert eng.fit(eng.start_state(), 40).cache.max_len == 51
  assert eng.fit(eng.start_state(), 1).cache.max_len == 34
  assert eng.fit(eng.start_state(), 10_000).cache.max_len == 136


@pytest.mark.timeout(120)
def test_growth_releases_the_old_cache_layer_by_layer():
  """A grow pads each layer and deletes the old one (jax declines to donate a buffer of
  another shape, so it would otherwise live until the caller drops it); the grown state
  is bitwise `grow_state`'s, and the fields it does not change are shared, alive."""
  eng = engine(0.0, True)
  state, *_ = eng.prefill_insert(params(), eng.start_state(), PROMPTS[:2], [0, 1], [0, 1],
                                 np.zeros((2, 2), np.uint32))
  want = jax.tree.map(np.asarray, cache_growth.grow_state(state, 68))
  old = jax.tree.leaves(state.cache)
  grown = eng.fit(state, 60)  # 34 -> 51 -> 68: two growths
  assert grown.cache.max_len == 68
  assert all(x.is_deleted() for x in old)  # the old cache: keys, values, positions
  assert not any(x.is_deleted() for x in jax.tree.leaves(grown))
  assert grown.tokens_B is state.tokens_B and not state.tokens_B.is_deleted()
  for got, w in zip(jax.tree.leaves(grown), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(got), w)
  assert grown.cache.k[0].sharding == eng._state_sh.cache.k[0]
  with pytest.raises(ValueError, match="cannot shrink"):
    eng._grow(grown, 34)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_nothing_compiles_after_precompile_at_any_capacity():
  # Fresh (its own compile counts), one prefill bucket to keep the ahead-compiles few.
  eng = _engine(1.0, True, buckets=(16,))
  assert eng.capacities == (34, 51, 68, 85, 102, 119, 136)
  p = eng.load_params(peaky_model())
  # The first call (precompile's signatures), with as many requests as the next ones: its
  # request keys are then drawn by a compiled fold_in.
  generate(eng, p, PROMPTS, n=2, max_new_tokens=2)
  assert eng.precompile() == len(eng.capacities) + 2  # + prompt rows 1, 4 (powers of 4)
  counter = compile_cache.CompileCounter()
  before = counter.snapshot()
  out = generate(eng, p, PROMPTS, n=2, rng=jax.random.key(1))
  out2 = generate(eng, p, PROMPTS[::-1], n=2, rng=jax.random.key(2))
  assert out.lengths_R.max() == NEW and out2.lengths_R.size == 10  # every capacity
  assert counter.since(before).compiles == 0
  counts = eng.compile_counts()
  assert counts["decode_steps"] == len(eng.capacities) <= 8, counts
