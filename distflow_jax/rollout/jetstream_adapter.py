"""Registers our engine as a `jetstream.engine.engine_api.Engine` (optional `jetstream` extra).

    from distflow_jax.rollout.jetstream_adapter import as_jetstream
    js_engine = as_jetstream(engine)     # an engine_api.Engine subclass instance

JetStream's `ResultTokens` packs tokens, validity and lengths in one int32
array; the adapter converts ours into it.  It has no logprob column, so the
per-token logprobs stay available through the wrapped engine
(`js_engine.engine.generate`).  Importing this module never needs JetStream;
`as_jetstream` raises ImportError with the install hint when it is missing.

Two generations of the API: newer JetStream's `prefill` returns `(prefix,
first-token result)` and its orchestrator streams that first token; in the
PyPI release (0.2.2) `prefill` returns the prefix alone and the first token a
client sees comes from `generate`.  Our engine samples the first token at
prefill either way, so against the old API the adapter returns the prefix
alone and replays that token: each slot inserted since has a host-side queue,
and `generate` emits every such slot's tokens one step late (a host sync per
step: fine for serving demos, not for the RL path).  Which API is installed is
read off `engine_api.Engine.prefill`'s return annotation (a tuple = new).

`build_tokenizer` gives JetStream's orchestrator a token-id tokenizer (ids in,
ids as text out; stop tokens = the engine's stop ids) unless one is passed.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

import jax.numpy as jnp
import numpy as np

from distflow_jax.rollout.engine import Engine, ResultTokens

INSTALL_HINT = ("JetStream is not importable: pip install 'distflow-jax[jetstream]' "
                "(google-jetstream); note its 0.2.2 wheel pulls TensorFlow")


def _engine_api():
  try:
    from jetstream.engine import engine_api  # pylint: disable=import-outside-toplevel
  except Exception as e:  # ImportError, or its own import-time failures under new JAX
    raise ImportError(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from e
  return engine_api


def to_jetstream_result(result: ResultTokens, engine_api: Any = None) -> Any:
  """Our `ResultTokens` as JetStream's (tokens | valid | lengths columns of one int32 array)."""
  engine_api = engine_api or _engine_api()
  k = result.tokens.shape[1]
  data = jnp.concatenate([jnp.asarray(result.tokens, jnp.int32),
                          jnp.asarray(result.valid, jnp.int32),
                          jnp.asarray(result.lengths, jnp.int32)[:, None]], axis=1)
  return engine_api.ResultTokens(data=data, tokens_idx=(0, k), valid_idx=(k, 2 * k),
                                 length_idx=(2 * k, 2 * k + 1),
                                 samples_per_slot=result.samples_per_slot)


def prefill_returns_first_token(engine_api: Any = None) -> bool:
  """Whether the installed `Engine.prefill` returns `(prefix, first-token result)` (newer
  JetStream) rather than the prefix alone (the 0.2.2 release)."""
  engine_api = engine_api or _engine_api()
  ret = inspect.signature(engine_api.Engine.prefill).return_annotation
  if isinstance(ret, str):  # postponed annotations
    return ret.replace(" ", "").lower().startswith("tuple")
  return typing.get_origin(ret) is tuple


