"""Engine: KV-cache decoding against repeated full forward passes, logprobs against a
teacher-forced pass, the JetStream-style API, stop tokens, a sharded replica, bounded compiles."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distflow_jax.models import ModelConfig, Transformer, forward
from distflow_jax.rollout import Engine, EngineConfig, SamplingParams, generate, replica_mesh

CFG = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True,
                  tie_embeddings=False)


def peaky_model(seed=0, sharpness=5.0):
  """Random weights scaled up, so that greedy outputs vary instead of repeating a token."""
  model = Transformer(CFG, rngs=nnx.Rngs(seed))
  state = jax.tree.map(lambda x: x * 10.0 if x.ndim == 2 else x, nnx.state(model, nnx.Param))
  nnx.update(model, state)
  model.lm_head.kernel[...] = model.lm_head.kernel[...] * sharpness
  return model


@functools.lru_cache(maxsize=None)
def engine(sp=SamplingParams(0.0), slots=4, new=8, mesh=None, decode_steps=3, **kw):
  """Engines are shared between tests (and test modules) so that their compiles are too."""
  mesh = mesh or replica_mesh(1, jax.devices()[:1])
  return Engine(CFG, EngineConfig(max_concurrent_decodes=slots, prefill_buckets=(8, 16),
                                  max_new_tokens=new, sampling=sp, decode_steps=decode_steps,
                                  **kw), mesh)


_T = 32  # fixed length of the reference passes (causal: tokens after t do not change logits at t)


@functools.partial(jax.jit, static_argnames="temperature")
def _full_logprobs(params, tokens_1xT, temperature=1.0):
  logits, _ = forward(GRAPHDEF, params, tokens_1xT, jnp.arange(_T)[None])
  return jax.nn.log_softmax(logits[0].astype(jnp.float32) / temperature, -1)


GRAPHDEF = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))[0]


def _padded(seq):
  buf = np.zeros((1, _T), np.int32)
  buf[0, :len(seq)] = seq
  return buf


def full_forward_greedy(model, prompt, steps):
  """Argmax of a full forward pass over the whole sequence, once per new token."""
  params = nnx.state(model)
  seq = list(prompt)
  for _ in range(steps):
    seq.append(int(np.argmax(_full_logprobs(params, _padded(seq))[len(seq) - 1])))
  return seq[len(prompt):]


def teacher_forced_logprobs(model, prompt, response, temperature=1.0):
  n = len(prompt)
  logp = np.asarray(_full_logprobs(nnx.state(model), _padded(list(prompt) + list(response)),
                                   temperature=temperature))
  return logp[np.arange(n - 1, n - 1 + len(response)), response]


SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=20)
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9], [2, 7], [1] * 16, [11, 12, 13]]


@pytest.mark.timeout(300)
def test_greedy_with_cache_equals_argmax_of_full_forwards():
  model = peaky_model()
  eng = engine()
  out = generate(eng, eng.load_params(model), PROMPTS)
  for r, prompt in enumerate(PROMPTS):
    want = full_forward_greedy(model, prompt, 8)
    assert out.tokens_RxN[r].tolist() == want, (r, out.tokens_RxN[r], want)
  assert out.mask_RxN.all() and (out.lengths_R == 8).all()
  assert all(len(set(t)) > 3 for t in out.tokens_RxN.tolist())  # not a repeated token


@pytest.mark.timeout(300)
def test_sampled_logprobs_equal_teacher_forced_recomputation():
  """At the sampling temperature (0.8, what the training passes read), untruncated; a
  temperature-1 recomputation is not what the engine records."""
  model = peaky_model(1, sharpness=1.0)  # softer, so sampling varies
  eng = engine(SAMPLED)
  out = generate(eng, eng.load_params(model), PROMPTS[:3], n=2, rng=jax.random.key(5))
  for r in range(6):
    prompt = PROMPTS[out.prompt_index_R[r]]
    k = out.lengths_R[r]
    toks = out.tokens_RxN[r, :k].tolist()
    want = teacher_forced_logprobs(model, prompt, toks, temperature=SAMPLED.temperature)
    np.testing.assert_allclose(out.logprobs_RxN[r, :k], want, atol=1e-5, rtol=0)
    t1 = teacher_forced_logprobs(model, prompt, toks)
    assert np.abs(out.logprobs_RxN[r, :k] - t1).max() > 1e-3
    assert (out.logprobs_RxN[r, k:] == 0).all()
  assert (out.sampling_logprobs_RxN[out.mask_RxN] != out.logprobs_RxN[out.mask_RxN]).any()


@pytest.mark.timeout(300)
def test_jetstream_api_prefill_insert_generate():
  model = peaky_model()
  eng = engine()
  params = eng.load_params(model)
  state = eng.init_decode_state()
  got = {}
  for slot, prompt in ((2, PROMPTS[0]), (0, PROMPTS[1])):
    padded = np.zeros(eng.bucket_for(len(prompt)), np.int32)
    padded[:len(prompt)] = prompt
    prefix, first = eng.prefill(params=params, padded_tokens=padded, true_length=len(prompt))
    got[slot] = [int(first.get_result_at_slot(0).tokens[0, 0])]
    state = eng.insert(prefix, state, slot)
  for _ in range(7):
    state, result = eng.generate(params, state)
    result = result.convert_to_numpy()
    for slot in got:
      data = result.get_result_at_slot(slot)
      if data.valid[0, 0]:
        got[slot].append(int(data.tokens[0, 0]))
        assert data.lengths[0] == len(got[slot])
    assert not result.get_result_at_slot(1).valid.any()  # never filled
  assert got[2] == full_forward_greedy(model, PROMPTS[0], 8)
  assert got[0] == full_forward_greedy(model, PROMPTS[1], 8)
  assert eng.max_concurrent_decodes == 4 and eng.max_prefill_length == 16
  assert eng.samples_per_slot == 1


@pytest.mark.timeout(300)
def test_stops_on_stop_token_and_keeps_it():
  model = peaky_model()
  free = full_forward_greedy(model, PROMPTS[1], 8)
  stop = free[3]
  first = free.index(stop)
  eng = engine(stop_ids=(stop,))
  out = generate(eng, eng.load_params(model), [PROMPTS[1]], pad_id=63)
  assert out.lengths_R[0] == first + 1 and out.stopped_R[0]
  assert out.tokens_RxN[0, :first + 1].tolist() == free[:first + 1]
  assert (out.tokens_RxN[0, first + 1:] == 63).all() and not out.mask_RxN[0, first + 1:].any()


@pytest.mark.timeout(300)
def test_sharded_replica_matches_single_device():
  model = peaky_model()
  single = generate(engine(), engine().load_params(model), PROMPTS)
  eng = engine(mesh=replica_mesh(2, jax.devices()[:4]))  # data 2 x tensor 2
  params = eng.load_params(model)
  q = params["layers"][0]["attn"]["q_proj"]["kernel"][...]
  assert q.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
  out = generate(eng, params, PROMPTS)
  np.testing.assert_array_equal(out.tokens_RxN, single.tokens_RxN)
  # Tensor-parallel partial sums are added in another order: float32 rounding, which
  # grows over 8 decode steps (1.2e-5 seen on an AVX-512 CPU).
  np.testing.assert_allclose(out.logprobs_RxN, single.logprobs_RxN, atol=5e-5)


@pytest.mark.timeout(300)
def test_compiles_are_bounded_by_buckets():
  model = peaky_model()
  eng = engine(slots=4, new=4, decode_steps=2)  # a fresh engine: counts start at 0
  params = eng.load_params(model)
  rs = np.random.RandomState(0)
  for count in (1, 3, 6):
    prompts = [rs.randint(1, 64, size=rs.randint(1, 17)).tolist() for _ in range(count)]
    generate(eng, params, prompts, n=rs.randint(1, 3))
  counts = eng.compile_counts()
  assert counts["decode_steps"] == 1 and counts["init"] == 1
  # 2 length buckets x prompt counts {1, 2, 4}
  assert 1 <= counts["prefill_insert"] <= 6, counts
  before = eng.compile_counts()
  generate(eng, params, [[1, 2, 3], [4] * 12, [5] * 9], n=2)
  assert eng.compile_counts()["decode_steps"] == before["decode_steps"]


def test_validation_names_the_problem():
  eng = engine()
  with pytest.raises(ValueError, match="largest prefill bucket"):
    eng.bucket_for(17)
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(eng, None, [[1]], max_new_tokens=9)
  with pytest.raises(ValueError, match="max_concurrent_decodes"):
    engine(slots=3, mesh=replica_mesh(1, jax.devices()[:2]))
  with pytest.raises(ValueError, match="decode_steps"):
    EngineConfig(decode_steps=0)


def test_engine_config_from_run_config():
  from distflow_jax.config import defaults
  rollout = defaults.base().rollout
  rollout.temperature, rollout.top_k = 0.5, 7
  ec = EngineConfig.from_config(rollout, stop_ids=[2, 3], seed=4, max_new_tokens=9)
  assert ec.max_concurrent_decodes == rollout.max_concurrent_decodes
  assert ec.prefill_buckets == tuple(rollout.prefill_buckets) and ec.max_new_tokens == 9
  assert ec.sampling == SamplingParams(temperature=0.5, top_p=1.0, top_k=7)
  assert ec.stop_ids == (2, 3) and ec.seed == 4
  assert ec.cache_len == max(rollout.prefill_buckets) + 9
