"""Reading and validating a Hugging Face checkpoint folder: `config.json` and its weight files.

This module owns what is checked before any tensor is read: the folder's `config.json`
(a JSON object with the keys `ModelConfig` needs; a reward model's `architectures` and
`num_labels`), and the list of safetensors files: `model.safetensors`, the shards listed
by `model.safetensors.index.json`, or every `*.safetensors`.  The shards an index lists
must lie inside the model folder: an absolute path or a `..` that leaves it is refused
(symlinks placed in the folder are followed, as Hugging Face's cache uses them).  A
pickle checkpoint (`*.bin`, `*.pt`, ...) is refused, never unpickled, and a file that is
not safetensors is refused when opened.  Every refusal is a `ModelFileError` (a
`ConfigError`: one line on the command line) naming the culprit file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from safetensors import safe_open

from distflow_jax.models.config import ModelConfig
from distflow_jax.models.errors import ModelFileError, ModelFileNotFoundError, read_json_object

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


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


def weight_files(path: Path) -> list[Path]:
  """The safetensors files of checkpoint folder `path` (its index's shards, else every
  `*.safetensors`); refuses a file path, a missing folder and pickle checkpoints."""
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


def hf_config_dict(path: str | os.PathLike, what: str = "model config") -> tuple[Path, dict]:
  """`(path / "config.json", its JSON object)`; refuses a missing or non-object file."""
  cfg_file = Path(path) / "config.json"
  if not cfg_file.exists():
    raise ModelFileNotFoundError(f"missing {cfg_file}")
  return cfg_file, read_json_object(cfg_file, what)


def config_from_dict(cfg_file: Path, d: dict[str, Any], dtype: str | None) -> ModelConfig:
  """The ModelConfig of config dict `d`; a missing key or bad value names `cfg_file`."""
  try:
    return ModelConfig.from_hf_dict(d, dtype=dtype)
  except KeyError as e:
    raise ModelFileError(f"{cfg_file}: missing required key {e.args[0]!r}") from None
  except (ValueError, TypeError, AttributeError) as e:
    raise ModelFileError(f"{cfg_file}: {e}") from None


def read_config(path: str | os.PathLike, dtype: str | None = None) -> ModelConfig:
  """The ModelConfig of a local HF checkpoint directory's `config.json`."""
  cfg_file, d = hf_config_dict(path)
  return config_from_dict(cfg_file, d, dtype)


def read_reward_config(path: str | os.PathLike, dtype: str | None = None) -> ModelConfig:
  """The backbone config of a `*ForSequenceClassification` checkpoint with one label."""
  cfg_file, d = hf_config_dict(path, "reward model config")
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
  return config_from_dict(cfg_file, d, dtype)


def open_safetensors(f: Path) -> Any:
  """safetensors' numpy reader of `f`; refuses a file that is not safetensors."""
  try:
    return safe_open(str(f), framework="numpy")
  except Exception as e:  # pylint: disable=broad-except  (SafetensorError is not exported)
    raise ModelFileError(f"{f} is not a readable safetensors file (truncated or another "
                         f"format?): {e}") from None

