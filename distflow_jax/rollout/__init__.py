"""Rollout: a JetStream-style decode engine and the RL batch-generation driver.

    from distflow_jax.rollout import Engine, EngineConfig, SamplingParams, generate

    engine = Engine(model_cfg, EngineConfig(max_concurrent_decodes=16, prefill_buckets=(32, 64),
                                            max_new_tokens=64, stop_ids=(eos,),
                                            sampling=SamplingParams(temperature=1.0)))
    params = engine.update_params(actor_params)     # training layout -> rollout layout
    out = generate(engine, params, prompts, n=4, rng=key)

    backend = make_backend("engine", model_cfg, engine_config)   # or "reference"
    out = backend.generate(backend.update_weights(actor_params), prompts, n=4, rng=key)

Modules: engine/ (the package: JetStream Engine API + batched extensions, placement,
compile counts, sampling, the pure decode functions; its __init__ is its API), driver
(continuous batching for RL), backend (engine | reference | jetstream, by name),
weight_sync (training layout -> rollout layout), episodes (multi-turn), spanning (a
replica over several hosts), jetstream_adapter (optional registration with JetStream).  The
`distflow-jax generate` command is distflow_jax/commands/generate.py.
"""

from distflow_jax.rollout.backend import (BACKENDS, EngineBackend, RolloutBackend, RolloutResult,
                                          make_backend)
from distflow_jax.rollout.driver import Rollout, generate
from distflow_jax.rollout.engine import Engine, EngineConfig, ResultTokens, replica_mesh
from distflow_jax.rollout.reference import ReferenceSampler
from distflow_jax.rollout.engine.sampling import SamplingParams

__all__ = ["BACKENDS", "Engine", "EngineBackend", "EngineConfig", "ReferenceSampler",
           "ResultTokens", "Rollout", "RolloutBackend", "RolloutResult", "SamplingParams",
           "generate", "make_backend", "replica_mesh"]
