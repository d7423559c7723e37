"""Role states: each role's mesh, parameters and optimizer, built from the plan.

Global device ``d`` of the plan is the ``d``-th device in process-major
order, the same order the planner's topology uses, so every process maps
the plan onto the same physical devices.  Parameters are created (or loaded
from safetensors) straight into their shardings on the role's mesh.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import ml_collections
import optax
from flax import nnx
from jax.sharding import Mesh

from distflow_jax.config.errors import ConfigError
from distflow_jax.dag.planner import Plan, RoleMesh, Topology
from distflow_jax.dag.spec import NodeType, Role
from distflow_jax.models import (attention_choice, config as model_configs, hf_io, lora, peft_files,
                                 sharding, target)
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.heads import Critic
from distflow_jax.models.lora_layer import LoraSpec
from distflow_jax.models.tokenizer import Tokenizer
from distflow_jax.models.transformer import Transformer
from distflow_jax.models.vl import read_vl_config
from distflow_jax.state import vision
from distflow_jax.train import optim, placement


def ordered_devices() -> list[jax.Device]:
  return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def check_topology(topo: Topology) -> None:
  devs = ordered_devices()
  if len(devs) != topo.num_devices:
    raise ConfigError(f"the plan is for {topo.num_devices} devices but jax has {len(devs)}")
  for i, d in enumerate(devs):
    if d.process_index != topo.process_of(i):
      raise ConfigError(f"device {i} belongs to process {d.process_index}, but the plan "
                        f"expects process {topo.process_of(i)}: uneven devices per process?")


def jax_mesh(role_mesh: RoleMesh) -> Mesh:
  devs = ordered_devices()
  return sharding.make_mesh(role_mesh.shape, [devs[i] for i in role_mesh.devices])


@dataclasses.dataclass
class ModelState:
  """One role's model: its graph, parameters on its mesh, and optimizer (if trained)."""
  role: Role
  mesh: Mesh
  graphdef: nnx.GraphDef
  params: nnx.State
  tx: optax.GradientTransformation | None = None
  opt_state: Any = None

  @property
  def trainable(self) -> bool:
    return self.tx is not None


def load_tokenizer(model_cfg: ml_collections.ConfigDict) -> Tokenizer:
  if model_cfg.path:
    return Tokenizer.from_dir(model_cfg.path)
  return Tokenizer.builtin()


def model_config(cfg: ml_collections.ConfigDict, tokenizer: Tokenizer,
                 path: str | None = None) -> ModelConfig:
  """The model's shape: ``path``'s config.json (default ``model.path``), else the built-in
  ``model.preset`` (models.config.PRESETS) sized to the tokenizer."""
  path = path if path is not None else cfg.model.path
  if path:
    if not os.path.isfile(os.path.join(path, "config.json")):
      raise ConfigError(f"model.path={path!r} has no config.json: point it at a local "
                        f"Hugging Face model directory (config.json + *.safetensors)")
    if vision.is_vl_checkpoint(path):  # the text decoder's shape; the tower: state/vision
      out = levers(cfg, read_vl_config(path, dtype=cfg.model.dtype).text)
    else:
      out = levers(cfg, hf_io.read_config(path, dtype=cfg.model.dtype))
    if tokenizer is not None and tokenizer.vocab_size > out.vocab_size:  # ids past the rows
      raise ConfigError(f"{path}: the tokenizer has {tokenizer.vocab_size} ids but the model's "
                        f"embedding has {out.vocab_size} rows (config.json vocab_size): ids past "
                        f"them have no embedding; use the tokenizer saved with this model")
    return out
  if cfg.model.preset not in model_configs.PRESETS:
    raise ConfigError(f"model.preset={cfg.model.preset!r} is unknown; built-in: "
                      f"{model_configs.preset_names()} (or set model.path to a local Hugging "
                      f"Face directory)")
  return levers(cfg, model_configs.preset(cfg.model.preset, tokenizer.vocab_size,
                                          cfg.model.dtype))


def model_config_before_weights(cfg: ml_collections.ConfigDict) -> ModelConfig | None:
  """``model_config`` from config.json alone (a folder) or the preset and the built-in
  tokenizer, with its checks (LoRA against the layers, ...): what plan and train check
  before any weights or warm start.  None where the folder is made at start-up (the
  built-in vision-language model)."""
  if cfg.model.path and not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
    return None
  return model_config(cfg, None if cfg.model.path else load_tokenizer(cfg.model))


def levers(cfg: ml_collections.ConfigDict, model_cfg: ModelConfig) -> ModelConfig:
  """``model_cfg`` with the config's memory and compile levers (model.scan_layers, remat,
  attention_impl, attention_block): how the model runs, not what it computes."""
  m = cfg.model
  out = model_cfg.replace(scan_layers=bool(m.scan_layers),
                          remat=m.remat,
                          attention_impl=m.attention_impl,
                          attention_block=m.attention_block,
                          lora=LoraSpec.from_config(m.lora))
  if out.lora is not None:
    lora.check(out.lora, out)  # the targets and rank against this model's layers
  if out.attention_impl == "cudnn":  # refused here, not at the first step's compile
    why = attention_choice.cudnn_refusal(out.jnp_dtype, out.head_dim, target.current())
    if why is not None:
      raise ConfigError(f"model.attention_impl=cudnn: {why}; set model.attention_impl=auto "
                        f"(it takes cuDNN wherever cuDNN can serve the model)")
  return out


