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

What else differs between 0.2.2 and JetStream's last main (archived 2026-01),
all handled here so callers need not know which one is installed:

* main makes `bulk_insert`, `prefill_multisampling`, `use_chunked_prefill`
  and `prefill_chunk_size` abstract: defined here (no chunked prefill; one
  sample per request; `bulk_insert` inserts the prefix slot by slot);
* main passes `request_id` to `prefill`/`insert` and its `ResultTokens` has a
  `log_prob` column, which the adapter fills with the engine's logprobs;
* both truncate a token request longer than `max_prefill_length` (after
  BOS) to its last tokens but pass the untruncated `true_length`: the
  adapter clamps it to what it was given;
* a token request gets BOS prepended unless flagged as already having one
  (main: `has_bos`, 0.2.2: a `history_path`): `token_request` builds either;
* when a slot ends at the engine's own length limit the engine reports the
  next step invalid; main appends an invalid step's token to the stream, so
  the adapter reports such a row's length past any `max_tokens` instead,
  which both versions treat as "complete" before reading its token;
* 0.2.2's orchestrator frees prefixes with `jax.tree_map`, which JAX removed:
  importing JetStream through the adapter points it at `jax.tree.map` when
  it is missing (nowhere else, and never without JetStream).

`build_tokenizer` gives JetStream's orchestrator a token-id tokenizer (ids in,
ids as text out; stop tokens = the engine's stop ids) unless one is passed.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import typing
from typing import Any, Callable

import jax
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
  if not hasattr(jax, "tree_map"):
    # JetStream 0.2.2's orchestrator frees each transferred prefix with jax.tree_map (gone
    # from JAX); without it that thread raises and JetStream SIGKILLs the process.
    jax.tree_map = jax.tree.map
  return engine_api


# A finished slot's reported length: past any request's max_tokens (see module doc).
_DONE_LENGTH = np.iinfo(np.int32).max // 2


def to_jetstream_result(result: ResultTokens, engine_api: Any = None, *,
                        mark_done: bool = False) -> Any:
  """Our `ResultTokens` as JetStream's (tokens | valid | lengths columns of one int32 array,
  plus `log_prob` where that version has it).  `mark_done`: rows whose first token is
  invalid (a finished or free slot) report `_DONE_LENGTH` so JetStream completes them."""
  engine_api = engine_api or _engine_api()
  k = result.tokens.shape[1]
  valid = jnp.asarray(result.valid)
  lengths = jnp.asarray(result.lengths, jnp.int32)
  if mark_done:
    lengths = jnp.where(valid[:, 0], lengths, _DONE_LENGTH)
  data = jnp.concatenate([jnp.asarray(result.tokens, jnp.int32), valid.astype(jnp.int32),
                          lengths[:, None]], axis=1)
  extra = {}
  if "log_prob" in getattr(engine_api.ResultTokens, "__dataclass_fields__", {}):
    extra["log_prob"] = jnp.asarray(result.logprobs, jnp.float32)
  return engine_api.ResultTokens(data=data, tokens_idx=(0, k), valid_idx=(k, 2 * k),
                                 length_idx=(2 * k, 2 * k + 1),
                                 samples_per_slot=result.samples_per_slot, **extra)


def prefill_returns_first_token(engine_api: Any = None) -> bool:
  """Whether the installed `Engine.prefill` returns `(prefix, first-token result)` (newer
  JetStream) rather than the prefix alone (the 0.2.2 release)."""
  engine_api = engine_api or _engine_api()
  ret = inspect.signature(engine_api.Engine.prefill).return_annotation
  if isinstance(ret, str):  # postponed annotations
    return ret.replace(" ", "").lower().startswith("tuple")
  return typing.get_origin(ret) is tuple


def api_generation(engine_api: Any = None) -> str:
  """Which JetStream interface is installed: "main" (prefill returns the first token and the
  chunked-prefill / multi-sampling members are abstract), "0.2.2", or "tuple-prefill"."""
  engine_api = engine_api or _engine_api()
  if not prefill_returns_first_token(engine_api):
    return "0.2.2"
  abstract = getattr(engine_api.Engine, "__abstractmethods__", frozenset())
  return "main" if "bulk_insert" in abstract else "tuple-prefill"


