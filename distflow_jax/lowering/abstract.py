"""A RunContext whose models are abstract: the run's meshes and layouts, no parameter.

``abstract_context`` builds the roles a run builds (state/roles.build_roles: actor
with its optimizer, reference, critic) with every parameter and optimizer-state leaf a
``ShapeDtypeStruct`` carrying the sharding the run gives it, on the plan's meshes of
(simulated) devices.  Node builders (nodes/passes.py, nodes/training.py) and the rollout
backends then make the very jitted functions a run makes, and ``catalogue`` lowers them
with abstract batches from ``batch_fields``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from distflow_jax.config import vision_checks
from distflow_jax.config.errors import ConfigError
from distflow_jax.dag.planner import Plan
from distflow_jax.dag.spec import NodeType, Role
from distflow_jax.data.fields import BASELINE_REWARDS, BASELINE_TOKENS, FIELDS
from distflow_jax.data.image_processor import ImageProcessor
from distflow_jax.memory import compiled as cp, report
from distflow_jax.models import sharding
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.heads import Critic
from distflow_jax.models.vision import VisionTower
from distflow_jax.models.vl import read_vl_config
from distflow_jax.state import roles as roles_lib, vision
from distflow_jax.state.context import RunContext
from distflow_jax.state.vision import VisionEncoder
from distflow_jax.tasks import registry, shapes
from distflow_jax.warmstart import vl as vl_warmstart


@dataclasses.dataclass(frozen=True)
class StopIds:
  """What the rollout needs of a tokenizer when only config.json is at hand."""
  eos_ids: tuple[int, ...]
  pad_id: int = 0
  path: str = ""

  def encode(self, text: str) -> list[int]:
    """Text cannot be tokenized without the tokenizer: the one thing a run needs it for
    here is a tool parser's closing tag (rollout.env), which shapes the decode program."""
    raise ConfigError(f"rollout.env: the tool parser's closing tag {text!r} needs the "
                      f"model's tokenizer, and model.path={self.path!r} has none (config.json "
                      f"only); point model.path at a folder with its tokenizer files")


def vl_config(cfg: ml_collections.ConfigDict) -> Any:
  """The run's Qwen2.5-VL config when its rows carry images (else None): the built-in tiny
  one (``model.path=builtin:tiny-vl``) or ``model.path``'s config.json."""
  if not vision_checks.run_image_key(cfg):
    return None
  if cfg.model.path == vl_warmstart.BUILTIN:
    return vl_warmstart.model_config(vl_warmstart.tokenizer(), cfg.model.dtype)
  if vision.is_vl_checkpoint(cfg.model.path):
    return read_vl_config(cfg.model.path, dtype=cfg.model.dtype)
  return None


def model_shape(cfg: ml_collections.ConfigDict) -> ModelConfig:
  """The (text) model's shape from config.json alone, the built-in tiny VL model's too."""
  if cfg.model.path == vl_warmstart.BUILTIN:
    return roles_lib.levers(cfg, vl_config(cfg).text)
  return report.model_shape(cfg)


def image_processor(vlc: Any) -> Any:
  """The image processor of a vision-language config's tower (patch, merge, frames)."""
  vc = vlc.vision
  return ImageProcessor(patch_size=vc.patch_size, merge_size=vc.spatial_merge_size,
                        temporal_patch_size=vc.temporal_patch_size)


def image_dims(cfg: ml_collections.ConfigDict, vlc: Any) -> tuple[int, int, tuple[int, ...]]:
  """``(image tokens per sample, feature width, one image's patch grid)``: a built-in
  ``shapes`` level's image size, else one 448 x 448 image (other data's images are
  sized by their rows; the gate lowers that size)."""
  side = 448
  if registry.is_builtin(cfg.data.train):
    task, level = registry.parse(cfg.data.train)
    if task.name == "shapes":
      side = shapes.PRESETS[level].size
  proc = image_processor(vlc)
  grid = proc.grid(side, side)
  return proc.num_image_tokens(grid), vlc.text.hidden_size, tuple(grid)


def stop_ids(cfg: ml_collections.ConfigDict) -> Any:
  """The run's tokenizer where it loads, else the end-of-sequence ids of ``model.path``'s
  config.json (a folder holding only config.json is enough to lower a run)."""
  if cfg.model.path == vl_warmstart.BUILTIN:
    return vl_warmstart.tokenizer()
  try:
    return roles_lib.load_tokenizer(cfg.model)
  except Exception:  # noqa: BLE001 - no tokenizer files: config.json's ids
    pass
  ids: Any = 0
  path = os.path.join(cfg.model.path or "", "config.json")
  if os.path.isfile(path):
    with open(path) as f:
      conf = json.load(f)
    ids = conf.get("eos_token_id", conf.get("text_config", {}).get("eos_token_id", 0))
  ids = ids if isinstance(ids, list) else [ids]
  return StopIds(tuple(int(i) for i in ids if i is not None) or (0,), path=cfg.model.path or "")


def _sds(x: Any, sh: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)