def as_jetstream(engine: Engine, *, tokenizer: Any = None, bos_id: int = 0) -> Any:
  """Wraps `engine` in a subclass of `jetstream.engine.engine_api.Engine`.

  `tokenizer` (a `jetstream.engine.tokenizer_api.Tokenizer`) is what
  `build_tokenizer` returns; by default a token-id one whose BOS (which
  JetStream's orchestrator prepends to token requests) is `bos_id`.
  """
  api = _engine_api()
  legacy = not prefill_returns_first_token(api)
  if tokenizer is None:
    tokenizer = _id_tokenizer(engine, bos_id)

  class DistflowJetStreamEngine(api.Engine):
    """JetStream's Engine interface, delegating to a distflow_jax rollout Engine."""

    def __init__(self, inner: Engine):
      self.engine = inner
      # Old API only: per slot, the (token, valid, length, logprob) rows still to emit.
      self._lagged: dict[int, list[tuple[int, bool, int, float]]] = {}

    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length,
                sampler=None, rng=None):
      prefix, first = self.engine.prefill(params=params, existing_prefix=existing_prefix,
                                          padded_tokens=padded_tokens, true_length=true_length,
                                          sampler=sampler, rng=rng)
      if legacy:
        return prefix  # the first token rides in prefix.tokens_P; `insert` queues it
      return prefix, to_jetstream_result(first, api)

    def generate(self, params, decode_state, sampler=None, rng=None):
      del sampler, rng
      state, result = self.engine.generate(params, decode_state)
      if legacy and self._lagged:
        result = self._replay(result)
      return state, to_jetstream_result(result, api)

    def _replay(self, result: ResultTokens) -> ResultTokens:
      """Queues this step's token of every lagged slot and emits the oldest one instead."""
      r = result.convert_to_numpy()
      cols = [np.array(x) for x in (r.tokens, r.valid, r.lengths, r.logprobs)]
      tokens, valid, lengths, logprobs = cols
      for slot, queue in self._lagged.items():
        queue.append((int(r.tokens[slot, 0]), bool(r.valid[slot, 0]), int(r.lengths[slot]),
                      float(r.logprobs[slot, 0])))
        tokens[slot, 0], valid[slot, 0], lengths[slot], logprobs[slot, 0] = queue.pop(0)
      return ResultTokens(tokens, valid, lengths, logprobs, r.samples_per_slot)

    def insert(self, prefix, decode_state, slot):
      if isinstance(prefix, tuple):  # a new-API prefill result handed back whole
        prefix = prefix[0]
      if legacy:
        self._lagged[slot] = [(int(np.asarray(prefix.tokens_P)[0]), True, 1,
                               float(np.asarray(prefix.logprobs_P)[0]))]
      return self.engine.insert(prefix, decode_state, slot)

    def load_params(self, *args, **kwargs):
      return self.engine.load_params(*args, **kwargs)

    def get_prefix_destination_sharding(self):
      return self.engine.get_prefix_destination_sharding()

    def get_tokenizer(self):
      return self.engine.get_tokenizer()

    def build_tokenizer(self, metadata):
      del metadata
      return tokenizer

    def init_decode_state(self, *args, **kwargs):
      return self.engine.init_decode_state(*args, **kwargs)

    def free_resource(self, slot):
      return self.engine.free_resource(slot)

    @property
    def max_concurrent_decodes(self):
      return self.engine.max_concurrent_decodes

    @property
    def samples_per_slot(self):
      return self.engine.samples_per_slot

    @property
    def max_prefill_length(self):
      return self.engine.max_prefill_length

    @property
    def mesh(self):
      return self.engine.mesh

    @property
    def colocated_cpus(self):
      return self.engine.colocated_cpus

  return DistflowJetStreamEngine(engine)


def _id_tokenizer(engine: Engine, bos_id: int) -> Any:
  """A `tokenizer_api.Tokenizer` over raw ids: requests carry token ids, text is the ids."""
  from jetstream.engine import tokenizer_api  # pylint: disable=import-outside-toplevel
  stops = set(engine.config.stop_ids)

  class IdTokenizer(tokenizer_api.Tokenizer):
    """Token ids in, ids as text out; stops on the engine's stop ids."""

    def encode(self, s, **kwargs):
      raise NotImplementedError("IdTokenizer: send token ids, not text (or pass a tokenizer "
                                "to as_jetstream)")

    def decode(self, token_ids, **kwargs):
      return " ".join(str(int(t)) for t in token_ids)

    @property
    def pad_id(self):
      return 0

    @property
    def eos_id(self):
      return min(stops) if stops else -1

    @property
    def bos_id(self):
      return bos_id

    @property
    def stop_tokens(self):
      return stops

  return IdTokenizer()
