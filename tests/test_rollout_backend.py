"""Rollout backends: the engine against the reference sampler (full forward per token, no
cache) as an oracle, greedy and sampled; the backend table and its config key."""

import dataclasses

import jax
import numpy as np
import pytest

from distflow_jax.config import loading
from distflow_jax.rollout import SamplingParams, backend, engine as engine_lib, reference
from distflow_jax.rollout.engine.config import EngineConfig
from test_rollout_engine import CFG, SAMPLED, engine, full_forward_greedy, peaky_model

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9], [2, 7], [1] * 16, [11, 12, 13]]


def _pair(sp, stop_ids=()):
  """The engine backend (sharing test_rollout_engine's compiled engine) and a reference
  sampler with the same settings: fewer slots than requests, so slots are refilled."""
  eng = backend.EngineBackend.wrap(engine(sp, stop_ids=stop_ids) if stop_ids else engine(sp))
  ref = reference.ReferenceSampler(CFG, eng.config, eng.engine.mesh)
  return eng, ref


def _assert_same(a, b, exact_tokens=True):
  np.testing.assert_array_equal(a.prompt_index_R, b.prompt_index_R)
  np.testing.assert_array_equal(a.lengths_R, b.lengths_R)
  np.testing.assert_array_equal(a.mask_RxN, b.mask_RxN)
  np.testing.assert_array_equal(a.stopped_R, b.stopped_R)
  if exact_tokens:
    np.testing.assert_array_equal(a.tokens_RxN, b.tokens_RxN)
  # The reference runs the stacked layers under lax.scan over the whole sequence, the engine
  # layer by layer through its KV cache: float32 sums in another order (seen: 1.1e-5).
  np.testing.assert_allclose(a.logprobs_RxN, b.logprobs_RxN, atol=3e-5, rtol=0)
  np.testing.assert_allclose(a.sampling_logprobs_RxN, b.sampling_logprobs_RxN, atol=3e-5,
                             rtol=0)


