"""The rollout-backend seam: what a node needs from a generator, and the table of backends.

    backend = make_backend(cfg.rollout.backend, model_cfg, EngineConfig(...), mesh)
    params = backend.update_weights(actor_params)   # training layout -> the backend's
    out = backend.generate(params, prompts, n=4, rng=key, request_ids=sample_ids)

A `RolloutBackend` syncs weights and generates `n` responses per prompt,
returning a `RolloutResult` (`driver.Rollout`: tokens, mask, untruncated
log-probs at the sampling temperature, sampling log-probs, lengths, stopped).  Request r
draws from `fold_in(rng, request_ids[r])` in every backend, so backends are
interchangeable sample for sample (up to float rounding).

`BACKENDS`, chosen by the config key `rollout.backend`:

* `engine`: the JetStream-API engine (`engine.Engine`: prefill / insert /
  generate over slots with a KV cache) driven by `driver.generate`;
* `reference`: `reference.ReferenceSampler`, a full forward pass per token
  and no cache; slow, the tests' oracle for the engine;
* `jetstream`: `jetstream_backend.JetStreamBackend`, JetStream's own
  orchestrator serving the same engine (needs google-jetstream; refused in
  one line without it).  `engine` stays the default: same samples, no
  orchestrator threads or per-token host syncs, no TensorFlow dependency.

A new backend (another inference server, say) is a class with this
protocol's methods and a constructor `(model_cfg, config, mesh)`, added to
`BACKENDS`.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import jax
from flax import nnx
from jax.sharding import Mesh

from distflow_jax.config.errors import ConfigError
from distflow_jax.models.config import ModelConfig
from distflow_jax.rollout import driver
from distflow_jax.rollout.engine_backend import EngineBackend
from distflow_jax.rollout.engine.config import EngineConfig
from distflow_jax.rollout.reference import ReferenceSampler

# What every backend's `generate` returns.
RolloutResult = driver.Rollout


@runtime_checkable
class RolloutBackend(Protocol):
  """A rollout generator: weight sync plus batch generation (see module doc)."""

  name: str
  config: EngineConfig  # sampling, stop ids, max_new_tokens, prompt-length limit, seed
  sync_bytes: int       # what the last update_weights resharded (whole arrays' bytes)

  def load_params(self, params: nnx.State | nnx.Module | None = None) -> Any:
    """A model (or its state) placed for this backend; random init when None."""

  def update_weights(self, train_params: nnx.State) -> Any:
    """The actor's parameters, in their training layout, as this backend's parameters."""

  def generate(self, params: Any, prompts: Sequence[Sequence[int]], n: int = 1, *,
               rng: jax.Array | None = None, request_ids: Sequence[int] | None = None,
               pad_id: int = 0, max_new_tokens: int | None = None) -> RolloutResult:
    """`n` responses per prompt; row r answers prompt r // n (see `driver.generate`)."""

  def precompile(self) -> None:
    """Compiles now every shape a later `generate` may meet (after the first call)."""

  def sync_programs(self, train_params: Any, process_of=None) -> list:
    """The programs `update_weights` runs for (abstract, sharded) `train_params`, as
    `engine.programs.Program`s (`plan --lower` lowers them for a target device)."""


# (model_cfg, config, mesh) -> backend.
BackendFactory = Callable[[ModelConfig, EngineConfig, Mesh | None], RolloutBackend]

def _jetstream_backend(model_cfg: ModelConfig, config: EngineConfig,
                       mesh: Mesh | None = None) -> RolloutBackend:
  """The `jetstream` entry: imports JetStream only when chosen."""
  try:
    from distflow_jax.rollout.jetstream_backend import JetStreamBackend  # pylint: disable=C0415
  except ImportError as e:
    raise ConfigError("rollout.backend=jetstream needs the google-jetstream package: pip "
                      "install 'distflow-jax[jetstream]'") from e
  return JetStreamBackend(model_cfg, config, mesh)


BACKENDS: dict[str, BackendFactory] = {
    "engine": EngineBackend,
    "reference": ReferenceSampler,
    "jetstream": _jetstream_backend,
}


def backend_factory(name: str) -> BackendFactory:
  """The table entry for `rollout.backend`; one clear error naming the valid ones."""
  if not isinstance(name, str) or name not in BACKENDS:
    raise ConfigError(f"rollout.backend={name!r} is unknown; valid: {', '.join(BACKENDS)}")
  return BACKENDS[name]


def make_backend(name: str, model_cfg: ModelConfig, config: EngineConfig,
                 mesh: Mesh | None = None) -> RolloutBackend:
  """A `name` backend (a key of `BACKENDS`) for `model_cfg` with `config` on `mesh`."""
  return backend_factory(name)(model_cfg, config, mesh)

