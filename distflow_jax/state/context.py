"""What a node function sees: the run's config (its typed view), plan, models and data layouts.

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

from distflow_jax.config import declare
from distflow_jax.config.run_sections import Config
from distflow_jax.dag import FUNCTIONS
from distflow_jax.dag.planner import LayoutKind, NodeLayout, Plan, Topology
from distflow_jax.dag.spec import Node, Role
from distflow_jax.data import layout as dlayout
from distflow_jax.data.batch import Batch
from distflow_jax.models import sharding
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.tokenizer import Tokenizer
from distflow_jax.state import roles as roles_lib, vision as vision_lib, warm_shapes
from distflow_jax.state.algo_state import AlgoState
from distflow_jax.state.replicas import RolloutReplicas


@dataclasses.dataclass
class RunContext:
  # The run's config as its typed, frozen view (config/run_sections.Config): given a loaded
  # ml_collections config, the context builds the view once.
  cfg: Config
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
  _jitted: dict[Any, Callable] = dataclasses.field(default_factory=dict)
  _sections: dict[Any, Any] = dataclasses.field(default_factory=dict)
  # Calls of the jitted functions, to compile their other prompt widths (warm_shapes.py).
  shapes: warm_shapes.Recorder = dataclasses.field(default_factory=warm_shapes.Recorder)
  # This host's rollout replicas (state/replicas.py), built on first use.
  replicas: RolloutReplicas | None = None

  def __post_init__(self) -> None:
    if isinstance(self.cfg, ml_collections.ConfigDict):
      self.cfg = declare.view(Config, self.cfg)
    if self.replicas is None:
      actor = self.roles.get(Role.ACTOR)
      self.replicas = RolloutReplicas(self.cfg, self.plan, self.topo, self.model_cfg,
                                      self.tokenizer,
                                      list(actor.mesh.devices.flat) if actor else [])

  @property
  def metrics(self):
    # Node functions return their metrics; a plugin written against the old contract
    # (ctx.metrics.add(...)) gets this line instead of an AttributeError.
    raise AttributeError("RunContext has no metrics: a node function returns them, "
                         "nodes.common.NodeOut(batch, metrics) with a state.metrics.Metrics")

  @property
  def backend(self):
    # The rollout replicas are a service of their own now; a plugin written against the old
    # ctx.backend(rollout) gets this line instead of an AttributeError.
    raise AttributeError("RunContext.backend moved: ask the rollout replicas, "
                         "ctx.replicas.backend(rollout) (state/replicas.py)")

  @property
  def kl_coef(self) -> float | None:
    """The KL-in-reward coefficient once it has adapted (actor.kl.target > 0); None: the
    fixed actor.kl.coef."""
    return self.algo_state.kl_coef

  def section(self, node: Node, name: str) -> Any:
    """``config.<name>`` with the node's overrides applied (when it is the node's section)."""
    base = getattr(self.cfg, name)
    if FUNCTIONS.spec(node.fn).section != name or not node.overrides:
      return base
    key = ("section", node.id, name)
    if key not in self._sections:
      self._sections[key] = declare.replaced(base, node.overrides)
    return self._sections[key]

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

  def step_rng(self, node: Node) -> jax.Array:
    """A key for this step and node, the same on every process: fold in global ids
    (e.g. sample ids) to draw per-sample streams."""
    key = jax.random.key(self.cfg.seed)
    key = jax.random.fold_in(key, self.step)
    return jax.random.fold_in(key, _stable_hash(node.id))


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
