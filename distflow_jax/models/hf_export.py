"""Writing models as Hugging Face checkpoints (safetensors only) that `transformers` loads.

`export_state_dict` gathers a model's parameters to the host under their HF names
(kernels transposed to `[out, in]`, stacked `scan_layers` parameters written as their L
per-layer tensors; see hf_names); `save_pretrained` writes a causal LM's `config.json`,
`model.safetensors`, the tokenizer's files and a `generation_config.json`, and
`save_reward_model` a `*ForSequenceClassification` checkpoint with one label.  Both are
collective: every process calls them, process 0 writes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from distflow_jax import io_errors
from distflow_jax.models import stacking
from distflow_jax.models.heads import RewardModel
from distflow_jax.models.hf_names import expert_path, experts_path, hf_name, reward_hf_name
from distflow_jax.models.sharding import path_str
from distflow_jax.models.transformer import Transformer


def _host_array(x: jax.Array) -> np.ndarray:
  if not x.is_fully_addressable:
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


def export_state_dict(model: nnx.Module, name_of: Callable[[str], tuple[str, bool]] = hf_name
                      ) -> dict[str, np.ndarray]:
  """The HF-named `{tensor: numpy array}` of a model (kernels transposed to `[out, in]`);
  `name_of=reward_hf_name` for a `RewardModel`."""
  out = {}
  for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    p, value = path_str(key), _host_array(var.get_value())
    layers = ([(stacking.layer_path(p, i), value[i]) for i in range(value.shape[0])]
              if stacking.stacked_path(p) else [(p, value)])
    for q, v in layers:
      # A MoE experts parameter [E, ...] is written as its E per-expert tensors.
      slices = ([(expert_path(q, e), v[e]) for e in range(v.shape[0])] if experts_path(q)
                else [(q, v)])
      for r, w in slices:
        name, transposed = name_of(r)
        out[name] = np.ascontiguousarray(w.T if transposed else w)
  return out


def save_pretrained(path: str | os.PathLike, model: Transformer, tokenizer: Any = None,
                    extra_config: dict[str, Any] | None = None) -> None:
  """Writes `config.json` + `model.safetensors` (+ the tokenizer's files) for `transformers`.

  Every process must call it (sharded parameters are gathered collectively);
  only process 0 writes.
  """
  state = export_state_dict(model)
  if jax.process_index() != 0:
    return
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  ids = {}
  if tokenizer is not None:
    ids = dict(eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.bos_id)
    tokenizer.save(path)
    # So that transformers' generate() stops where our rollout does.
    gen = dict(tokenizer.generation_config, eos_token_id=list(tokenizer.eos_ids),
               pad_token_id=tokenizer.pad_id, bos_token_id=tokenizer.bos_id)
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
  hf_cfg = model.cfg.to_hf_dict(**ids)
  hf_cfg.update(extra_config or {})
  (path / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
  write_safetensors(path, state)


def write_safetensors(folder: Path, state: dict[str, np.ndarray]) -> None:
  """``folder/model.safetensors``, tagged "pt" as transformers expects; a full disk names
  that file (safetensors' own error, from Rust, names none)."""
  with io_errors.writing(folder / "model.safetensors"):
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def save_reward_model(path: str | os.PathLike, model: RewardModel, tokenizer: Any = None) -> None:
  """Writes `model` as a `*ForSequenceClassification` checkpoint with num_labels=1 (loads in
  `transformers.AutoModelForSequenceClassification`).  Collective, like `save_pretrained`."""
  state = export_state_dict(model, reward_hf_name)
  if jax.process_index() != 0:
    return
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  hf_cfg = model.cfg.to_hf_dict()
  hf_cfg["architectures"] = [hf_cfg["architectures"][0].replace("ForCausalLM",
                                                                "ForSequenceClassification")]
  hf_cfg.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
  if tokenizer is not None:
    tokenizer.save(path)
    hf_cfg.update(pad_token_id=tokenizer.pad_id, eos_token_id=tokenizer.eos_id,
                  bos_token_id=tokenizer.bos_id)
  (path / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
  write_safetensors(path, state)