def token_request(tokens: Any, max_tokens: int, *, has_bos: bool = False,
                  orchestrator: Any = None) -> Any:
  """A JetStream `ActiveRequest` for token ids with a fresh return channel.  `has_bos`: send
  the ids as they are (no BOS prepended), flagged the way the installed version reads it."""
  if orchestrator is None:
    from jetstream.core import orchestrator  # pylint: disable=import-outside-toplevel
  from jetstream.core.utils import async_multifuture  # pylint: disable=import-outside-toplevel
  fields = orchestrator.ActiveRequest.__dataclass_fields__
  flag = {}
  if has_bos:
    # main reads has_bos; 0.2.2 skips BOS for requests continuing a session (history_path).
    flag = {"has_bos": True} if "has_bos" in fields else {"history_path": "has-bos"}
  return orchestrator.ActiveRequest(max_tokens=max_tokens,
                                    return_channel=async_multifuture.AsyncMultifuture(),
                                    # an array: 0.2.2 reads .shape when it adds no BOS
                                    prefill_content=np.asarray(tokens, np.int32),
                                    is_client_side_tokenization=False, **flag)


async def serve_streams(driver: Any, make_requests: Callable[[], list]) -> list[list[int]]:
  """Places every request on a JetStream `orchestrator.Driver` and collects each one's
  streamed token ids (one sample per request).  The requests are made here, by
  `make_requests` (e.g. `token_request`s): their return channels bind to the running loop."""
  requests = make_requests()
  for r in requests:
    driver.place_request_on_prefill_queue(r)

  async def collect(req) -> list[int]:
    out: list[int] = []
    async for samples in req.return_channel:
      out.extend(samples[0].token_ids)
    return out

  out = list(await asyncio.gather(*(collect(r) for r in requests)))
  # A channel's close() posts two callbacks to this loop (the end marker, then its done
  # flag) from JetStream's detokenize thread; the stream ends at the first, and if the loop
  # closed before the second, that thread would raise and JetStream kills the process.
  while not all(r.return_channel.done() for r in requests):
    await asyncio.sleep(0.01)
  return out


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
      # Hooks for the `jetstream` rollout backend: raw keys handed to prefills in call order
      # (JetStream passes none), and, when a list, a log of inserts and raw generate results.
      self.request_keys: collections.deque = collections.deque()
      self.trace: list | None = None

    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length,
                sampler=None, rng=None, request_id=None):
      del request_id
      # JetStream truncates an over-long request to its last tokens but passes the full
      # length; the prompt the engine sees is what was padded.
      true_length = min(int(true_length), int(np.shape(padded_tokens)[-1]))
      if rng is None and self.request_keys:
        rng = jnp.asarray(self.request_keys.popleft(), jnp.uint32)
      prefix, first = self.engine.prefill(params=params, existing_prefix=existing_prefix,
                                          padded_tokens=padded_tokens, true_length=true_length,
                                          sampler=sampler, rng=rng)
      if legacy:
        return prefix  # the first token rides in prefix.tokens_P; `insert` queues it
      return prefix, to_jetstream_result(first, api)

    def prefill_multisampling(self, *, params, existing_prefix=None, padded_tokens,
                              true_length, sampler=None, rng=None, num_samples=1):
      if num_samples != 1:
        raise NotImplementedError("prefill_multisampling: one sample per request (the RL "
                                  "path shares prefills via Engine.prefill_insert)")
      return self.prefill(params=params, existing_prefix=existing_prefix,
                          padded_tokens=padded_tokens, true_length=true_length,
                          sampler=sampler, rng=rng)

    def generate(self, params, decode_state, sampler=None, rng=None):
      del sampler, rng
      state, result = self.engine.generate(params, decode_state)
      if self.trace is not None:  # not lengths: it is the decode state's, donated next step
        self.trace.append(("step", result.tokens, result.valid, result.logprobs))
      if legacy and self._lagged:
        result = self._replay(result)
      return state, to_jetstream_result(result, api, mark_done=True)

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

    def insert(self, prefix, decode_state, slot, request_id=None):
      del request_id
      if isinstance(prefix, tuple):  # a new-API prefill result handed back whole
        prefix = prefix[0]
      if self.trace is not None:
        # on the host now: JetStream deletes the prefix's arrays once inserted
        self.trace.append(("insert", slot, int(np.asarray(prefix.tokens_P)[0]),
                           float(np.asarray(prefix.logprobs_P)[0])))
      if legacy:
        self._lagged[slot] = [(int(np.asarray(prefix.tokens_P)[0]), True, 1,
                               float(np.asarray(prefix.logprobs_P)[0]))]
      return self.engine.insert(prefix, decode_state, slot)

    def bulk_insert(self, prefix, decode_state, slots):
      for slot in slots:
        decode_state = self.insert(prefix, decode_state, slot)
      return decode_state

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

    @property
    def use_chunked_prefill(self):
      return False

    @property
    def prefill_chunk_size(self):
      return self.engine.max_prefill_length

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
