"""This host's rollout replicas: one per rollout settings, built on first use.

The plan places the rollout (``placement.rollout``: the actor's devices, or devices of
its own); a replica is a rollout backend (rollout/backend.py: the engine, the no-cache
reference sampler or JetStream) on one tensor-parallel group of those devices, or one
group spanning whole hosts whose processes pool their prompts (dag/replicas.py,
rollout/spanning.py).  The run's context holds one ``RolloutReplicas`` as a service;
the generate node, the evaluation and ``plan --lower`` ask it for a backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from distflow_jax.config import response
from distflow_jax.config.run_sections import Config
from distflow_jax.dag import replicas
from distflow_jax.dag.planner import LayoutKind, NodeLayout, Plan, Topology
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.tokenizer import Tokenizer
from distflow_jax.rollout import episodes
from distflow_jax.rollout.backend import RolloutBackend, backend_factory
from distflow_jax.rollout.engine import EngineConfig, replica_mesh
from distflow_jax.rollout.engine.sampling import SamplingParams
from distflow_jax.rollout.spanning import SpanningReplica
from distflow_jax.state import roles as roles_lib


@dataclasses.dataclass
class RolloutReplicas:
  cfg: Config
  plan: Plan | None             # None (hand-made, in tests): the actor's devices
  topo: Topology | None
  model_cfg: ModelConfig
  tokenizer: Tokenizer
  actor_devices: list[jax.Device]
  _built: dict[Any, RolloutBackend] = dataclasses.field(default_factory=dict)

  def backend(self, rollout: Any, greedy: bool = False,
              devices: list[jax.Device] | None = None) -> RolloutBackend:
    """This host's replica for these rollout settings (a rollout section, built once), of
    the kind ``rollout.backend`` names; ``devices``: build it on another's devices
    (``plan --lower`` builds process 0's replica anywhere)."""
    # With rollout.env, a tool call's closing tag (one token or several) ends a turn too.
    conf = engine_config(self.cfg, rollout, tuple(self.tokenizer.eos_ids), greedy,
                         episodes.call_stops(rollout, self.tokenizer))
    name = rollout.backend
    make = backend_factory(name)  # refuses an unknown name, listing the valid ones
    key = (name, conf, rollout.tensor_parallel)
    if key not in self._built:
      mine = set(self.devices())
      group = self.processes(rollout.tensor_parallel)
      if devices is None and len(group) > 1:  # one replica over whole hosts
        local = [d for d in self.devices() if d.process_index in group]
      else:
        local = [d for d in (devices or jax.local_devices()) if d in mine]
      if self.cfg.trainer.deterministic:
        # One tensor-parallel group per host (no data-parallel split of the slots), so
        # the replica has the same shape whatever the host's device count.
        local = local[:rollout.tensor_parallel]
      backend = make(self.model_cfg, conf, replica_mesh(rollout.tensor_parallel, local))
      if devices is None and len(group) > 1:  # its processes pool their prompts
        backend = SpanningReplica(backend, group)
      self._built[key] = backend
    return self._built[key]

  def built(self) -> list[tuple[int, ...]]:
    """The processes each replica built so far runs on (its mesh's devices')."""
    meshes = [getattr(b, "mesh", None) or getattr(getattr(b, "engine", None), "mesh", None)
              for b in self._built.values()]
    return [tuple(sorted({d.process_index for d in m.devices.flat})) for m in meshes if m]

  def processes(self, tensor_parallel: int, process: int | None = None) -> tuple[int, ...]:
    """The processes that drive ``process``'s (default this one's) replica: itself alone
    unless the replica spans hosts (dag/replicas.py)."""
    process = jax.process_index() if process is None else process
    lay = self._layout()
    if lay is None:
      return (process,)
    groups = replicas.replica_groups(lay.devices, tensor_parallel, self.topo.process_of)
    return replicas.group_of(groups, process) or (process,)

  def devices(self) -> list[jax.Device]:
    """The replicas' devices: the plan's rollout layout's (placement.rollout), else the
    actor's."""
    lay = self._layout()
    if lay is None:
      return list(self.actor_devices)
    devs = roles_lib.ordered_devices()
    return [devs[i] for i in lay.devices]

  def _layout(self) -> NodeLayout | None:
    return next((s.layout for s in (self.plan.steps if self.plan is not None else ())
                 if s.layout.kind is LayoutKind.ROLLOUT), None)

  def precompile(self) -> None:
    """Every replica built so far compiles the shapes a later step may meet."""
    for backend in self._built.values():
      backend.precompile()


def engine_config(cfg: Config, rollout: Any, stop_ids, greedy: bool = False,
                  stop_sequences=()) -> EngineConfig:
  """The replica's settings for these rollout settings (greedy: evaluation's): the
  section's own (``EngineConfig.from_config``) with the run's seed and deterministic mode
  and, for multi-turn episodes, the cache and the append programs (extend.py)."""
  conf = EngineConfig.from_config(rollout, stop_ids=stop_ids, seed=cfg.seed,
                                  stop_sequences=stop_sequences)
  return dataclasses.replace(
      conf, fixed_shapes=cfg.trainer.deterministic,
      episode_tokens=response.response_width(rollout) if rollout.env else 0,
      sampling=SamplingParams(temperature=0.0) if greedy else conf.sampling)
