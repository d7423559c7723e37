"""A JetStream-style engine on our transformer: prefill, insert, generate over slots.

The method names and semantics follow `jetstream.engine.engine_api.Engine`
(`load_params`, `init_decode_state`, `prefill(*, params, padded_tokens,
true_length) -> (prefix, first-token result)`, `insert(prefix, decode_state,
slot)`, `generate(params, decode_state) -> (decode_state, result)`,
`get_prefix_destination_sharding`, `max_concurrent_decodes`,
`max_prefill_length`, `samples_per_slot`, `mesh`), so `jetstream_adapter`
can register it with JetStream where that package imports.  Beyond the API:

* `generate_steps` runs up to `decode_steps` tokens per call in one compiled
  loop (one host round trip per chunk, not per token);
* `prefill_insert` prefills several prompts and starts many slots from them
  in one call (the n samples of a prompt share its prefill);
* results carry per-token logprobs under the untruncated temperature-1
  softmax (see `sampling`), plus the sampling distribution's.

Compiles are bounded: one decode loop per cache capacity, one prefill per
(prompt-length bucket, power-of-two prompt count) and one insert per those and
capacity, whatever the traffic.  The driver's cache starts at the smallest
capacity and grows by decode windows (`cache_growth`: at most 8 capacities,
results bitwise those of the full-size cache); `init_decode_state` (JetStream)
gives the full-size one.  `compile_counts()`
exposes the jit cache sizes so tests can assert it.

Placement: the engine runs on `mesh`, by default one replica over this
host's local devices (`replica_mesh`): slots split over `data`, heads and
hidden units over `tensor`.  Every output the host loop reads is replicated,
so when a replica's mesh spans several hosts each of its processes reads the
same values and takes the same decisions; those processes must then be given
the same prompts, and every call is a cross-host collective step.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distflow_jax.models import sharding as msharding, stacking
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.transformer import KVCache, Transformer
from distflow_jax.rollout import cache_growth, decode, weight_sync
from distflow_jax.rollout.decode import DecodeState, Prefix, StepOutput
# The settings, placement and result types live in their own modules; re-exported here.
from distflow_jax.rollout.engine_config import EngineConfig, place_params, replica_mesh
from distflow_jax.rollout.results import ResultTokens, SlotData
from distflow_jax.rollout.sampling import request_keys

__all__ = ["Engine", "EngineConfig", "ResultTokens", "SlotData", "replica_mesh"]


def _pow2_at_least(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


class Engine:
  """Continuous-batching decode engine over `max_concurrent_decodes` slots (see module doc)."""

  def __init__(self, model_cfg: ModelConfig, config: EngineConfig, mesh: Mesh | None = None,
               rules: msharding.Rules | None = None):
    # Decode runs layer by layer, so the engine keeps one array per layer: a slice of
    # stacked (scan_layers) weights per decode step could cost a copy of every weight.
    # Stacked parameters handed in are unstacked once, by `_unstacked`.
    self.model_cfg = model_cfg
    self._loop_cfg = model_cfg.replace(scan_layers=False)
    self.config = config
    self._mesh = mesh if mesh is not None else replica_mesh()
    self.rules = rules if rules is not None else msharding.fsdp_tp_rules()
    data = self._mesh.shape.get("data", 1)
    if config.max_concurrent_decodes % data:
      raise ValueError(f"max_concurrent_decodes={config.max_concurrent_decodes} must be a "
                       f"multiple of the replica's data axis ({data} devices)")
    abstract = nnx.eval_shape(lambda: Transformer(self._loop_cfg, rngs=nnx.Rngs(0)))
    self.graphdef, self._abstract_params = nnx.split(abstract)
    self.param_shardings = msharding.state_shardings(self._abstract_params, self._mesh,
                                                     self.rules)
    self._state_sh = self._decode_state_shardings()
    rep = NamedSharding(self._mesh, P())
    self._replicated = rep
    g, c = self.graphdef, config
    kw = dict(sp=c.sampling, stop_ids=c.stop_ids)
    self.capacities = cache_growth.capacities(
        c.cache_len, c.prefill_buckets[-1] + c.decode_steps, c.grow_cache and not c.fixed_shapes)
    self._init = jax.jit(functools.partial(decode.empty_state, model_cfg,
                                           c.max_concurrent_decodes),
                         static_argnums=0, out_shardings=self._state_sh)
    # Layer by layer, each old layer released as its padded copy is made (cache_growth).
    self._grow = cache_growth.Grower(self._state_sh)
    # Decode windows are those of the full length whatever the capacity (cache_growth).
    win = dict(windowed=False if c.fixed_shapes else c.cache_len)
    self._chunk = jax.jit(functools.partial(decode.decode_chunk, g, num_steps=c.decode_steps,
                                            **kw, **win),
                          donate_argnums=(1,), out_shardings=(self._state_sh, rep))
    self._step = jax.jit(functools.partial(decode.decode_chunk, g, num_steps=1, **kw, **win),
                         donate_argnums=(1,), out_shardings=(self._state_sh, rep))
    # Prefill and sampling compile per prompt shape; the insert (data movement only) per
    # prompt shape and capacity, so the grown capacities do not multiply prefill compiles.
    self._prefill_insert = jax.jit(functools.partial(decode.prefill_sample, g, sp=c.sampling),
                                   out_shardings=self._prefill_insert_shardings())
    self._prefill = jax.jit(functools.partial(decode.prefill, g, sp=c.sampling),
                            out_shardings=self.get_prefix_destination_sharding())
    self._insert = jax.jit(functools.partial(decode.insert_rows, stop_ids=c.stop_ids),
                           donate_argnums=(0,), out_shardings=self._state_sh)
    self._base_key = jax.random.key(c.seed)
    self._next_request = 0
    self._sync: weight_sync.WeightSync | None = None
    self._unstack = None
    self._params_sig = None     # prefill_insert's parameter signature (precompile)
    self._precompiled: set[tuple[int, int]] = set()

  # ---- placement ---------------------------------------------------------------------------

  def _kv_spec(self, rows: str | None) -> P:
    tp = self._mesh.shape.get("tensor", 1)
    heads = "tensor" if tp > 1 and self.model_cfg.num_kv_heads % tp == 0 else None
    return P(rows, heads, None, None)  # each layer's [B, Hkv, S, Dh]

  def _kv_shardings(self, rows: str | None) -> tuple[NamedSharding, ...]:
    return (NamedSharding(self._mesh, self._kv_spec(rows)),) * self.model_cfg.num_layers

  def _decode_state_shardings(self) -> DecodeState:
    m = self._mesh
    rows = NamedSharding(m, P("data"))
    return DecodeState(
        cache=KVCache(k=self._kv_shardings("data"), v=self._kv_shardings("data"),
                      pos=NamedSharding(m, P("data", None))),
        tokens_B=rows, index_B=rows, generated_B=rows, limit_B=rows, active_B=rows,
        keys_Bx2=NamedSharding(m, P("data", None)))

  def get_prefix_destination_sharding(self) -> Prefix:
    """Shardings of a `Prefix` on this engine: rows replicated, KV heads over `tensor`."""
    m = self._mesh
    rep = NamedSharding(m, P())
    kv = self._kv_shardings(None)
    return Prefix(cache=KVCache(k=kv, v=kv, pos=rep), logits_PxV=rep, lengths_P=rep,
                  tokens_P=rep, logprobs_P=rep, keys_Px2=rep)

  @property
  def mesh(self) -> Mesh:
    return self._mesh

  @property
  def colocated_cpus(self) -> None:
    return None

  @property
  def max_concurrent_decodes(self) -> int:
    return self.config.max_concurrent_decodes

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self.config.prefill_buckets[-1]

  def bucket_for(self, length: int) -> int:
    """The smallest prefill bucket that holds `length` tokens."""
    return self.config.bucket_for(length)

  # ---- parameters --------------------------------------------------------------------------

  def load_params(self, params: nnx.State | nnx.Module | None = None,
                  seed: int | None = None) -> nnx.State:
    """Places `params` (a model or its state) in the rollout layout; random init when None."""
    if isinstance(params, nnx.Module):
      params = nnx.state(params)
    params = params if params is None else self._unstacked(params)
    return place_params(self._loop_cfg, params, self._mesh, self.rules, self.param_shardings,
                        self.config.seed if seed is None else seed)

  def update_params(self, train_params: nnx.State) -> nnx.State:
    """The actor's parameters, in any training layout, resharded into this engine's layout."""
    if self._sync is None:
      self._sync = weight_sync.WeightSync(self.param_shardings)
    return self._sync(self._unstacked(train_params))

  def sync_programs(self, train_params: Any, process_of=None) -> list[tuple[str, Any, tuple]]:
    """The programs ``update_params`` runs for (abstract, sharded) ``train_params``: the
    split of stacked layers, then the weight sync's steps (``process_of``: a simulated
    topology's device -> process, as ``WeightSync`` takes it)."""
    out = []
    if stacking.is_stacked(train_params):
      if self._unstack is None:
        self._unstack = jax.jit(stacking.to_loop)
      out.append(("unstack", self._unstack, (train_params,)))
      # The split's output layout is what sharding propagation picks: ask the compiler.
      placed = self._unstack.lower(train_params).compile().output_shardings
      train_params = jax.tree.map(
          lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
          jax.eval_shape(self._unstack, train_params), placed)
    sync = weight_sync.WeightSync(self.param_shardings, process_of)
    return out + [(f"sync/{n}", fn, args) for n, fn, args in sync.programs(train_params)]

  def _unstacked(self, params: nnx.State) -> nnx.State:
    """`params` in the engine's one-array-per-layer layout (a jitted split of stacked ones)."""
    if not stacking.is_stacked(params):
      return params
    if self._unstack is None:
      self._unstack = jax.jit(stacking.to_loop)
    return self._unstack(params)

  # ---- JetStream API -----------------------------------------------------------------------

  def init_decode_state(self, *args, **kwargs) -> DecodeState:
    del args, kwargs
    return self._init(self.config.cache_len)

  def start_state(self) -> DecodeState:
    """An empty state at the smallest capacity (the driver grows it with `fit`)."""
    return self._init(self.capacities[0])

  def fit(self, decode_state: DecodeState, end: int) -> DecodeState:
    """`decode_state` grown (one capacity at a time) until its cache holds `end` slots."""
    while decode_state.cache.max_len < min(end, self.capacities[-1]):
      nxt = self.capacities[self.capacities.index(decode_state.cache.max_len) + 1]
      decode_state = self._grow(decode_state, nxt)
    return decode_state

  def new_request_keys(self, count: int) -> jax.Array:
    """Keys for the next `count` requests of this engine (a per-engine counter)."""
    ids = np.arange(self._next_request, self._next_request + count, dtype=np.uint32)
    self._next_request += count
    return request_keys(self._base_key, jnp.asarray(ids))

  def prefill(self, *, params: nnx.State, existing_prefix: Prefix | None = None,
              padded_tokens: Any, true_length: int, sampler: Any = None,
              rng: jax.Array | None = None) -> tuple[Prefix, ResultTokens]:
    """Prefills one prompt; returns its prefix and its first sampled token.

    `padded_tokens` is `[T]` (padded up to the next bucket here); `rng`, if
    given, is the request's key (else the engine's request counter gives one).
    """
    if existing_prefix is not None or sampler is not None:
      raise NotImplementedError("prefill: existing_prefix and sampler are not supported")
    tokens = np.asarray(padded_tokens, np.int32).reshape(-1)
    if not 0 < true_length <= tokens.shape[0]:
      raise ValueError(f"prefill: true_length={true_length} must be in [1, {tokens.shape[0]}]")
    t = self.bucket_for(tokens.shape[0])
    row = np.zeros((1, t), np.int32)
    row[0, :true_length] = tokens[:true_length]
    if rng is None:
      keys = self.new_request_keys(1)
    else:
      keys = rng if rng.dtype == jnp.uint32 else jax.random.key_data(rng)
      keys = jnp.reshape(keys, (1, 2))
    prefix = self._prefill(params, row, np.array([true_length], np.int32), keys)
    result = ResultTokens(tokens=prefix.tokens_P[:, None], valid=jnp.ones((1, 1), bool),
                          lengths=jnp.ones((1,), jnp.int32), logprobs=prefix.logprobs_P[:, None])
    return prefix, result

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    """Starts the prefix's (first) request in `slot`, continuing from its first token."""
    if not 0 <= slot < self.max_concurrent_decodes:
      raise ValueError(f"insert: slot {slot} out of range [0, {self.max_concurrent_decodes})")
    one = lambda x: jnp.asarray([x], jnp.int32)  # noqa: E731
    return self._insert(decode_state, prefix.cache, one(0), one(slot), prefix.tokens_P[:1],
                        prefix.lengths_P[:1], prefix.keys_Px2[:1],
                        one(self.config.max_new_tokens))

  def generate(self, params: nnx.State, decode_state: DecodeState
               ) -> tuple[DecodeState, ResultTokens]:
    """One decode step for every slot (invalid where the slot is free or finished)."""
    decode_state, out = self._step(params, decode_state, jnp.asarray(False))
    return decode_state, ResultTokens(tokens=out.tokens_BxK, valid=out.valid_BxK,
                                      lengths=decode_state.generated_B,
                                      logprobs=out.logprobs_BxK)

  def free_resource(self, slot: int) -> None:
    del slot

  def get_tokenizer(self) -> None:
    return None

  # ---- batched extensions used by the RL driver ---------------------------------------------

  def generate_steps(self, params: nnx.State, decode_state: DecodeState,
                     stop_on_free: bool = False) -> tuple[DecodeState, StepOutput]:
    """Up to `decode_steps` tokens per slot in one call; see `decode.decode_chunk`."""
    return self._chunk(params, decode_state, jnp.asarray(bool(stop_on_free)))

  def prefill_insert(self, params: nnx.State, decode_state: DecodeState,
                     prompts: Sequence[Sequence[int]], src: Sequence[int], slots: Sequence[int],
                     keys_Qx2: jax.Array | np.ndarray, limits: Sequence[int] | None = None
                     ) -> tuple[DecodeState, jax.Array, jax.Array, jax.Array]:
    """Prefills `prompts` once and starts request q on prompt `src[q]` in slot `slots[q]`.

    Prompt count is padded to a power of two and the length to a bucket;
    requests are padded to `max_concurrent_decodes` rows, so compiles stay
    bounded.  Returns the state and the first tokens / logprobs / sampling
    logprobs of the (padded) request rows.
    """
    b = self.max_concurrent_decodes
    q = len(slots)
    if not 0 < q <= b or len(src) != q or len(keys_Qx2) != q:
      raise ValueError(f"prefill_insert: need 1..{b} requests with as many src/keys, got "
                       f"{q} slots, {len(src)} src, {len(keys_Qx2)} keys")
    lengths = [len(p) for p in prompts]
    if not 0 < len(prompts) <= q or min(lengths) <= 0:
      raise ValueError(f"prefill_insert: need 1..{q} non-empty prompts (one per request at "
                       f"most), got {len(prompts)} with lengths {lengths}")
    if min(src) < 0 or max(src) >= len(prompts):
      raise ValueError(f"prefill_insert: src must index the {len(prompts)} prompts, got {src}")
    if len(set(int(x) for x in slots)) != q or min(slots) < 0 or max(slots) >= b:
      raise ValueError(f"prefill_insert: slots must be distinct, in [0, {b}), got {slots}")
    t = self.bucket_for(max(lengths))
    p = min(_pow2_at_least(len(prompts)), b)
    rows = np.arange(len(prompts))
    if self.config.fixed_shapes:
      # All rows, the largest bucket, and request q's own prompt in row slots[q].
      if list(src) != list(range(q)):
        raise ValueError("prefill_insert: fixed shapes need one prompt per request (src = "
                         "0..q-1)")
      t, p, rows = self.config.prefill_buckets[-1], b, np.asarray(slots, np.int64)
    tokens = np.zeros((p, t), np.int32)
    lens = np.ones((p,), np.int32)
    for i, prompt in zip(rows, prompts):
      tokens[i, :len(prompt)] = prompt
      lens[i] = len(prompt)
    pad = b - q
    src_a = np.concatenate([rows[np.asarray(src, np.int64)].astype(np.int32),
                            np.zeros(pad, np.int32)])
    slots_a = np.concatenate([np.asarray(slots, np.int32), np.full(pad, b, np.int32)])
    keys = np.zeros((b, 2), np.uint32)
    keys[:q] = np.asarray(keys_Qx2, np.uint32)
    lim = np.full((b,), self.config.max_new_tokens, np.int32)
    if limits is not None:
      lim[:q] = np.minimum(np.asarray(limits, np.int32), self.config.max_new_tokens)
    if self._params_sig is None:  # what precompile lowers with (shapes and placements only)
      self._params_sig = jax.tree.map(
          lambda x: (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                     if isinstance(x, jax.Array) else x), params)
    cache, lens_q, tok, lp, slp = self._prefill_insert(params, tokens, lens, src_a, keys)
    state = self._insert(decode_state, cache, src_a, slots_a, tok, lens_q, keys, lim)
    return state, tok, lp, slp

  def prefill_shapes(self) -> list[tuple[int, int]]:
    """Every (prompt rows, prompt width) ``prefill_insert`` can compile for: rows a power of
    two up to max_concurrent_decodes, widths the prefill buckets (fixed shapes: one)."""
    b, buckets = self.max_concurrent_decodes, self.config.prefill_buckets
    if self.config.fixed_shapes:
      return [(b, buckets[-1])]
    rows = sorted({min(_pow2_at_least(k), b) for k in range(1, b + 1)})
    return [(p, t) for t in buckets for p in rows]

  def programs(self, params_sig: Any) -> list[tuple[str, Any, tuple]]:
    """Every program a run of this engine compiles, as ``(name, jitted, abstract args)``
    for parameters laid out as ``params_sig`` (``ShapeDtypeStruct``s with shardings):
    each cache capacity's empty state, decode loop and grow step, and for each of
    ``prefill_shapes`` its prefill and its insert at every capacity.  ``precompile``
    compiles them; ``plan --lower`` lowers them for a target device."""
    b = self.max_concurrent_decodes
    sds = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)  # noqa: E731
    states = {c: jax.tree.map(sds, jax.eval_shape(self._init, c), self._state_sh)
              for c in self.capacities}
    ints, keys = np.zeros(b, np.int32), np.zeros((b, 2), np.uint32)
    out: list[tuple[str, Any, tuple]] = []
    for i, c in enumerate(self.capacities):
      out.append((f"init[cap={c}]", self._init, (c,)))
      out.append((f"decode[cap={c}]", self._chunk, (params_sig, states[c], np.asarray(False))))
      if i + 1 < len(self.capacities):
        out.append((f"grow[{c}->{self.capacities[i + 1]}]", self._grow,
                    (states[c], self.capacities[i + 1])))
    for p, t in self.prefill_shapes():
      args = (params_sig, np.zeros((p, t), np.int32), np.ones((p,), np.int32), ints, keys)
      prefix = jax.tree.map(sds, jax.eval_shape(self._prefill_insert, *args),
                            self._prefill_insert_shardings())
      out.append((f"prefill[rows={p},len={t}]", self._prefill_insert, args))
      cache, lens_q, tok = prefix[:3]
      for c in self.capacities:
        out.append((f"insert[rows={p},len={t},cap={c}]", self._insert,
                    (states[c], cache, ints, ints, tok, lens_q, keys, ints)))
    return out

  def precompile(self) -> int:
    """Compiles ahead of time, with the parameters' placements of the first call (a no-op
    before it), every one of ``programs``; returns how many capacities and prompt shapes
    it compiled (not yet compiled ones).  A later call of a compiled shape finds it in
    jax's in-memory caches, so a new prompt width or prompt count mid-run does not
    compile."""
    if self._params_sig is None:
      return 0
    done = set()
    for name, fn, args in self.programs(self._params_sig):
      group = self._program_group(name)
      if group in self._precompiled:
        continue
      fn.lower(*args).compile()
      done.add(group)
    self._precompiled |= done
    return len(done)

  @staticmethod
  def _program_group(name: str) -> tuple:
    """What ``precompile`` counts as one unit: a capacity (init, decode, grow) or a prompt
    shape (prefill and its inserts)."""
    kind, _, rest = name.partition("[")
    fields = dict(f.split("=") for f in rest.rstrip("]").split(",") if "=" in f)
    if kind in ("prefill", "insert"):
      return (int(fields["rows"]), int(fields["len"]))
    if kind == "grow":
      return ("capacity", int(rest.split("->")[0]))
    return ("capacity", int(fields["cap"]))

  def _prefill_insert_shardings(self):
    rep = self._replicated
    return (self.get_prefix_destination_sharding().cache, rep, rep, rep, rep)

  def compile_counts(self) -> dict[str, int]:
    """How many executables each jitted entry point holds (a recompile shows up here)."""
    counts = {name: fn._cache_size() for name, fn in (
        ("init", self._init), ("grow", self._grow), ("decode_steps", self._chunk),
        ("generate", self._step),
        ("prefill_insert", self._prefill_insert), ("prefill", self._prefill),
        ("insert", self._insert))}
    counts["weight_sync"] = self._sync.compile_count() if self._sync is not None else 0
    return counts
