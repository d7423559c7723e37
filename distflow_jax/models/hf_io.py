"""Hugging Face checkpoints from / to a local directory (safetensors only).

    model = load_pretrained("/ckpt/qwen2.5-0.5b", mesh=mesh, rules=fsdp_tp_rules())
    save_pretrained("/out/actor", model, tokenizer=tok)   # loads in transformers

`load_pretrained` reads `config.json` and `model.safetensors` (or the shards
listed by `model.safetensors.index.json`, or every `*.safetensors`), and
builds every parameter directly in its sharding with
`jax.make_array_from_callback`: each device reads only its own slice from the
memory-mapped file, so no parameter is first gathered on one device.

Errors are `ModelFileError`s (a `ConfigError`: one line on the command line)
that name the culprit file: a missing tensor, a shape mismatch, an unexpected
tensor, an unknown architecture, a `config.json` that is not a JSON object or
lacks a key, a file that is not safetensors, or a pickle checkpoint (`*.bin`,
`*.pt`, ...: refused, never unpickled).  The shards an index lists must lie
inside the model folder: an absolute path or a `..` that leaves it is refused
(symlinks placed in the folder are followed, as Hugging Face's cache uses them).

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

With `scan_layers` a `layers/...` parameter is stacked `[L, ...]` (stacking.py):
it is read from, and written as, the L tensors `model.layers.{i}.*`.
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

from distflow_jax.models import stacking
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.errors import ModelFileError, ModelFileNotFoundError, read_json_object
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
    raise ModelFileError(f"refusing pickle checkpoint file(s) {[str(f) for f in bad]}: only "
                         "*.safetensors is accepted (convert with safetensors' convert script)")


def _shard_path(folder: Path, index: Path, tensor: Any, shard: Any) -> Path:
  """``folder / shard`` for one index entry; refuses a shard name that is not a plain
  relative path inside the folder (absolute, ``..`` leaving it, empty, not a string)."""
  entry = f"weight_map entry {tensor!r}: {shard!r}"
  if not isinstance(shard, str) or not shard.strip():
    raise ModelFileError(f"{index}: {entry} is not a file name")
  if os.path.isabs(shard) or Path(shard).is_absolute():
    raise ModelFileError(f"{index}: {entry} is an absolute path; shards must lie inside the "
                         f"model folder {folder}")
  # Lexical, not resolved: a symlink placed in the folder (Hugging Face's cache links each
  # snapshot file to ../../blobs) is the folder owner's doing, the index is only data.
  rel = os.path.normpath(shard)
  if rel in (os.curdir, os.pardir) or rel.startswith(os.pardir + os.sep):
    raise ModelFileError(f"{index}: {entry} points outside the model folder {folder}")
  return folder / rel


def _index_files(folder: Path, index: Path) -> list[Path]:
  weight_map = read_json_object(index, "safetensors index").get("weight_map")
  if not isinstance(weight_map, dict) or not weight_map:
    raise ModelFileError(f"{index}: needs a non-empty \"weight_map\" object "
                         f"{{tensor name: shard file}}")
  files = sorted({_shard_path(folder, index, tensor, shard)
                  for tensor, shard in weight_map.items()})
  _refuse_pickle(files)
  missing = [str(f) for f in files if not f.exists()]
  if missing:
    raise ModelFileNotFoundError(f"{index} lists missing shard file(s) {missing}")
  not_files = [str(f) for f in files if not f.is_file()]
  if not_files:
    raise ModelFileError(f"{index} lists shard(s) that are not files: {not_files}")
  return files


def _weight_files(path: Path) -> list[Path]:
  if path.is_file():
    _refuse_pickle([path])
    raise ModelFileError(f"{path} is a file; pass the checkpoint directory "
                         "(config.json + *.safetensors)")
  if not path.is_dir():
    raise ModelFileNotFoundError(f"checkpoint directory {path} does not exist")
  index = path / "model.safetensors.index.json"
  if index.exists():
    return _index_files(path, index)
  files = sorted(f for f in path.glob("*.safetensors") if f.is_file())
  if not files:
    _refuse_pickle(sorted(path.iterdir()))
    raise ModelFileNotFoundError(f"no *.safetensors file in {path}")
  return files


def _hf_config_dict(path: str | os.PathLike, what: str = "model config") -> tuple[Path, dict]:
  cfg_file = Path(path) / "config.json"
  if not cfg_file.exists():
    raise ModelFileNotFoundError(f"missing {cfg_file}")
  return cfg_file, read_json_object(cfg_file, what)


def _config_from_dict(cfg_file: Path, d: dict[str, Any], dtype: str | None) -> ModelConfig:
  try:
    return ModelConfig.from_hf_dict(d, dtype=dtype)
  except KeyError as e:
    raise ModelFileError(f"{cfg_file}: missing required key {e.args[0]!r}") from None
  except (ValueError, TypeError, AttributeError) as e:
    raise ModelFileError(f"{cfg_file}: {e}") from None


def read_config(path: str | os.PathLike, dtype: str | None = None) -> ModelConfig:
  """The ModelConfig of a local HF checkpoint directory's `config.json`."""
  cfg_file, d = _hf_config_dict(path)
  return _config_from_dict(cfg_file, d, dtype)


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
  cfg_file, d = _hf_config_dict(path, "reward model config")
  archs = d.get("architectures") or []
  if not isinstance(archs, list):
    raise ModelFileError(f"{cfg_file}: \"architectures\" must be a list, got {archs!r}")
  if archs and not any(str(a).endswith("ForSequenceClassification") for a in archs):
    raise ModelFileError(f"{cfg_file}: a reward model must be a *ForSequenceClassification "
                         f"checkpoint with num_labels=1, got architectures={archs}")
  labels = d.get("num_labels", len(d.get("id2label") or {"0": None}))
  if labels != 1:
    raise ModelFileError(f"{cfg_file}: a reward model has one output (num_labels=1), this one "
                         f"has {labels}")
  return _config_from_dict(cfg_file, d, dtype)


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
                 rules: Rules | None, ignorable: Sequence[str], what: str,
                 alias: Callable[[str], str] | None = None) -> Any:
  """Reads every parameter of ``make()``'s module from ``path``'s safetensors, each
  straight into its sharding; refuses missing, misshapen and unexpected tensors.
  ``alias`` maps a file's tensor name to the name ``name_of`` gives (another layout of
  the same checkpoint)."""
  files = _weight_files(path)
  rules = rules or no_sharding()
  graphdef, abstract_state = nnx.split(nnx.eval_shape(make))
  alias = alias or (lambda name: name)
  with contextlib.ExitStack() as stack:
    handles = [(f, stack.enter_context(_open_safetensors(f))) for f in files]
    where = {alias(name): (f, h, name) for f, h in handles for name in h.keys()}
    used = set()
    flat = []
    for key, var in nnx.to_flat_state(abstract_state):
      p, aval = path_str(key), var.get_value()
      # A stacked parameter (scan_layers) is read from its L per-layer tensors.
      stacked = stacking.stacked_path(p)
      paths = [stacking.layer_path(p, i) for i in range(aval.shape[0])] if stacked else [p]
      shape = aval.shape[1:] if stacked else aval.shape
      readers = [_tensor_reader(where, files, path, q, name_of(q), shape, aval.dtype, used)
                 for q in paths]
      sharding = (SingleDeviceSharding(jax.local_devices()[0]) if mesh is None else
                  NamedSharding(mesh, spec_for(p, aval.shape, rules, mesh)))

      def read(index, readers=readers, stacked=stacked):
        return (np.stack([readers[i](index[1:]) for i in range(len(readers))[index[0]]])
                if stacked else readers[0](index))

      flat.append((key, var.replace(jax.make_array_from_callback(aval.shape, sharding, read))))
    skip = set(n for n in where if n.endswith(_IGNORED)) | set(ignorable)
    extra = sorted(set(where) - used - skip)
    if extra:
      raise ModelFileError(f"unexpected tensor(s) {extra[:8]} in {path} for {what} "
                           f"(wrong config.json?)")
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _tensor_reader(where: dict, files: Sequence[Path], folder: Path, p: str,
                   hf: tuple[str, bool], shape: tuple, dtype: Any, used: set
                   ) -> Callable[[tuple], np.ndarray]:
  """A reader of index slices of parameter `p`'s tensor, checked present and of `shape`."""
  name, transposed = hf
  if name not in where:
    raise ModelFileError(f"missing tensor {name!r} (for parameter {p}) in "
                         f"{[str(f) for f in files]}")
  f, h, stored = where[name]
  tensor = h.get_slice(stored)
  want = tuple(reversed(shape)) if transposed else tuple(shape)
  if tuple(tensor.get_shape()) != want:
    raise ModelFileError(f"shape mismatch for tensor {stored!r} in {f}: file has "
                         f"{tuple(tensor.get_shape())}, config {folder / 'config.json'} "
                         f"needs {want}")
  used.add(name)

  def read(index):
    try:
      if transposed:
        return np.asarray(tensor[tuple(reversed(index))]).T.astype(dtype)
      return np.asarray(tensor[index]).astype(dtype)
    except Exception as e:  # pylint: disable=broad-except  (an unreadable dtype, say)
      raise ModelFileError(f"{f}: cannot read tensor {stored!r}: {e}") from None
  return read


def _open_safetensors(f: Path) -> Any:
  try:
    return safe_open(str(f), framework="numpy")
  except Exception as e:  # pylint: disable=broad-except  (SafetensorError is not exported)
    raise ModelFileError(f"{f} is not a readable safetensors file (truncated or another "
                         f"format?): {e}") from None


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
    p, value = path_str(key), _host_array(var.get_value())
    layers = ([(stacking.layer_path(p, i), value[i]) for i in range(value.shape[0])]
              if stacking.stacked_path(p) else [(p, value)])
    for q, v in layers:
      name, transposed = name_of(q)
      out[name] = np.ascontiguousarray(v.T if transposed else v)
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
