"""The rollout engine: JetStream's Engine API on our transformer, with KV-cache slots and
continuous batching.

    from distflow_jax.rollout.engine import Engine, EngineConfig, replica_mesh

    engine = Engine(model_cfg, EngineConfig(max_concurrent_decodes=16, prefill_buckets=(32, 64),
                                            max_new_tokens=64, stop_ids=(eos,)),
                    mesh=replica_mesh())
    params = engine.update_params(actor_params)   # training layout -> the engine's

Modules: core (``Engine``: prefill, insert, generate over slots; compile counts), config
(``EngineConfig``, placement, the compute dtype), programs (every program the engine
compiles, listed and precompiled), decode (the pure prefill / insert / multi-step decode
functions), prefill_rows (prompt counts a prefill compiles for), cache_growth (the cache's
capacities), extend (continuing a slot with more tokens: multi-turn episodes), results
(``ResultTokens``), sampling (greedy / temperature / top-k / top-p, per-request keys).
The driver that feeds it (continuous batching for RL) is rollout/driver.py; the backends
that choose it, rollout/backend.py.
"""

from distflow_jax.rollout.engine.config import (CpuCompute, EngineConfig, FuseProjections,
                                                LoraSync, replica_mesh)
from distflow_jax.rollout.engine.core import Engine
from distflow_jax.rollout.engine.results import ResultTokens, SlotData
from distflow_jax.rollout.engine.sampling import SamplingParams

__all__ = ["CpuCompute", "Engine", "EngineConfig", "FuseProjections", "LoraSync",
           "ResultTokens", "SamplingParams", "SlotData", "replica_mesh"]
