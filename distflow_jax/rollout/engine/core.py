"""A JetStream-style engine on our transformer: prefill, insert, generate over slots.

The method names and semantics follow `jetstream.engine.engine_api.Engine` (`load_params`,
`init_decode_state`, `prefill(*, params, padded_tokens, true_length) -> (prefix, first-token
result)`, `insert(prefix, decode_state, slot)`, `generate(params, decode_state) ->
(decode_state, result)`, `get_prefix_destination_sharding`, `max_concurrent_decodes`,
`max_prefill_length`, `samples_per_slot`, `mesh`), so `jetstream_adapter` can register it
with JetStream where that package imports.  Beyond the API:

* `generate_steps` runs `decode_steps` tokens per call in one compiled loop with a static
  trip count and no conditional (one host round trip per chunk, not per token; the host
  decides between calls whether to go on);
* `prefill_insert` prefills several prompts and starts many slots from them in one call
  (the n samples of a prompt share its prefill);
* results carry per-token logprobs at the sampling temperature, untruncated, and truncated;
* on CPU devices a 16-bit model is held and computed in float32 (`compute_dtype`,
  config.CpuCompute).

Compiles are bounded: one decode program per cache capacity (`decode_steps` tokens a call,
no conditional), one prefill-and-insert per (prompt-length bucket, power-of-four prompt
count; `prefill_rows`) and capacity, whatever the traffic (`programs` lists and
precompiles them).  The cache has one capacity for the run, the longest prompt bucket plus
`max_new_tokens`; with `grow_cache` the driver's cache starts smaller and grows
(`cache_growth`: at most 8 capacities); `init_decode_state` (JetStream) gives the full-size
one.  `compile_counts()` exposes the jit cache sizes so tests can assert it.

Placement: the engine runs on `mesh`, by default one replica over this host's local devices
(`replica_mesh`): slots split over `data`, heads and hidden units over `tensor`.  Every
output the host loop reads is replicated, so when a replica's mesh spans several hosts each
of its processes reads the same values and takes the same decisions; those processes must
then be given the same prompts (rollout/spanning.py pools them), and every call is a
cross-host collective step.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distflow_jax.models import fused, lora, sharding as msharding, stacking, target
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.transformer import Transformer
from distflow_jax.rollout import lora_sync, weight_sync
from distflow_jax.rollout.engine import (cache_growth, decode, extend, prefill_rows,
                                         programs as engine_programs)
from distflow_jax.rollout.engine.config import (
    FUSED_NAMES, EngineConfig, LoraSync, cast_floats, compute_dtype, decode_state_shardings,
    place_params, prefix_shardings, replica_mesh)
from distflow_jax.rollout.engine.decode import DecodeState, Prefix, StepOutput
from distflow_jax.rollout.engine.results import ResultTokens
from distflow_jax.rollout.engine.sampling import request_keys


class Engine:
  """Continuous-batching decode engine over `max_concurrent_decodes` slots (see module doc)."""

  def __init__(self, model_cfg: ModelConfig, config: EngineConfig, mesh: Mesh | None = None,
               rules: msharding.Rules | None = None):
    # Decode runs layer by layer, so the engine keeps one array per layer (a slice of stacked
    # weights per decode step could cost a copy of every weight): `_unstacked` splits them.
    self.model_cfg = model_cfg
    # LoRA: merged weights (W + a @ b * alpha / r), on the training mesh or the rollout's.
    self._lora_scale = None if model_cfg.lora is None else model_cfg.lora.scale
    self._fuse = () if (config.lora_sync is LoraSync.ADAPTERS and self._lora_scale is not None
                        ) else FUSED_NAMES[config.fuse_projections]
    self.config = config
    self._mesh = mesh if mesh is not None else replica_mesh()
    # The dtype of the engine's weights, cache and compute (config.CpuCompute).
    self.compute_dtype = compute_dtype(model_cfg, config, target.current().platform.value)
    self._cast = self.compute_dtype != model_cfg.dtype  # weights cast as they enter
    self._loop_cfg = model_cfg.replace(scan_layers=False, lora=None, fused_projections=self._fuse,
                                       dtype=self.compute_dtype)
    self.rules = rules if rules is not None else msharding.fsdp_tp_rules()
    data = self._mesh.shape.get("data", 1)
    if config.max_concurrent_decodes % data:
      raise ValueError(f"max_concurrent_decodes={config.max_concurrent_decodes} must be a "
                       f"multiple of the replica's data axis ({data} devices)")
    abstract = nnx.eval_shape(lambda: Transformer(self._loop_cfg, rngs=nnx.Rngs(0)))
    self.graphdef, self._abstract_params = nnx.split(abstract)
    self.param_shardings = msharding.state_shardings(self._abstract_params, self._mesh,
                                                     self.rules)
    self._state_sh = decode_state_shardings(self._mesh, model_cfg)
    self._replicated = rep = NamedSharding(self._mesh, P())
    g, c = self.graphdef, config
    kw = dict(sp=c.sampling, stop_ids=c.stop_ids, stop_sequences=c.stop_sequences)
    self.capacities = cache_growth.capacities(
        c.cache_len, c.prefill_buckets[-1] + c.decode_steps, c.grow_cache and not c.fixed_shapes)
    self._init = jax.jit(functools.partial(decode.empty_state, self._loop_cfg,
                                           c.max_concurrent_decodes, history=c.history),
                         static_argnums=0, out_shardings=self._state_sh)
    # Layer by layer, each old layer released as its padded copy is made (cache_growth).
    self._grow = cache_growth.Grower(self._state_sh)
    # One decode program per capacity: `decode_steps` tokens, no conditional (decode.py).
    self._chunk = jax.jit(functools.partial(decode.decode_chunk, g, num_steps=c.decode_steps, **kw),
                          donate_argnums=(1,), out_shardings=(self._state_sh, rep))
    self._step = jax.jit(functools.partial(decode.decode_chunk, g, num_steps=1, **kw),
                         donate_argnums=(1,), out_shardings=(self._state_sh, rep))
    # Prefill, sampling and insert: one program per prompt shape and capacity.
    self._prefill_insert = jax.jit(
        functools.partial(prefill_rows.prefill_insert, g, sp=c.sampling, stop_ids=c.stop_ids),
        donate_argnums=(1,), out_shardings=(self._state_sh, rep, rep, rep))
    self._prefill = jax.jit(functools.partial(decode.prefill, g, sp=c.sampling),
                            out_shardings=self.get_prefix_destination_sharding())
    self._insert = jax.jit(functools.partial(decode.insert_rows, stop_ids=c.stop_ids),
                           donate_argnums=(0,), out_shardings=self._state_sh)
    self._base_key = jax.random.key(c.seed)
    self._next_request = 0
    self._sync: weight_sync.WeightSync | None = None
    self._adapter_sync: lora_sync.AdapterSync | None = None
    self.sync_bytes = 0         # what the last update_params resharded (whole arrays)
    self._unstack = None
    self._params_sig = None     # prefill_insert's parameter signature (precompile)
    self._precompiled: set[tuple[int, int]] = set()

  # ---- placement ---------------------------------------------------------------------------

  def get_prefix_destination_sharding(self) -> Prefix:
    """Shardings of a `Prefix` on this engine: rows replicated, KV heads over `tensor`."""
    return prefix_shardings(self._mesh, self.model_cfg)

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
    if self._syncs_adapters(train_params):
      self._adapter_sync = self._adapter_sync or self._new_adapter_sync()
      sync, out = self._adapter_sync, self._adapter_sync(train_params)
    else:
      self._sync = self._sync or weight_sync.WeightSync(self.param_shardings)
      sync, out = self._sync, self._sync(self._unstacked(train_params))
    self.sync_bytes = sync.bytes_moved
    return out

  def _syncs_adapters(self, train_params: Any) -> bool:
    return (self.config.lora_sync is LoraSync.ADAPTERS and self._lora_scale is not None
            and lora.has_adapters(train_params))

  def _new_adapter_sync(self, process_of=None) -> lora_sync.AdapterSync:
    return lora_sync.AdapterSync(self.model_cfg, self.param_shardings, self._mesh,
                                 self.rules, process_of)

  def sync_programs(self, train_params: Any, process_of=None) -> list[engine_programs.Program]:
    """The programs ``update_params`` runs for (abstract, sharded) ``train_params``: the
    split of stacked layers, then the weight sync's steps (``process_of``: a simulated
    topology's device -> process, as ``WeightSync`` takes it)."""
    if self._syncs_adapters(train_params):
      return [engine_programs.Program(n, fn, args)
              for n, fn, args in self._new_adapter_sync(process_of).programs(train_params)]
    return engine_programs.sync_programs(train_params, self.param_shardings, self._unstacker,
                                         process_of, bool(self._fuse) or self._cast)

  def _unstacker(self) -> Any:
    """The jitted split of stacked layers into one array per layer (after merging any LoRA
    adapters; then fused and cast to `compute_dtype` where the engine does), on first use."""
    if self._unstack is None:
      scale, fuse = self._lora_scale, self._fuse
      dtype = self.compute_dtype if self._cast else None
      self._unstack = jax.jit(lambda p: cast_floats(fused.fuse(stacking.to_loop(
          p if scale is None else lora.merged_state(p, scale)), fuse), dtype))
    return self._unstack

  def _unstacked(self, params: nnx.State) -> nnx.State:
    """`params` in the engine's one-array-per-layer layout (a jitted split of stacked ones),
    adapters merged."""
    if not (stacking.is_stacked(params) or lora.has_adapters(params) or self._fuse
            or self._cast):
      return params
    return self._unstacker()(params)

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
    decode_state, out = self._step(params, decode_state)
    return decode_state, ResultTokens(tokens=out.tokens_BxK, valid=out.valid_BxK,
                                      lengths=decode_state.generated_B,
                                      logprobs=out.logprobs_BxK)

  def free_resource(self, slot: int) -> None:
    del slot

  def get_tokenizer(self) -> None:
    return None

  # ---- batched extensions used by the RL driver ---------------------------------------------

  def generate_steps(self, params: nnx.State, decode_state: DecodeState
                     ) -> tuple[DecodeState, StepOutput]:
    """`decode_steps` tokens per slot in one call; see `decode.decode_chunk`."""
    return self._chunk(params, decode_state)

  def prefill_insert(self, params: nnx.State, decode_state: DecodeState,
                     prompts: Sequence[Sequence[int]], src: Sequence[int], slots: Sequence[int],
                     keys_Qx2: jax.Array | np.ndarray, limits: Sequence[int] | None = None
                     ) -> tuple[DecodeState, jax.Array, jax.Array, jax.Array]:
    """Prefills `prompts` once and starts request q on prompt `src[q]` in slot `slots[q]`.

    Prompt count is padded to a power of four and the length to a bucket; requests are
    padded to `max_concurrent_decodes` rows (`prefill_rows`), so compiles stay bounded.
    Returns the state and the first tokens / logprobs / sampling logprobs of the rows.
    """
    tokens, lens, src_a, slots_a, keys, lim = prefill_rows.request_rows(
        self.config, prompts, src, slots, keys_Qx2, limits)
    if self._params_sig is None:  # what precompile lowers with (shapes and placements only)
      self._params_sig = jax.tree.map(
          lambda x: (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                     if isinstance(x, jax.Array) else x), params)
    return self._prefill_insert(params, decode_state, tokens, lens, src_a, slots_a, keys, lim)

  def prefill_shapes(self) -> list[tuple[int, int]]:
    """Every (prompt rows, prompt width) ``prefill_insert`` can compile for (prefill_rows)."""
    return prefill_rows.prefill_shapes(self.config)

  def programs(self, params_sig: Any) -> list[engine_programs.Program]:
    """Every program a run of this engine compiles, as ``(name, jitted, abstract args, group)``
    for parameters laid out as ``params_sig`` (``ShapeDtypeStruct``s with shardings; see
    ``engine_programs.programs``).  ``precompile`` compiles them; ``plan --lower`` lowers
    them for a target device."""
    return engine_programs.programs(
        params_sig, slots=self.max_concurrent_decodes, capacities=self.capacities,
        shapes=self.prefill_shapes(), state_shardings=self._state_sh, init=self._init,
        decode=self._chunk, grow=self._grow, prefill_insert=self._prefill_insert,
        append=self.extender if self.config.episode_tokens else None)

  @functools.cached_property
  def extender(self) -> extend.Extender:
    """Appends to slots' caches (multi-turn episodes' next turns: rollout/engine/extend.py)."""
    return extend.Extender(self)

  def precompile(self) -> int:
    """Compiles ahead of time, with the parameters' placements of the first call (a no-op
    before it), every one of ``programs``; returns how many capacities and prompt shapes
    it compiled (not yet compiled ones).  A later call of a compiled shape finds it in
    jax's in-memory caches, so a new prompt width or prompt count mid-run does not
    compile."""
    if self._params_sig is None:
      return 0
    done = engine_programs.precompile(self.programs(self._params_sig), self._precompiled)
    self._precompiled |= done
    return len(done)

  def compile_counts(self) -> dict[str, int]:
    """How many executables each jitted entry point holds (a recompile shows up here)."""
    counts = {name: fn._cache_size() for name, fn in (
        ("init", self._init), ("grow", self._grow), ("decode_steps", self._chunk),
        ("generate", self._step),
        ("prefill_insert", self._prefill_insert), ("prefill", self._prefill),
        ("insert", self._insert), ("append", self.extender._fn))}
    counts["weight_sync"] = self._sync.compile_count() if self._sync is not None else 0
    counts["lora_sync"] = (self._adapter_sync.compile_count()
                           if self._adapter_sync is not None else 0)
    return counts
