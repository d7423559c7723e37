"""Registers our engine as a `jetstream.engine.engine_api.Engine` (optional `jetstream` extra).

    from distflow_jax.rollout.jetstream_adapter import as_jetstream
    js_engine = as_jetstream(engine)     # an engine_api.Engine subclass instance

JetStream's `ResultTokens` packs tokens, validity and lengths in one int32
array; the adapter converts ours into it.  It has no logprob column, so the
per-token logprobs stay available through the wrapped engine
(`js_engine.engine.generate`).  Importing this module never needs JetStream;
`as_jetstream` raises ImportError with the install hint when it is missing.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

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


def as_jetstream(engine: Engine) -> Any:
  """Wraps `engine` in a subclass of `jetstream.engine.engine_api.Engine`."""
  api = _engine_api()

  class DistflowJetStreamEngine(api.Engine):
    """JetStream's Engine interface, delegating to a distflow_jax rollout Engine."""

    def __init__(self, inner: Engine):
      self.engine = inner

    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length,
                sampler=None, rng=None):
      prefix, first = self.engine.prefill(params=params, existing_prefix=existing_prefix,
                                          padded_tokens=padded_tokens, true_length=true_length,
                                          sampler=sampler, rng=rng)
      return prefix, to_jetstream_result(first, api)

    def generate(self, params, decode_state, sampler=None, rng=None):
      del sampler, rng
      state, result = self.engine.generate(params, decode_state)
      return state, to_jetstream_result(result, api)

    def insert(self, prefix, decode_state, slot):
      return self.engine.insert(prefix, decode_state, slot)

    def load_params(self, *args, **kwargs):
      return self.engine.load_params(*args, **kwargs)

    def get_prefix_destination_sharding(self):
      return self.engine.get_prefix_destination_sharding()

    def get_tokenizer(self):
      return self.engine.get_tokenizer()

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
