"""What a node function sees: the run's config, plan, models and data layouts.

``RunContext`` is plain data plus a few caches of compiled functions; it
holds no control logic.  Every process builds an identical one from the same
config (the plan, the layouts, the compiled functions) with its own local
pieces (its rows of the batch, its loader shard, its rollout replica).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, Callable

import jax
import ml_collections
import numpy as np

from distflow_jax.config.response import response_width
from distflow_jax.dag import FUNCTIONS, replicas
from distflow_jax.dag.planner import LayoutKind, NodeLayout, Plan, Topology
from distflow_jax.dag.spec import Node, Role
from distflow_jax.data import layout as dlayout
from distflow_jax.data.batch import Batch
from distflow_jax.models import sharding
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.tokenizer import Tokenizer
from distflow_jax.rollout import episodes
from distflow_jax.rollout.backend import RolloutBackend, backend_factory
from distflow_jax.rollout.engine import EngineConfig, replica_mesh
from distflow_jax.rollout.engine.sampling import SamplingParams
from distflow_jax.rollout.spanning import SpanningReplica
from distflow_jax.state import roles as roles_lib, vision as vision_lib, warm_shapes
from distflow_jax.state.algo_state import AlgoState


@dataclasses.dataclass
class RunContext:
  cfg: ml_collections.ConfigDict
  plan: Plan
  topo: Topology
  process_index: int
  tokenizer: Tokenizer
  model_cfg: ModelConfig
  roles: dict[Role, roles_lib.ModelState]
  step: int = 0
  # The frozen vision tower of a vision-language run (state/vision.py), else None.
  vision: vision_lib.VisionEncoder | None = None
  # State that changes from step to step (saved with the checkpoint): see algo_state.py.
  algo_state: AlgoState = dataclasses.field(default_factory=AlgoState)
  _layouts: dict[NodeLayout, dlayout.Layout] = dataclasses.field(default_factory=dict)
  _backends: dict[Any, RolloutBackend] = dataclasses.field(default_factory=dict)
  _jitted: dict[Any, Callable] = dataclasses.field(default_factory=dict)
  # Calls of the jitted functions, to compile their other prompt widths (warm_shapes.py).
  shapes: warm_shapes.Recorder = dataclasses.field(default_factory=warm_shapes.Recorder)

  @property
  def metrics(self):
    # Node functions return their metrics; a plugin written against the old contract
    # (ctx.metrics.add(...)) gets this line instead of an AttributeError.
    raise AttributeError("RunContext has no metrics: a node function returns them, "
                         "nodes.common.NodeOut(batch, metrics) with a state.metrics.Metrics")

  @property
  def kl_coef(self) -> float | None:
    """The KL-in-reward coefficient once it has adapted (actor.kl.target > 0); None: the
    fixed actor.kl.coef."""
    return self.algo_state.kl_coef

  def section(self, node: Node, name: str) -> ml_collections.ConfigDict:
    """``config.<name>`` with the node's overrides applied (when it is the node's section)."""
    base = self.cfg[name]
    if FUNCTIONS.spec(node.fn).section != name or not node.overrides:
      return base
    merged = ml_collections.ConfigDict(base.to_dict())
    merged.update(dict(node.overrides))
    return merged

  def layout(self, plan_layout: NodeLayout) -> dlayout.Layout:
    """The data layout (mesh + sample axes) of a plan layout; cached per layout.

    A role's layout is that role's own mesh, rows over ``data`` and ``fsdp``: a program
    then takes its parameters and its batch on one mesh, which cuDNN's attention needs (its
    partitioner refuses a program whose shardings name two meshes).  Other layouts (the
    rollout's, or a role this run holds no model of) get a mesh of their own, rows over
    ``data``."""
    if plan_layout not in self._layouts:
      devs = roles_lib.ordered_devices()
      devices = [devs[i] for i in plan_layout.devices]
      self._layouts[plan_layout] = (self._role_layout(plan_layout, devices)
                                    or self._own_layout(plan_layout, devices))
    return self._layouts[plan_layout]

  def _role_layout(self, plan_layout: NodeLayout, devices: list) -> dlayout.Layout | None:
    if plan_layout.kind is not LayoutKind.ROLE_MESH or plan_layout.role not in self.roles:
      return None
    mesh = self.roles[plan_layout.role].mesh
    axes = tuple(a for a in sharding.BATCH_AXES if a in mesh.axis_names)
    if (list(mesh.devices.flat) != devices
        or math.prod(mesh.shape[a] for a in axes) != plan_layout.dp_size):
      return None  # a role built on other devices than the plan's (hand-made contexts)
    return dlayout.Layout(mesh, axes)

  @staticmethod
  def _own_layout(plan_layout: NodeLayout, devices: list) -> dlayout.Layout:
    rest = len(devices) // plan_layout.dp_size
    mesh = sharding.make_mesh({"data": plan_layout.dp_size, "tensor": rest}, devices)
    return dlayout.Layout(mesh, ("data",))

  def jitted(self, key: Any, make: Callable[[], Callable]) -> Callable:
    """A compiled function, built once per key (so shapes never recompile per step); its
    calls are recorded in ``shapes`` when it can be lowered ahead (``.lower``)."""
    if key not in self._jitted:
      fn = make()
      self._jitted[key] = (warm_shapes.Recorded(fn, key, self.shapes)
                           if hasattr(fn, "lower") else fn)
    return self._jitted[key]

  def backend(self, rollout: ml_collections.ConfigDict, greedy: bool = False,
              devices: list[jax.Device] | None = None) -> RolloutBackend:
    """This host's rollout replica for these rollout settings (built once), of the kind
    ``rollout.backend`` names (rollout/backend.py)."""
    # With rollout.env, a tool call's closing tag (one token or several) ends a turn too.
    conf = engine_config(self.cfg, rollout, tuple(self.tokenizer.eos_ids), greedy,
                         episodes.call_stops(rollout, self.tokenizer))
    name = rollout.backend
    make = backend_factory(name)  # refuses an unknown name, listing the valid ones
    key = (name, conf, rollout.tensor_parallel)
    if key not in self._backends:
      mine = set(self.rollout_devices())
      group = self.replica_processes(rollout.tensor_parallel)
      if devices is None and len(group) > 1:  # one replica over whole hosts (dag/replicas.py)
        local = [d for d in self.rollout_devices() if d.process_index in group]
      else:  # `devices`: another's (plan --lower builds process 0's replica anywhere)
        local = [d for d in (devices or jax.local_devices()) if d in mine]
      if self.cfg.trainer.deterministic:
        # One tensor-parallel group per host (no data-parallel split of the slots), so
        # the replica has the same shape whatever the host's device count.
        local = local[:rollout.tensor_parallel]
      backend = make(self.model_cfg, conf, replica_mesh(rollout.tensor_parallel, local))
      if devices is None and len(group) > 1:  # its processes pool their prompts
        backend = SpanningReplica(backend, group)
      self._backends[key] = backend
    return self._backends[key]

  def built_replicas(self) -> list[tuple[int, ...]]:
    """The processes each rollout replica built so far runs on (its mesh's devices')."""
    meshes = [getattr(b, "mesh", None) or getattr(getattr(b, "engine", None), "mesh", None)
              for b in self._backends.values()]
    return [tuple(sorted({d.process_index for d in m.devices.flat})) for m in meshes if m]

  def replica_processes(self, tensor_parallel: int, process: int | None = None
                        ) -> tuple[int, ...]:
    """The processes that drive ``process``'s (default this one's) rollout replica:
    itself alone unless the replica spans hosts (dag/replicas.py)."""
    process = jax.process_index() if process is None else process
    lay = self._rollout_layout()
    if lay is None:
      return (process,)
    groups = replicas.replica_groups(lay.devices, tensor_parallel, self.topo.process_of)
    return replicas.group_of(groups, process) or (process,)

  def rollout_devices(self) -> list[jax.Device]:
    """The rollout replicas' devices: the plan's rollout layout's (placement.rollout),
    else the actor's."""
    lay = self._rollout_layout()
    if lay is None:
      return list(self.roles[Role.ACTOR].mesh.devices.flat)
    devs = roles_lib.ordered_devices()
    return [devs[i] for i in lay.devices]

  def _rollout_layout(self) -> NodeLayout | None:
    plan = getattr(self, "plan", None)  # hand-made contexts (tests) may have none
    return next((s.layout for s in (plan.steps if plan is not None else ())
                 if s.layout.kind is LayoutKind.ROLLOUT), None)

  def precompile_rollouts(self) -> None:
    """Every rollout replica built so far compiles the shapes a later step may meet."""
    for backend in self._backends.values():
      backend.precompile()

  def step_rng(self, node: Node) -> jax.Array:
    """A key for this step and node, the same on every process: fold in global ids
    (e.g. sample ids) to draw per-sample streams."""
    key = jax.random.key(self.cfg.seed)
    key = jax.random.fold_in(key, self.step)
    return jax.random.fold_in(key, _stable_hash(node.id))


