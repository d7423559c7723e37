"""The `engine` rollout backend: `engine.Engine` driven by `driver.generate`.

Its own module so that backends built on it (jetstream_backend.py) import it without
importing the backend table (backend.py), which imports them only when chosen.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh

from distflow_jax.models import sharding as msharding
from distflow_jax.models.config import ModelConfig
from distflow_jax.rollout import driver
from distflow_jax.rollout.engine import Engine
from distflow_jax.rollout.engine.config import EngineConfig


class EngineBackend:
  """The `engine` backend: `engine.Engine` driven by `driver.generate`, unchanged."""

  name = "engine"

  def __init__(self, model_cfg: ModelConfig, config: EngineConfig, mesh: Mesh | None = None,
               rules: msharding.Rules | None = None, *, engine: Engine | None = None):
    self.engine = engine if engine is not None else Engine(model_cfg, config, mesh, rules)

  @classmethod
  def wrap(cls, engine: Engine) -> "EngineBackend":
    """The backend over an existing engine (shares its compiles and weight sync)."""
    return cls(engine.model_cfg, engine.config, engine=engine)

  @property
  def config(self) -> EngineConfig:
    return self.engine.config

  @property
  def sync_bytes(self) -> int:
    return self.engine.sync_bytes

  def load_params(self, params: nnx.State | nnx.Module | None = None) -> nnx.State:
    return self.engine.load_params(params)

  def update_weights(self, train_params: nnx.State) -> nnx.State:
    return self.engine.update_params(train_params)

  def generate(self, params: Any, prompts: Sequence[Sequence[int]], n: int = 1, *,
               rng: jax.Array | None = None, request_ids: Sequence[int] | None = None,
               pad_id: int = 0, max_new_tokens: int | None = None) -> driver.Rollout:
    return driver.generate(self.engine, params, prompts, n, max_new_tokens=max_new_tokens,
                           rng=rng, pad_id=pad_id, request_ids=request_ids)

  def precompile(self) -> None:
    self.engine.precompile()

  def sync_programs(self, train_params: Any, process_of=None) -> list:
    return self.engine.sync_programs(train_params, process_of)
