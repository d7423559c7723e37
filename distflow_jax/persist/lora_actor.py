"""A LoRA run's actor from its checkpoint: the base it trained on plus the saved adapters.

A LoRA checkpoint holds the adapters only, with the fingerprint of the frozen base they
were trained on (``checkpoint_contents.base_fingerprint``).  ``load`` finds that base
where the run took it -- its ``model.path``; else the built-in preset's warm start cached
in the run directory (``<run_dir>/warmstart*``, train's default) and the preset fresh from
the run's seed (sft's default) -- rebuilds it as the run did (the checkpoint's model
config: dtype, ``scan_layers``), puts the saved adapters on and compares fingerprints: a
base that is not the one the adapters were trained on is refused in one line naming it.
Single process, on the first local device (export, and eval / generate from a run).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
from flax import nnx

from distflow_jax.config.errors import ConfigError
from distflow_jax.models import lora, sharding
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.transformer import Transformer
from distflow_jax.persist import actor_arrays
from distflow_jax.persist.checkpoint_contents import CheckpointError, adapters_base_fingerprint
from distflow_jax.state import roles

WARMSTART = "warmstart"


@dataclasses.dataclass
class LoraActor:
  """The rebuilt actor (base + adapters), its spec and where its base came from."""
  model: Transformer
  base_path: str  # "" = the built-in preset fresh from the run's seed
  base_fingerprint: str

  @property
  def merged(self) -> Transformer:
    """The actor with ``W + a @ b * alpha / r`` in each target and no adapters."""
    return lora.merged_model(self.model)

  def linear_modules(self) -> list[str]:
    """Every projection of the model an adapter could target, by HF module name."""
    return lora.linear_modules(self.model.cfg)


def is_lora(meta: dict[str, Any]) -> bool:
  """Whether a checkpoint's actor trained LoRA adapters (its saved model config says)."""
  mc = meta.get("model_config") or {}
  return bool(mc.get("lora"))


def _candidates(meta: dict[str, Any], root: str) -> list[str]:
  """The bases to try, in order: ``model.path``; else the run dir's warm starts, then the
  preset fresh from seed ("")."""
  cfg = meta.get("config") or {}
  start = (cfg.get("model") or {}).get("path") or ""
  if start:
    return [start]
  out: list[str] = []
  for run_dir in (os.path.dirname(os.path.abspath(root)), cfg.get("run_dir") or ""):
    if run_dir and os.path.isdir(run_dir):
      for name in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, name)
        if (name.startswith(WARMSTART) and os.path.isfile(os.path.join(path, "config.json"))
            and path not in out):
          out.append(path)
  return out + [""]


def _with_adapters(base_path: str, model_cfg: ModelConfig, seed: int) -> Transformer:
  """The base at ``base_path`` (or the preset fresh from ``seed``) plus adapters, built as
  the run built its actor (``roles.build_actor``) on the first local device; the adapters'
  values are set from the checkpoint next."""
  mesh = sharding.make_mesh({"data": 1}, jax.local_devices()[:1])
  return roles.build_actor(model_cfg, mesh, base_path, seed)


def _describe(path: str, meta: dict[str, Any]) -> str:
  if path:
    return path
  cfg = meta.get("config") or {}
  return (f"the built-in preset {(cfg.get('model') or {}).get('preset')!r} fresh from "
          f"seed {meta.get('seed')}")


def load(arrays: dict[str, Any], meta: dict[str, Any], where: str, root: str) -> LoraActor:
  """The actor of a LoRA checkpoint (``checkpoint.read_arrays``' ``arrays`` and ``meta``
  of ``root``, its checkpoints directory) on its base; `CheckpointError` (one line) when
  the base cannot be found or is not the one the adapters were trained on."""
  model_cfg = ModelConfig(**meta["model_config"])
  saved = meta.get("lora_base")
  seed = int(meta.get("seed") or 0)
  tried = []
  for path in _candidates(meta, root):
    if path and not os.path.isfile(os.path.join(path, "config.json")):
      raise CheckpointError(f"{where}: its LoRA adapters were trained on the base model at "
                            f"model.path={path!r}, which holds no config.json now; put that "
                            f"folder back at the same path to rebuild the actor")
    try:
      model = _with_adapters(path, model_cfg, seed)
    except ConfigError as e:  # a folder of another shape: not this run's base
      tried.append(f"{_describe(path, meta)} ({str(e).splitlines()[0][:160]})")
      continue
    found = adapters_base_fingerprint(nnx.split(model)[1])
    if saved is None or found == saved:
      model = actor_arrays.fill(model, arrays, where, f"LoRA adapters of {model_cfg.arch}, "
                                f"{model_cfg.num_layers} layers",
                                select=lambda v: isinstance(v, nnx.LoRAParam))
      return LoraActor(model, path, found or "")
    tried.append(f"{_describe(path, meta)} (fingerprint {found})")
  raise CheckpointError(f"{where}: its LoRA adapters were trained on a base with fingerprint "
                        f"{saved}, and no base found matches: tried {'; '.join(tried)}; put "
                        f"the run's starting model back where it was")
