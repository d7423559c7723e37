"""The optional JetStream adapter: a real `engine_api.Engine` where JetStream imports."""

import importlib

import jax
import numpy as np
import pytest

from distflow_jax.rollout import jetstream_adapter
from distflow_jax.rollout import SamplingParams
from test_rollout_engine import PROMPTS, engine, full_forward_greedy, peaky_model


def _jetstream_importable():
  try:
    importlib.import_module("jetstream.engine.engine_api")
    return True
  except Exception:  # ImportError or its own import-time failures
    return False


HAVE_JETSTREAM = _jetstream_importable()


@pytest.mark.skipif(HAVE_JETSTREAM, reason="JetStream is installed; the import-error path "
                    "cannot be exercised")
def test_missing_jetstream_raises_a_clear_import_error():
  with pytest.raises(ImportError, match="distflow-jax\\[jetstream\\]"):
    jetstream_adapter.as_jetstream(engine())


def _greedy_through_api(js, params, prompt, slot=1, steps=8):
  """Prefill, insert and generate through the JetStream API, as its orchestrator does:
  the first token comes from prefill (newer API) or from the first generate (0.2.2)."""
  padded = np.zeros(8, np.int32)
  padded[:len(prompt)] = prompt
  out = js.prefill(params=params, padded_tokens=padded, true_length=len(prompt))
  got = []
  if isinstance(out, tuple):
    prefix, first = out
    got.append(int(first.get_result_at_slot(0).tokens[0, 0]))
  else:
    prefix = out
  state = js.insert(prefix, js.init_decode_state(), slot)
  while len(got) < steps:
    state, result = js.generate(params, state)
    data = result.convert_to_numpy().get_result_at_slot(slot)
    if not data.valid[0, 0]:
      break
    got.append(int(data.tokens[0, 0]))
  return got


@pytest.mark.skipif(not HAVE_JETSTREAM, reason="optional jetstream extra (google-jetstream) not "
                    "installed or not importable under this JAX")
@pytest.mark.timeout(300)
def test_adapter_is_a_jetstream_engine_and_decodes_greedily():
  from jetstream.engine import engine_api
  model = peaky_model()
  js = jetstream_adapter.as_jetstream(engine())
  assert isinstance(js, engine_api.Engine)
  params = js.load_params(model)
  assert _greedy_through_api(js, params, PROMPTS[0]) == full_forward_greedy(model, PROMPTS[0], 8)


def _fake_jetstream(monkeypatch, prefill_returns_tuple, main=False):
  """Just enough of `jetstream.engine` (engine_api, tokenizer_api) to run the adapter without
  the package, in either API generation (0.2.2: prefill -> prefix; newer: a tuple; `main`:
  also JetStream main's abstract members and `log_prob` column)."""
  import abc
  import dataclasses
  import sys
  import types
  from typing import Any, Tuple

  @dataclasses.dataclass
  class ResultTokens:
    data: Any
    tokens_idx: tuple
    valid_idx: tuple
    length_idx: tuple
    samples_per_slot: int

    if main:
      log_prob: Any = None

    def convert_to_numpy(self):
      return dataclasses.replace(self, data=np.asarray(self.data))

    def get_result_at_slot(self, slot):
      rows = self.data[slot:slot + 1]
      return types.SimpleNamespace(tokens=rows[:, slice(*self.tokens_idx)],
                                   valid=rows[:, slice(*self.valid_idx)],
                                   lengths=rows[:, slice(*self.length_idx)][:, 0])

  class Engine(abc.ABC):
    pass

  def prefill(self, *, params, padded_tokens, true_length) -> Any:
    del params, padded_tokens, true_length
  if prefill_returns_tuple:
    prefill.__annotations__["return"] = Tuple[Any, ResultTokens]
  Engine.prefill = prefill
  if main:
    abstract = ("bulk_insert", "prefill_multisampling", "use_chunked_prefill",
                "prefill_chunk_size")
    for name in abstract:
      setattr(Engine, name, abc.abstractmethod(lambda self: None))
    Engine.__abstractmethods__ = frozenset(abstract)

  class Tokenizer(abc.ABC):
    pass

  api = types.ModuleType("jetstream.engine.engine_api")
  api.Engine, api.ResultTokens = Engine, ResultTokens
  tok = types.ModuleType("jetstream.engine.tokenizer_api")
  tok.Tokenizer = Tokenizer
  pkg, eng = types.ModuleType("jetstream"), types.ModuleType("jetstream.engine")
  pkg.engine, eng.engine_api, eng.tokenizer_api = eng, api, tok
  for name, mod in (("jetstream", pkg), ("jetstream.engine", eng),
                    ("jetstream.engine.engine_api", api),
                    ("jetstream.engine.tokenizer_api", tok)):
    monkeypatch.setitem(sys.modules, name, mod)


@pytest.mark.parametrize("new_api", [False, True], ids=["jetstream-0.2.2", "newer"])
@pytest.mark.timeout(300)
def test_adapter_serves_both_api_generations(monkeypatch, new_api):
  """Against 0.2.2's API the first token (sampled at prefill) is replayed by generate, one
  step late per inserted slot; either way the stream is the greedy continuation."""
  _fake_jetstream(monkeypatch, new_api)
  model = peaky_model()
  eng = engine()
  js = jetstream_adapter.as_jetstream(eng, bos_id=5)
  assert jetstream_adapter.prefill_returns_first_token() == new_api
  params = js.load_params(model)
  for slot, prompt in ((1, PROMPTS[0]), (3, PROMPTS[2])):
    assert _greedy_through_api(js, params, prompt, slot) == full_forward_greedy(model, prompt, 8)
  tok = js.build_tokenizer(js.get_tokenizer())
  assert (tok.bos_id, tok.stop_tokens, tok.decode([4, 2])) == (5, set(eng.config.stop_ids), "4 2")