def engine_config(cfg: ml_collections.ConfigDict, rollout: ml_collections.ConfigDict,
                  stop_ids, greedy: bool = False, stop_sequences=()) -> EngineConfig:
  """The rollout replica's settings for these rollout settings (greedy: evaluation's): the
  section's own (``EngineConfig.from_config``) with the run's seed and deterministic mode and,
  for multi-turn episodes, the cache and the append programs (extend.py)."""
  conf = EngineConfig.from_config(rollout, stop_ids=stop_ids, seed=cfg.seed,
                                  stop_sequences=stop_sequences)
  return dataclasses.replace(
      conf, fixed_shapes=cfg.trainer.deterministic,
      episode_tokens=response_width(rollout) if rollout.env else 0,
      sampling=SamplingParams(temperature=0.0) if greedy else conf.sampling)


def shared_prompt_group(cfg: ml_collections.ConfigDict, num_rows: int, num_shards: int) -> int:
  """Rows per shared prompt in the sequence passes on a layout of `num_shards` shards: the
  group size (rollout.n) when model.share_prompt_prefix is on and every shard holds whole
  groups, else 1 (each row runs its own prompt).  Re-partitions into such a layout keep
  groups whole and in order (see train/hidden.py, "Shared prompts")."""
  n = cfg.rollout.n
  if not cfg.model.share_prompt_prefix or n <= 1 or num_rows % (num_shards * n):
    return 1
  return n


def _stable_hash(text: str) -> int:
  return zlib.crc32(text.encode()) & 0x7FFFFFFF


def put_local(batch: Batch, lay: dlayout.Layout, **local_arrays: np.ndarray) -> Batch:
  """Adds this process's rows of new fields to a global batch laid out as ``lay``."""
  return batch.replace(**{k: jax.make_array_from_process_local_data(lay.sharding, np.asarray(v))
                          for k, v in local_arrays.items()})