@pytest.mark.timeout(300)
def test_greedy_engine_equals_reference_sampler():
  model = peaky_model()
  eng, ref = _pair(SamplingParams(0.0))
  out = eng.generate(eng.load_params(model), PROMPTS, n=2)
  want = ref.generate(ref.load_params(model), PROMPTS, n=2)
  _assert_same(out, want)
  assert (out.lengths_R == 8).all()
  for r in range(len(PROMPTS) * 2):  # and the oracle is what test_rollout_engine checks
    assert want.tokens_RxN[r].tolist() == full_forward_greedy(model, PROMPTS[r // 2], 8)


@pytest.mark.timeout(300)
def test_sampled_engine_equals_reference_under_the_same_request_ids():
  """Same keys (fold_in(rng, request id), then the token index): the same tokens, whatever
  slot or batch a request runs in; stop ids end both at the same token."""
  model = peaky_model(1, sharpness=1.0)  # soft, so sampling varies
  eng, ref = _pair(SAMPLED)
  params = eng.load_params(model)
  ids = [7, 3, 100, 42, 5, 9, 1000, 11, 13, 2]
  rng = jax.random.key(5)
  out = eng.generate(params, PROMPTS, n=2, rng=rng, request_ids=ids)
  ref_params = ref.load_params(model)
  want = ref.generate(ref_params, PROMPTS, n=2, rng=rng, request_ids=ids)
  _assert_same(out, want)
  assert len({tuple(t) for t in out.tokens_RxN.tolist()}) == len(ids)  # samples differ
  # Request ids, not positions, pick the stream: a reordered call samples the same rows.
  rev = ref.generate(ref_params, PROMPTS[::-1], n=2, rng=rng,
                     request_ids=np.asarray(ids).reshape(5, 2)[::-1].reshape(-1))
  np.testing.assert_array_equal(rev.tokens_RxN.reshape(5, 2, -1)[::-1].reshape(10, -1),
                                want.tokens_RxN)
  # A stop id that the samples do emit: rows end early, on it, in both backends.
  stop = int(out.tokens_RxN[0, 2])
  eng_s, ref_s = _pair(SAMPLED, stop_ids=(stop,))
  out = eng_s.generate(params, PROMPTS, n=2, rng=rng, request_ids=ids, max_new_tokens=6)
  want = ref_s.generate(ref_params, PROMPTS, n=2, rng=rng, request_ids=ids, max_new_tokens=6)
  _assert_same(out, want)
  assert out.stopped_R.any() and (out.lengths_R <= 6).all()


@pytest.mark.timeout(300)
def test_fixed_shapes_engine_equals_reference_sampler():
  """trainer.deterministic's engine (slot = request id mod slots, padded prefill, whole-cache
  attention) samples what the reference does too."""
  model = peaky_model(2, sharpness=1.0)
  cfg = dataclasses.replace(engine(SAMPLED).config, fixed_shapes=True)
  mesh = engine_lib.replica_mesh(1, jax.devices()[:1])
  eng, ref = backend.EngineBackend(CFG, cfg, mesh), reference.ReferenceSampler(CFG, cfg, mesh)
  ids, rng = [5, 0, 9, 2, 6, 4], jax.random.key(3)
  prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
  out = eng.generate(eng.load_params(model), prompts, n=2, rng=rng, request_ids=ids)
  _assert_same(out, ref.generate(ref.load_params(model), prompts, n=2, rng=rng,
                                 request_ids=ids))


def test_backends_satisfy_the_protocol_and_share_weight_sync():
  eng, ref = _pair(SamplingParams(0.0))
  assert isinstance(eng, backend.RolloutBackend) and isinstance(ref, backend.RolloutBackend)
  model = peaky_model()
  a, b = eng.update_weights(eng.load_params(model)), ref.update_weights(ref.load_params(model))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    ref.generate(b, [[1], []])
  with pytest.raises(ValueError, match="larger than|longer than the largest prefill bucket"):
    ref.generate(b, [[1] * 17])


def test_backend_table_and_config_key():
  assert set(backend.BACKENDS) == {"engine", "reference", "jetstream"}
  cfg = loading.load("grpo:tiny")
  assert cfg.rollout.backend == "engine"
  conf = EngineConfig(max_concurrent_decodes=2, prefill_buckets=(8,), max_new_tokens=4)
  mesh = engine_lib.replica_mesh(1, jax.devices()[:1])
  assert isinstance(backend.make_backend("reference", CFG, conf, mesh), reference.ReferenceSampler)
  made = backend.make_backend("engine", CFG, conf, mesh)
  assert isinstance(made, backend.EngineBackend)
  with pytest.raises(loading.ConfigError, match=r"^rollout.backend='vllm' is unknown; "
                     r"valid: engine, reference, jetstream$"):
    backend.make_backend("vllm", CFG, conf, mesh)


def test_jetstream_backend_refused_in_one_line_without_the_package(monkeypatch):
  """`jetstream` is in the table everywhere; without JetStream it is refused in one line
  naming the package (the adapter's import hint), before anything is built."""
  import sys
  monkeypatch.setitem(sys.modules, "jetstream", None)  # as if not installed
  monkeypatch.delitem(sys.modules, "distflow_jax.rollout.jetstream_backend", raising=False)
  conf = EngineConfig(max_concurrent_decodes=2, prefill_buckets=(8,), max_new_tokens=4)
  with pytest.raises(loading.ConfigError, match=r"^rollout.backend=jetstream needs the "
                     r"google-jetstream package: pip install 'distflow-jax\[jetstream\]'$"):
    backend.make_backend("jetstream", CFG, conf)


def test_the_replicas_build_the_configured_backend_once():
  """A run's rollout replicas (state/replicas.py) follow rollout.backend, built once per
  settings; the context builds them as its service."""
  import dataclasses
  import types

  from distflow_jax.config import declare
  from distflow_jax.config.run_sections import Config
  from distflow_jax.state.replicas import RolloutReplicas
  cfg = declare.view(Config, loading.load("grpo:tiny"))
  reps = RolloutReplicas(cfg, None, None, CFG, types.SimpleNamespace(eos_ids=(2,)),
                         jax.devices()[:1])  # no plan: the actor's devices
  rollout = cfg.rollout
  made = reps.backend(rollout)
  assert isinstance(made, backend.EngineBackend) and reps.backend(rollout) is made
  assert made.config.stop_ids == (2,)
  assert reps.backend(rollout, greedy=True).config.sampling.greedy
  assert reps.built() == [(0,)] * 2
  ref = reps.backend(dataclasses.replace(rollout, backend="reference"))
  assert isinstance(ref, reference.ReferenceSampler) and ref.config == made.config
  with pytest.raises(loading.ConfigError, match="valid: engine, reference, jetstream$"):
    reps.backend(dataclasses.replace(rollout, backend="sglang"))