@pytest.mark.timeout(300)
def test_adapter_meets_jetstream_main(monkeypatch):
  """JetStream main's interface: its abstract members exist, prefill/insert take request_id,
  a truncated request's true_length is clamped, results carry log_prob, and a slot that ends
  at the engine's own length limit reports a length past any max_tokens (no filler token)."""
  _fake_jetstream(monkeypatch, True, main=True)
  model = peaky_model()
  eng = engine()
  js = jetstream_adapter.as_jetstream(eng)
  assert jetstream_adapter.api_generation() == "main"
  assert (js.use_chunked_prefill, js.prefill_chunk_size) == (False, eng.max_prefill_length)
  params = js.load_params(model)
  prompt = PROMPTS[1]
  padded = np.asarray(prompt[-8:], np.int32)  # JetStream keeps the last tokens...
  prefix, first = js.prefill(params=params, padded_tokens=padded, true_length=len(prompt),
                             request_id=None)  # ...but passes the full length
  assert first.log_prob is not None
  state = js.bulk_insert(prefix, js.init_decode_state(), [0, 2])
  want = full_forward_greedy(model, prompt[-8:], eng.config.max_new_tokens)
  assert int(first.get_result_at_slot(0).tokens[0, 0]) == want[0]
  got = {0: [want[0]], 2: [want[0]]}
  for _ in range(eng.config.max_new_tokens):
    state, result = js.generate(params, state)
    result = result.convert_to_numpy()
    for slot in got:
      data = result.get_result_at_slot(slot)
      if data.valid[0, 0]:
        got[slot].append(int(data.tokens[0, 0]))
      else:
        assert data.lengths[0] > 10**6  # complete before JetStream reads the token
  assert got[0] == got[2] == want
  with pytest.raises(NotImplementedError, match="one sample"):
    js.prefill_multisampling(params=params, padded_tokens=padded, true_length=3, num_samples=2)


def test_jax_tree_map_shim_only_with_jetstream(monkeypatch):
  """The adapter points a missing jax.tree_map (JetStream 0.2.2 frees prefixes with it) at
  jax.tree.map when it imports JetStream, and leaves JAX alone otherwise."""
  had = hasattr(jax, "tree_map")
  if had:
    monkeypatch.delattr(jax, "tree_map")
  try:
    if not HAVE_JETSTREAM:
      with pytest.raises(ImportError):
        jetstream_adapter.api_generation()
      assert not hasattr(jax, "tree_map")
    _fake_jetstream(monkeypatch, False)
    assert jetstream_adapter.api_generation() == "0.2.2"
    assert jax.tree_map is jax.tree.map
  finally:
    if not had and hasattr(jax, "tree_map"):
      del jax.tree_map


@pytest.mark.skipif(not HAVE_JETSTREAM, reason="optional jetstream extra (google-jetstream) not "
                    "installed or not importable under this JAX")
@pytest.mark.timeout(600)
def test_jetstream_backend_equals_engine_backend():
  """rollout.backend=jetstream (JetStream's orchestrator) gives the engine backend's rows:
  sampled with the same request keys, more requests than slots, stops and length limits."""
  from distflow_jax.rollout import backend
  from test_rollout_engine import CFG
  conf = engine(SamplingParams(1.0)).config
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
  native = backend.EngineBackend.wrap(engine(SamplingParams(1.0)))
  js = backend.make_backend("jetstream", CFG, conf, mesh)
  params = native.load_params(peaky_model())
  rng = jax.random.key(7)
  a = js.generate(params, PROMPTS, n=2, rng=rng, max_new_tokens=6)
  b = native.generate(params, PROMPTS, n=2, rng=rng, max_new_tokens=6)
  for name in ("tokens_RxN", "mask_RxN", "lengths_R", "stopped_R", "prompt_index_R"):
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
  np.testing.assert_allclose(a.logprobs_RxN, b.logprobs_RxN, atol=1e-5)
  np.testing.assert_allclose(a.sampling_logprobs_RxN, b.sampling_logprobs_RxN, atol=1e-5)


def test_serve_streams_collects_every_request_and_waits_for_the_done_flags():
  """The serving loop the jetstream backend and tools/jetstream_* share, on a fake driver: the
  requests are made inside the loop, every stream is collected in request order, and the call
  returns only once every channel says done (JetStream posts that after the end marker)."""
  import asyncio
  import types

  class Channel:
    def __init__(self, tokens):
      self.tokens, self.finished = tokens, False

    async def _stream(self):
      for t in self.tokens:
        await asyncio.sleep(0)
        yield [types.SimpleNamespace(token_ids=[t])]
      loop = asyncio.get_running_loop()
      loop.call_later(0.02, lambda: setattr(self, "finished", True))

    def __aiter__(self):
      return self._stream()

    def done(self):
      return self.finished

  placed = []
  driver = types.SimpleNamespace(place_request_on_prefill_queue=placed.append)

  def make_requests():
    asyncio.get_running_loop()  # raises outside a running loop
    return [types.SimpleNamespace(return_channel=Channel(t)) for t in ([3, 4, 5], [], [7])]

  out = asyncio.run(jetstream_adapter.serve_streams(driver, make_requests))
  assert out == [[3, 4, 5], [], [7]] and len(placed) == 3
  assert all(r.return_channel.done() for r in placed)
