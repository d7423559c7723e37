"""Hugging Face checkpoints from / to a local directory (safetensors only).

    model = load_pretrained("/ckpt/qwen2.5-0.5b", mesh=mesh, rules=fsdp_tp_rules())
    save_pretrained("/out/actor", model, tokenizer=tok)   # loads in transformers

`load_pretrained` reads `config.json` and `model.safetensors` (or the shards
listed by `model.safetensors.index.json`, or every `*.safetensors`), and
builds every parameter directly in its sharding with
`jax.make_array_from_callback`: each device reads only its own slice from the
memory-mapped file, so no parameter is first gathered on one device.

This module owns that loading (causal LMs and reward models): a missing tensor, a shape
mismatch or an unexpected tensor is a `ModelFileError` (a `ConfigError`: one line on the
command line) naming the file.  The folder's checks (an unknown architecture, a
`config.json` that is not a JSON object or lacks a key, a file that is not safetensors, a
pickle checkpoint, index shards outside the folder) are hf_files', the tensor names
hf_names' and the writing hf_export's; the names callers take from here (`read_config`,
`hf_name`, `save_pretrained`, `export_state_dict`, ...) still import from hf_io.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from distflow_jax.models import stacking
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.errors import ModelFileError
from distflow_jax.models.heads import RewardModel
from distflow_jax.models.hf_export import (  # noqa: F401 (re-exported)
    export_state_dict, save_pretrained, save_reward_model)
from distflow_jax.models.hf_files import (open_safetensors, read_config, read_reward_config,
                                         weight_files)
from distflow_jax.models.hf_names import expert_path, experts_path, hf_name, reward_hf_name
from distflow_jax.models.sharding import Rules, no_sharding, path_str, spec_for
from distflow_jax.models.transformer import Transformer

_IGNORED = ("rotary_emb.inv_freq",)


def load_pretrained(path: str | os.PathLike, mesh: Mesh | None = None,
                    rules: Rules | None = None, dtype: str | None = None,
                    cfg: ModelConfig | None = None) -> Transformer:
  """Loads a Llama / Qwen2 / Qwen3 safetensors checkpoint straight into its shardings.

  Without a mesh every parameter lands on the first local device.  `dtype`
  overrides the config's (`float32` for parity checks, say).
  """
  weight_files(Path(path))  # a pickle checkpoint is refused before anything else
  cfg = cfg or read_config(path, dtype)
  ignorable = ("lm_head.weight",) if cfg.tie_embeddings else ()
  return _load_module(Path(path), lambda: Transformer(cfg, rngs=nnx.Rngs(0)), hf_name, mesh,
                      rules, ignorable, f"a {cfg.arch} model with {cfg.num_layers} layers")


def load_reward_model(path: str | os.PathLike, mesh: Mesh | None = None,
                      rules: Rules | None = None, dtype: str | None = None) -> RewardModel:
  """Loads a `*ForSequenceClassification` (num_labels=1) checkpoint: backbone + `score`."""
  weight_files(Path(path))
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
  files = weight_files(path)
  rules = rules or no_sharding()
  graphdef, abstract_state = nnx.split(nnx.eval_shape(make))
  alias = alias or (lambda name: name)
  with contextlib.ExitStack() as stack:
    handles = [(f, stack.enter_context(open_safetensors(f))) for f in files]
    where = {alias(name): (f, h, name) for f, h in handles for name in h.keys()}
    used = set()
    flat = []
    for key, var in nnx.to_flat_state(abstract_state):
      p, aval = path_str(key), var.get_value()
      # A stacked parameter (scan_layers) is read from its L per-layer tensors.
      stacked = stacking.stacked_path(p)
      paths = [stacking.layer_path(p, i) for i in range(aval.shape[0])] if stacked else [p]
      shape = aval.shape[1:] if stacked else aval.shape
      readers = [_param_reader(where, files, path, q, name_of, shape, aval.dtype, used)
                 for q in paths]
      sharding = (SingleDeviceSharding(jax.local_devices()[0]) if mesh is None else
                  NamedSharding(mesh, spec_for(p, aval.shape, rules, mesh)))

      def read(index, readers=readers, stacked=stacked):
        return (np.stack([readers[i](index[1:]) for i in range(len(readers))[index[0]]])
                if stacked else readers[0](index))

      # dtype: a process holding no device of the mesh (an asynchronous run's rollout
      # processes) reads nothing and still needs it.
      flat.append((key, var.replace(jax.make_array_from_callback(aval.shape, sharding, read,
                                                                 dtype=aval.dtype))))
    skip = set(n for n in where if n.endswith(_IGNORED)) | set(ignorable)
    extra = sorted(set(where) - used - skip)
    if extra:
      raise ModelFileError(f"unexpected tensor(s) {extra[:8]} in {path} for {what} "
                           f"(wrong config.json?)")
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _param_reader(where: dict, files: Sequence[Path], folder: Path, p: str,
                  name_of: Callable[[str], tuple[str, bool]], shape: tuple, dtype: Any,
                  used: set) -> Callable[[tuple], np.ndarray]:
  """A reader of index slices of parameter `p` (loop layout): one tensor's, or for a MoE
  experts parameter `[E, ...]` the stack of its E per-expert tensors (hf_names)."""
  if not experts_path(p):
    return _tensor_reader(where, files, folder, p, name_of(p), shape, dtype, used)
  experts = [_tensor_reader(where, files, folder, q, name_of(q), shape[1:], dtype, used)
             for q in (expert_path(p, e) for e in range(shape[0]))]
  return lambda index: np.stack([experts[e](index[1:]) for e in range(shape[0])[index[0]]])


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
        out = np.asarray(tensor[tuple(reversed(index))]).T.astype(dtype)
      else:
        out = np.asarray(tensor[index]).astype(dtype)
    except Exception as e:  # pylint: disable=broad-except  (an unreadable dtype, say)
      raise ModelFileError(f"{f}: cannot read tensor {stored!r}: {e}") from None
    _check_finite(out, f"tensor {stored!r} in {f} (model folder {folder})")
    return out
  return read


def _check_finite(x: np.ndarray, what: str) -> None:
  """Refuses NaN / inf weights as they are read (one pass over the host copy, which the
  read has just made): such a model evaluates to accuracy 0 and generates nothing, silently."""
  if not np.issubdtype(x.dtype, np.inexact) and "float" not in str(x.dtype):
    return  # integer buffers (none today) cannot be non-finite
  finite = np.isfinite(x if x.dtype.itemsize >= 4 else x.astype(np.float32))
  if not finite.all():
    bad = x.size - int(np.count_nonzero(finite))
    raise ModelFileError(f"{what} holds {bad} non-finite value(s) (NaN or inf) of {x.size}; "
                         f"the weights are corrupt or diverged: use another checkpoint")