def build_actor(model_cfg: ModelConfig, mesh: Mesh, path: str, seed: int) -> nnx.Module:
  """The actor from ``path`` (else fresh from ``seed``); with ``model_cfg.lora`` the same
  base plus fresh adapters (models/lora.py)."""
  rules = sharding.fsdp_tp_rules()
  base_cfg = model_cfg.replace(lora=None)
  if path and vision.is_vl_checkpoint(path):
    if model_cfg.lora is not None:
      raise ConfigError("model.lora: LoRA on a vision-language model is not built yet; set "
                        "model.lora.enabled=False")
    return vision.load_language(path, model_cfg, mesh, rules)
  if path:
    base = hf_io.load_pretrained(path, mesh=mesh, rules=rules, cfg=base_cfg)
  else:
    base = sharding.create_sharded(lambda: Transformer(base_cfg, rngs=nnx.Rngs(seed)), mesh,
                                   rules)
  if model_cfg.lora is None:
    return base
  return lora.attach(base, model_cfg.lora, seed, mesh, rules)


def start_adapters(cfg: ml_collections.ConfigDict, actor: nnx.Module) -> None:
  """``model.lora.path``: the adapters a run starts from (a PEFT LoRA folder), set in place.
  Its r / lora_alpha must be model.lora.rank / alpha and it must adapt exactly the modules
  model.lora.targets names, at this model's shapes; otherwise one line naming the file."""
  path = cfg.model.lora.path
  if not (cfg.model.lora.enabled and path):
    return
  where = f"model.lora.path={path!r}"
  meta = peft_files.read_meta(path)
  spec = actor.cfg.lora
  if (meta.rank, float(meta.alpha)) != (spec.rank, float(spec.alpha)):
    raise ConfigError(f"{where}: {os.path.join(path, peft_files.CONFIG)} has r={meta.rank}, "
                      f"lora_alpha={meta.alpha:g} but model.lora.rank={spec.rank}, "
                      f"model.lora.alpha={spec.alpha:g}; set --config.model.lora.rank="
                      f"{meta.rank} --config.model.lora.alpha={meta.alpha:g} to continue it")
  expected = lora.adapter_shapes(actor)
  arrays, _ = peft_files.read_adapter(path, expected)
  missing = sorted(set(expected) - set(arrays))
  if missing:
    shorts = sorted({m.rsplit(".", 1)[-1] for m in missing})
    raise ConfigError(f"{where}: {os.path.join(path, peft_files.WEIGHTS)} has no adapter for "
                      f"{len(missing)} module(s) model.lora.targets="
                      f"{list(spec.targets)} adapts (e.g. {missing[0]!r}; {', '.join(shorts)}); "
                      f"set model.lora.targets to the adapter's target_modules "
                      f"{meta.target_modules!r}")
  _check_base(cfg, path, meta.base_model_name_or_path)
  lora.set_adapter_arrays(actor, arrays)


def _check_base(cfg: ml_collections.ConfigDict, path: str, base: str | None) -> None:
  """An adapter trained on another base of the same shapes (an instruct model's adapter on
  its base model, say) is refused where both name a model and the names differ."""
  model = cfg.model.path
  if not (base and model and cfg.model.lora.base_check):
    return
  if peft_files.model_name(base) != peft_files.model_name(model):
    raise ConfigError(f"model.lora.path={path!r}: {os.path.join(path, peft_files.CONFIG)} was "
                      f"trained on base_model_name_or_path={base!r}, but model.path={model!r} "
                      f"names another model ({peft_files.model_name(base)!r} vs "
                      f"{peft_files.model_name(model)!r}); start from that base, or add "
                      f"--config.model.lora.base_check=False if the folder is that model "
                      f"under another name")


def load_reward_model(path: str, mesh: Mesh, dtype: str, tokenizer: Tokenizer) -> nnx.Module:
  """The ``reward.model`` node's scorer from ``reward.model_path``, checked against the
  actor's tokenizer: the node scores the actor's token ids as they are."""
  if not path:
    raise ConfigError("a 'reward.model' node needs config.reward.model_path: a local "
                      "*ForSequenceClassification checkpoint (num_labels=1, safetensors)")
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise ConfigError(f"reward.model_path={path!r} has no config.json: point it at a local "
                      f"Hugging Face reward model directory")
  try:
    rm = hf_io.load_reward_model(path, mesh, sharding.fsdp_tp_rules(), dtype)
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(f"reward.model_path={path!r}: {e}") from e
  if rm.cfg.vocab_size < tokenizer.vocab_size:
    raise ConfigError(f"reward.model_path={path!r}: its vocabulary ({rm.cfg.vocab_size}) is "
                      f"smaller than the actor tokenizer's ({tokenizer.vocab_size}); the reward "
                      f"model must share the actor's tokenizer")
  if os.path.isfile(os.path.join(path, "tokenizer.json")):
    if not Tokenizer.from_dir(path).same_ids(tokenizer):
      raise ConfigError(f"reward.model_path={path!r}: its tokenizer differs from the actor's; "
                        f"the reward model scores the actor's token ids, so both must use the "
                        f"same tokenizer (re-tokenizing for another one is not implemented)")
  return rm