def _critic(model_cfg: ModelConfig, mesh) -> tuple[nnx.GraphDef, Any]:
  abstract = nnx.eval_shape(lambda: Critic(model_cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  shardings = sharding.state_shardings(state, mesh, sharding.fsdp_tp_rules())
  return graphdef, jax.tree.map(_sds, state, shardings)


def abstract_roles(cfg: ml_collections.ConfigDict, plan: Plan, model_cfg: ModelConfig
                   ) -> dict[Role, roles_lib.ModelState]:
  """The roles ``roles_lib.build_roles`` makes, abstract (a reward model is not built:
  its shape comes from another folder; ``catalogue`` says so)."""
  meshes = {m.role: roles_lib.jax_mesh(m) for m in plan.meshes}
  trained = {s.node.role for s in plan.steps if s.node.type is NodeType.MODEL_TRAIN}
  steps = cfg.trainer.total_steps * max(cfg.actor.ppo_epochs * cfg.actor.mini_batches, 1)
  out: dict[Role, roles_lib.ModelState] = {}
  graphdef, params = cp.abstract_model(model_cfg, meshes[Role.ACTOR])
  tx = roles_lib.optimizer(cfg, cfg.actor.optimizer, steps) if Role.ACTOR in trained else None
  opt = cp.abstract_opt_state(tx, params, meshes[Role.ACTOR]) if tx else None
  out[Role.ACTOR] = roles_lib.ModelState(Role.ACTOR, meshes[Role.ACTOR], graphdef, params,
                                         tx, opt)
  if Role.REFERENCE in meshes and model_cfg.lora is None:  # LoRA: the actor's base (roles)
    _, ref = cp.abstract_model(model_cfg, meshes[Role.REFERENCE])
    out[Role.REFERENCE] = roles_lib.ModelState(Role.REFERENCE, meshes[Role.REFERENCE],
                                               graphdef, ref)
  if Role.CRITIC in meshes:
    cgraph, cparams = _critic(model_cfg.replace(lora=None), meshes[Role.CRITIC])
    ctx_tx = (roles_lib.optimizer(cfg, cfg.critic.optimizer,
                                  cfg.trainer.total_steps * cfg.critic.ppo_epochs)
              if Role.CRITIC in trained else None)
    copt = cp.abstract_opt_state(ctx_tx, cparams, meshes[Role.CRITIC]) if ctx_tx else None
    out[Role.CRITIC] = roles_lib.ModelState(Role.CRITIC, meshes[Role.CRITIC], cgraph,
                                            cparams, ctx_tx, copt)
  return out


def abstract_context(cfg: ml_collections.ConfigDict, plan: Plan, model_cfg: ModelConfig
                     ) -> RunContext:
  """Process 0's RunContext of a run of ``cfg`` on ``plan``, its models abstract."""
  return RunContext(cfg=cfg, plan=plan, topo=plan.topology, process_index=0,
                    tokenizer=stop_ids(cfg), model_cfg=model_cfg,
                    roles=abstract_roles(cfg, plan, model_cfg), vision=_vision(cfg))


def _vision(cfg: ml_collections.ConfigDict) -> Any:
  """The frozen tower of a vision-language run, abstract (unsharded: it runs on each
  process's default device), else None."""
  vlc = vl_config(cfg)
  if vlc is None:
    return None
  graphdef, params = nnx.split(nnx.eval_shape(lambda: VisionTower(vlc.vision,
                                                                  rngs=nnx.Rngs(0))))
  return VisionEncoder(vlc, graphdef, params)


# What a registry "produces" name adds to the batch beyond itself: the rule rewards after
# generate.greedy add baseline_rewards.  Each field's trailing shape and dtype: data/fields.py
# ("P": prompt columns, "N": response columns, "PN": both, "I"/"D": image tokens / width).
PRODUCED = {BASELINE_TOKENS: (BASELINE_TOKENS, BASELINE_REWARDS)}


@dataclasses.dataclass(frozen=True)
class Dims:
  rows: int
  prompt: int
  new: int
  image_tokens: int = 0
  image_width: int = 0


def batch_fields(names, dims: Dims, layout: NamedSharding | None) -> dict[str, Any]:
  """``ShapeDtypeStruct``s of the named fields, rows sharded as ``layout``."""
  size = {"P": dims.prompt, "N": dims.new, "PN": dims.prompt + dims.new, "3": 3,
          "I": dims.image_tokens, "D": dims.image_width}
  out = {}
  for name in names:
    trail, dtype = FIELDS[name].trail, FIELDS[name].dtype
    shape = (dims.rows,) + tuple(size[k] for k in trail)
    out[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=layout)
  return out


def full_masks(rows: int, prompt: int, new: int) -> tuple[np.ndarray, np.ndarray]:
  """Masks of a batch whose every prompt and response fill their columns: the most
  packed rows a plan can need (packing and token-budget plans' shapes follow lengths)."""
  return np.ones((rows, prompt), bool), np.ones((rows, new), bool)


def replicated(tree: Any, mesh) -> Any:
  """A host plan (numpy) as ``ShapeDtypeStruct``s replicated on ``mesh``, as the nodes put
  it (nodes/pass_plan.placed_plan)."""
  rep = NamedSharding(mesh, P())
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype,
                                                     sharding=rep), tree)
