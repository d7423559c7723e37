"""Hugging Face checkpoints from / to a local directory (safetensors only).

    model = load_pretrained("/ckpt/qwen2.5-0.5b", mesh=mesh, rules=fsdp_tp_rules())
    save_pretrained("/out/actor", model, tokenizer=tok)   # loads in transformers

`load_pretrained` reads `config.json` and `model.safetensors` (or the shards
listed by `model.safetensors.index.json`, or every `*.safetensors`), and
builds every parameter directly in its sharding with
`jax.make_array_from_callback`: each device reads only its own slice from the
memory-mapped file, so no parameter is first gathered on one device.

Errors name the culprit: a missing tensor, a shape mismatch, an unexpected
tensor, an unknown architecture, or a pickle checkpoint (`*.bin`, `*.pt`,
...: refused, never unpickled).

Parameter path -> HF tensor name (kernels are stored transposed, `[out, in]`):

    embed/embedding                      model.embed_tokens.weight
    layers/i/input_norm/scale            model.layers.i.input_layernorm.weight
    layers/i/attn/{q,k,v,o}_proj/kernel  model.layers.i.self_attn.{q,k,v,o}_proj.weight
    layers/i/attn/{q,k,v}_proj/bias      model.layers.i.self_attn.{q,k,v}_proj.bias
    layers/i/attn/{q,k}_norm/scale       model.layers.i.self_attn.{q,k}_norm.weight
    layers/i/post_attn_norm/scale        model.layers.i.post_attention_layernorm.weight
    layers/i/mlp/{gate,up,down}_proj/kernel  model.layers.i.mlp.{...}_proj.weight
    final_norm/scale                     model.norm.weight
    lm_head/kernel                       lm_head.weight
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from distflow_jax.models.config import ModelConfig
from distflow_jax.models.heads import RewardModel
from distflow_jax.models.sharding import Rules, no_sharding, path_str, spec_for
from distflow_jax.models.transformer import Transformer

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_IGNORED = ("rotary_emb.inv_freq",)
_RENAMES = (("input_norm/scale", "input_layernorm.weight"),
            ("post_attn_norm/scale", "post_attention_layernorm.weight"),
            ("attn/", "self_attn."), ("/kernel", ".weight"), ("/scale", ".weight"),
            ("/bias", ".bias"))


def hf_name(path: str) -> tuple[str, bool]:
  """(HF tensor name, stored transposed?) of one of our parameter paths."""
  if path == "embed/embedding":
    return "model.embed_tokens.weight", False
  if path == "final_norm/scale":
    return "model.norm.weight", False
  if path == "lm_head/kernel":
    return "lm_head.weight", True
  if not path.startswith("layers/"):
    raise ValueError(f"parameter {path!r} has no Hugging Face name")
  name = path
  for ours, theirs in _RENAMES:
    name = name.replace(ours, theirs)
  return "model." + name.replace("/", "."), path.endswith("/kernel")


def _refuse_pickle(files: Sequence[Path]) -> None:
  bad = [f for f in files if f.suffix in PICKLE_SUFFIXES]
  if bad:
    raise ValueError(f"refusing pickle checkpoint file(s) {[str(f) for f in bad]}: only "
                     "*.safetensors is accepted (convert with safetensors' convert script)")


def _weight_files(path: Path) -> list[Path]:
  if path.is_file():
    _refuse_pickle([path])
    raise ValueError(f"{path} is a file; pass the checkpoint directory (config.json + *.safetensors)")
  if not path.is_dir():
    raise FileNotFoundError(f"checkpoint directory {path} does not exist")
  index = path / "model.safetensors.index.json"
  if index.exists():
    names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    files = [path / n for n in names]
    _refuse_pickle(files)
    missing = [str(f) for f in files if not f.exists()]
    if missing:
      raise FileNotFoundError(f"{index} lists missing shard file(s) {missing}")
    return files
  files = sorted(path.glob("*.safetensors"))
  if not files:
    _refuse_pickle(sorted(path.iterdir()))
    raise FileNotFoundError(f"no *.safetensors file in {path}")
  return files


def read_config(path: str | os.PathLike, dtype: str | None = None) -> ModelConfig:
  """The ModelConfig of a local HF checkpoint directory's `config.json`."""
  cfg_file = Path(path) / "config.json"
  if not cfg_file.exists():
    raise FileNotFoundError(f"missing {cfg_file}")
  try:
    return ModelConfig.from_hf_dict(json.loads(cfg_file.read_text()), dtype=dtype)
  except (KeyError, ValueError) as e:
    raise ValueError(f"{cfg_file}: {e}") from e


def load_pretrained(path: str | os.PathLike, mesh: Mesh | None = None,
                    rules: Rules | None = None, dtype: str | None = None,
                    cfg: ModelConfig | None = None) -> Transformer:
  """Loads a Llama / Qwen2 / Qwen3 safetensors checkpoint straight into its shardings.

  Without a mesh every parameter lands on the first local device.  `dtype`
  overrides the config's (`float32` for parity checks, say).
  """
  _weight_files(Path(path))  # a pickle checkpoint is refused before anything else
  cfg = cfg or read_config(path, dtype)
  ignorable = ("lm_head.weight",) if cfg.tie_embeddings else ()
  return _load_module(Path(path), lambda: Transformer(cfg, rngs=nnx.Rngs(0)), hf_name, mesh,
                      rules, ignorable, f"a {cfg.arch} model with {cfg.num_layers} layers")