def optimizer(cfg: ml_collections.ConfigDict, section: ml_collections.ConfigDict,
              total_steps: int) -> optax.GradientTransformation:
  """A role's optimizer; in deterministic mode without its clip, which the deterministic
  step applies itself on the replicated gradient (train/deterministic.py)."""
  if cfg.trainer.deterministic:
    section = {**section.to_dict(), "grad_clip": 0.0}
  tx = optim.from_config(section, total_steps)
  adapters = cfg.model.lora.enabled  # float32 already: no master copy
  if cfg.model.master_weights and cfg.model.dtype != "float32" and not adapters:
    tx = optim.with_master_weights(tx)  # float32 master params + moments for 16-bit params
  return tx


def _shares_buffers(x: jax.Array, y: jax.Array) -> bool:
  """Whether ``x`` holds any of ``y``'s device buffers."""
  pointers = {s.data.unsafe_buffer_pointer() for s in y.addressable_shards}
  return any(s.data.unsafe_buffer_pointer() in pointers for s in x.addressable_shards)


def build_roles(cfg: ml_collections.ConfigDict, plan: Plan, model_cfg: ModelConfig,
                model_path: str, tokenizer: Tokenizer) -> dict[Role, ModelState]:
  """Actor (+ optimizer), reference (frozen copy), critic (+ value head), reward model, as
  the plan needs."""
  meshes = {m.role: jax_mesh(m) for m in plan.meshes}
  trained = {s.node.role for s in plan.steps if s.node.type is NodeType.MODEL_TRAIN}
  rules = sharding.fsdp_tp_rules()
  steps = cfg.trainer.total_steps * max(cfg.actor.ppo_epochs * cfg.actor.mini_batches, 1)
  out: dict[Role, ModelState] = {}
  actor = build_actor(model_cfg, meshes[Role.ACTOR], model_path, cfg.seed)
  start_adapters(cfg, actor)
  graphdef, params = nnx.split(actor)
  tx = optimizer(cfg, cfg.actor.optimizer, steps) if Role.ACTOR in trained else None
  out[Role.ACTOR] = ModelState(Role.ACTOR, meshes[Role.ACTOR], graphdef, params, tx,
                               placement.init_opt_state(tx, params) if tx else None)
  # LoRA: the reference is the actor's base, its adapters off (nodes/passes.py): no copy.
  if Role.REFERENCE in meshes and model_cfg.lora is None:
    ref_mesh = meshes[Role.REFERENCE]
    ref = jax.device_put(params, sharding.state_shardings(params, ref_mesh, rules))
    # Own buffers: the actor's train step donates its own.  device_put reuses a buffer
    # where a shard lands where it already is (every leaf on the same mesh, and replicated
    # leaves on the same devices under another mesh shape).
    ref = jax.tree.map(lambda r, a: r.copy() if _shares_buffers(r, a) else r, ref, params)
    out[Role.REFERENCE] = ModelState(Role.REFERENCE, ref_mesh, graphdef, ref)
  if Role.CRITIC in meshes:
    cmesh = meshes[Role.CRITIC]
    # A LoRA actor's critic has no adapters: fully trained from the actor's base.
    critic = sharding.create_sharded(
        lambda: Critic(model_cfg.replace(lora=None), rngs=nnx.Rngs(cfg.seed + 1)), cmesh, rules)
    cgraph, cparams = nnx.split(critic)
    # The critic's backbone starts from the actor's (base) weights, its value head fresh.
    base = lora.split_trainable(params)[1] if model_cfg.lora is not None else params
    backbone = jax.device_put(base, sharding.state_shardings(base, cmesh, rules))
    cparams["backbone"] = jax.tree.map(lambda x: x.copy(), backbone)
    steps_c = cfg.trainer.total_steps * cfg.critic.ppo_epochs
    ctx = optimizer(cfg, cfg.critic.optimizer, steps_c) if Role.CRITIC in trained else None
    out[Role.CRITIC] = ModelState(Role.CRITIC, cmesh, cgraph, cparams, ctx,
                                  placement.init_opt_state(ctx, cparams) if ctx else None)
  if Role.REWARD in meshes and any(s.node.fn == "reward.model" for s in plan.steps):
    rm = load_reward_model(cfg.reward.model_path, meshes[Role.REWARD], cfg.model.dtype,
                           tokenizer)
    rgraph, rparams = nnx.split(rm)
    out[Role.REWARD] = ModelState(Role.REWARD, meshes[Role.REWARD], rgraph, rparams)
  return out