def reward_hf_name(path: str) -> tuple[str, bool]:
  """(HF tensor name, transposed?) of a `RewardModel` parameter (`*ForSequenceClassification`)."""
  if path == "score/kernel":
    return "score.weight", True
  if not path.startswith("backbone/"):
    raise ValueError(f"reward-model parameter {path!r} has no Hugging Face name")
  return hf_name(path[len("backbone/"):])


def read_reward_config(path: str | os.PathLike, dtype: str | None = None) -> ModelConfig:
  """The backbone config of a `*ForSequenceClassification` checkpoint with one label."""
  cfg_file = Path(path) / "config.json"
  if not cfg_file.exists():
    raise FileNotFoundError(f"reward model: missing {cfg_file}")
  d = json.loads(cfg_file.read_text())
  archs = d.get("architectures") or []
  if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
    raise ValueError(f"{cfg_file}: a reward model must be a *ForSequenceClassification "
                     f"checkpoint with num_labels=1, got architectures={archs}")
  labels = d.get("num_labels", len(d.get("id2label") or {"0": None}))
  if labels != 1:
    raise ValueError(f"{cfg_file}: a reward model has one output (num_labels=1), this one has "
                     f"{labels}")
  return read_config(path, dtype)


def load_reward_model(path: str | os.PathLike, mesh: Mesh | None = None,
                      rules: Rules | None = None, dtype: str | None = None) -> RewardModel:
  """Loads a `*ForSequenceClassification` (num_labels=1) checkpoint: backbone + `score`."""
  _weight_files(Path(path))
  cfg = read_reward_config(path, dtype)
  return _load_module(Path(path), lambda: RewardModel(cfg, rngs=nnx.Rngs(0)), reward_hf_name,
                      mesh, rules, ("lm_head.weight",),
                      f"a {cfg.arch} reward model with {cfg.num_layers} layers")


def _load_module(path: Path, make: Callable[[], nnx.Module],
                 name_of: Callable[[str], tuple[str, bool]], mesh: Mesh | None,
                 rules: Rules | None, ignorable: Sequence[str], what: str) -> Any:
  """Reads every parameter of ``make()``'s module from ``path``'s safetensors, each
  straight into its sharding; refuses missing, misshapen and unexpected tensors."""
  files = _weight_files(path)
  rules = rules or no_sharding()
  graphdef, abstract_state = nnx.split(nnx.eval_shape(make))
  with contextlib.ExitStack() as stack:
    handles = [(f, stack.enter_context(safe_open(str(f), framework="numpy"))) for f in files]
    where = {name: (f, h) for f, h in handles for name in h.keys()}
    used = set()
    flat = []
    for key, var in nnx.to_flat_state(abstract_state):
      p, aval = path_str(key), var.get_value()
      name, transposed = name_of(p)
      if name not in where:
        raise ValueError(f"missing tensor {name!r} (for parameter {p}) in {[str(f) for f in files]}")
      f, h = where[name]
      tensor = h.get_slice(name)
      want = tuple(reversed(aval.shape)) if transposed else tuple(aval.shape)
      if tuple(tensor.get_shape()) != want:
        raise ValueError(f"shape mismatch for tensor {name!r} in {f}: file has "
                         f"{tuple(tensor.get_shape())}, config {path / 'config.json'} needs {want}")
      used.add(name)
      sharding = (SingleDeviceSharding(jax.local_devices()[0]) if mesh is None else
                  NamedSharding(mesh, spec_for(p, aval.shape, rules, mesh)))

      def read(index, tensor=tensor, transposed=transposed, dtype=aval.dtype):
        if transposed:
          return np.asarray(tensor[tuple(reversed(index))]).T.astype(dtype)
        return np.asarray(tensor[index]).astype(dtype)

      flat.append((key, var.replace(jax.make_array_from_callback(aval.shape, sharding, read))))
    skip = set(n for n in where if n.endswith(_IGNORED)) | set(ignorable)
    extra = sorted(set(where) - used - skip)
    if extra:
      raise ValueError(f"unexpected tensor(s) {extra[:8]} in {path} for {what} "
                       f"(wrong config.json?)")
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _host_array(x: jax.Array) -> np.ndarray:
  if not x.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


def export_state_dict(model: nnx.Module, name_of: Callable[[str], tuple[str, bool]] = hf_name
                      ) -> dict[str, np.ndarray]:
  """The HF-named `{tensor: numpy array}` of a model (kernels transposed to `[out, in]`);
  `name_of=reward_hf_name` for a `RewardModel`."""
  out = {}
  for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    name, transposed = name_of(path_str(key))
    value = _host_array(var.get_value())
    out[name] = np.ascontiguousarray(value.T if transposed else value)
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
  save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


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
  save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
