"""PEFT LoRA adapter folders (``adapter_config.json`` + ``adapter_model.safetensors``).

Arrays are ours: ``{HF module name: (a, b)}``, ``a`` of shape ``(d_in, r)``, ``b`` of
``(r, d_out)``, float32, so that ``y = x @ W + x @ a @ b * alpha / r`` with ``W`` of
``(d_in, d_out)``.  PEFT stores the same adapter transposed, under
``base_model.model.<module>.lora_A.weight`` (``(r, d_in)`` = ``a.T``) and ``.lora_B.weight``
(``(d_out, r)`` = ``b.T``).  ``write_adapter`` writes a folder that ``peft``'s
``PeftModel.from_pretrained`` loads onto the base ``transformers`` model, ``read_adapter``
reads one (also the key variants peft writes: with or without the ``.default`` adapter
name and the ``base_model.model.`` prefix), and ``merge_into`` adds adapters into Hugging
Face ``(out, in)`` weights for a merged export.  Needs numpy and safetensors only (no peft,
no torch).  Every refusal of a folder is a `ModelFileError`: one line naming the file and
the culprit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from distflow_jax import io_errors
from distflow_jax.models.errors import ModelFileError, ModelFileNotFoundError, read_json_object
from distflow_jax.models.hf_files import PICKLE_SUFFIXES, open_safetensors

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
# The dtypes an adapter file may be written in, by the names model.dtype uses.
DTYPES: dict[str, np.dtype] = {"float32": np.dtype(np.float32),
                               "bfloat16": np.dtype(ml_dtypes.bfloat16),
                               "float16": np.dtype(np.float16)}
# <module>.lora_A[.<adapter name>].weight, the prefix already removed.
_KEY = re.compile(r"^(?P<module>.+?)\.lora_(?P<side>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")

Arrays = dict[str, tuple[np.ndarray, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Unsupported:
  """An ``adapter_config.json`` key whose non-default value changes what the adapter
  computes in a way this reader does not reproduce."""
  key: str
  feature: str
  defaults: tuple[Any, ...] = (None, False, [], {}, "")


UNSUPPORTED: tuple[Unsupported, ...] = (
    Unsupported("use_rslora", "rank-stabilised scaling alpha/sqrt(r)"),
    Unsupported("use_dora", "DoRA, weight-decomposed LoRA"),
    Unsupported("bias", "trained biases", ("none", None)),
    Unsupported("lora_bias", "a bias on lora_B"),
    Unsupported("fan_in_fan_out", "Conv1D-style (in, out) base weights"),
    Unsupported("layers_to_transform", "adapters on chosen layer indices"),
    Unsupported("rank_pattern", "per-module ranks"),
    Unsupported("alpha_pattern", "per-module alphas"),
    Unsupported("modules_to_save", "fully trained copies of extra modules"),
    Unsupported("target_parameters", "adapters on bare parameters"),
    Unsupported("layer_replication", "replicated layers"),
    Unsupported("trainable_token_indices", "trained token embeddings"),
    Unsupported("alora_invocation_tokens", "activated LoRA"),
    Unsupported("megatron_config", "Megatron parallel layers"),
)


@dataclasses.dataclass(frozen=True)
class AdapterMeta:
  """What ``adapter_config.json`` says about a plain LoRA adapter."""
  rank: int
  alpha: float
  dropout: float
  target_modules: tuple[str, ...] | str  # names, or peft's regular expression
  base_model_name_or_path: str | None

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


_HF_CACHE = re.compile(r"models--[^/\\]+?--(?P<name>[^/\\]+)[/\\]snapshots")


def model_name(path_or_id: str) -> str:
  """The model's name in a base model's path or hub id, lower-cased, for comparing an
  adapter's ``base_model_name_or_path`` with the run's ``model.path``: the last path part
  ("Qwen/Qwen2.5-0.5B" and "/data/Qwen2.5-0.5B/" name "qwen2.5-0.5b"), or the repository's
  name in a Hugging Face cache snapshot (".../models--Qwen--Qwen2.5-0.5B/snapshots/<hash>")."""
  hit = _HF_CACHE.search(path_or_id)
  if hit:
    return hit.group("name").lower()
  return os.path.basename(path_or_id.rstrip("/\\")).lower()


def targets_module(targets: Iterable[str], module: str) -> bool:
  """peft's rule for a list of target names: the module's full name or a suffix after a dot."""
  return any(module == t or module.endswith("." + t) for t in targets)


def peft_targets(adapted: Iterable[str], modules: Iterable[str]) -> list[str]:
  """``target_modules`` for adapters on the ``adapted`` modules of a model whose linear
  modules are ``modules``: a short name (``q_proj``) where every module of that name is
  adapted, else the adapted modules' full names, so peft adds no adapter the file lacks."""
  adapted, modules = sorted(set(adapted)), set(modules)
  out: list[str] = []
  for short in sorted({m.rsplit(".", 1)[-1] for m in adapted}):
    mine = [m for m in adapted if m.rsplit(".", 1)[-1] == short]
    everyone = {m for m in modules if m.rsplit(".", 1)[-1] == short}
    out.extend([short] if everyone <= set(mine) else mine)
  return out


def _check_pair(module: str, a: np.ndarray, b: np.ndarray, rank: int) -> None:
  if a.ndim != 2 or b.ndim != 2 or a.shape[1] != rank or b.shape[0] != rank:
    raise ValueError(f"adapter {module}: a {a.shape} and b {b.shape} must be (d_in, {rank}) "
                     f"and ({rank}, d_out)")
  for name, x in (("a", a), ("b", b)):
    if not np.isfinite(np.asarray(x, np.float32)).all():
      raise ValueError(f"adapter {module}: {name} holds NaN or inf")


def adapter_config(*, rank: int, alpha: float, dropout: float, target_modules: Sequence[str],
                   base_model_name_or_path: str | None) -> dict[str, Any]:
  """The ``adapter_config.json`` object of a plain LoRA adapter, every key peft reads for
  one stated at its plain-LoRA value."""
  return {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank), "lora_alpha": float(alpha),
      "lora_dropout": float(dropout), "target_modules": sorted(target_modules),
      "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
      "lora_bias": False, "init_lora_weights": True, "inference_mode": True,
      "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
      "rank_pattern": {}, "alpha_pattern": {}, "exclude_modules": None,
      "base_model_name_or_path": base_model_name_or_path, "revision": None,
  }


def write_adapter(folder: str | os.PathLike, arrays: Mapping[str, tuple[np.ndarray, np.ndarray]],
                  *, rank: int, alpha: float, dropout: float, target_modules: Sequence[str],
                  base_model_name_or_path: str | None, dtype: str = "float32") -> None:
  """Writes ``arrays`` as a PEFT LoRA adapter folder.  ``target_modules`` are peft's names
  (short names such as ``q_proj``, or full module names: see `peft_targets`); every
  adapted module must match one.  ``dtype`` is the tensors' (a `DTYPES` name)."""
  if dtype not in DTYPES:
    raise ValueError(f"adapter dtype {dtype!r}: use one of {sorted(DTYPES)}")
  if not arrays:
    raise ValueError("no adapters to write")
  if not isinstance(rank, int) or rank <= 0:
    raise ValueError(f"rank {rank!r} must be a positive integer")
  untargeted = sorted(m for m in arrays if not targets_module(target_modules, m))
  if untargeted:
    raise ValueError(f"adapted modules {untargeted[:3]} match no target_modules entry "
                     f"{sorted(target_modules)}")
  tensors = {}
  for module, (a, b) in sorted(arrays.items()):
    a, b = np.asarray(a), np.asarray(b)
    _check_pair(module, a, b, rank)
    tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a.T.astype(DTYPES[dtype]))
    tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b.T.astype(DTYPES[dtype]))
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  config = adapter_config(rank=rank, alpha=alpha, dropout=dropout, target_modules=target_modules,
                          base_model_name_or_path=base_model_name_or_path)
  # Written beside, then renamed: a folder never holds half a file under the real name.
  with io_errors.writing(folder / f".{WEIGHTS}.tmp"):  # a Rust error names no path
    save_file(tensors, str(folder / f".{WEIGHTS}.tmp"), metadata={"format": "pt"})
  os.replace(folder / f".{WEIGHTS}.tmp", folder / WEIGHTS)
  (folder / f".{CONFIG}.tmp").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
  os.replace(folder / f".{CONFIG}.tmp", folder / CONFIG)


def _number(cfg_file: Path, d: dict, key: str, ok: Callable[[float], bool], want: str,
            integer: bool = False) -> Any:
  value = d.get(key)
  if (isinstance(value, bool) or not isinstance(value, int if integer else (int, float))
      or not np.isfinite(value) or not ok(value)):
    raise ModelFileError(f"{cfg_file}: {key}={value!r} must be {want}")
  return value


def _is_default(value: Any, defaults: tuple[Any, ...]) -> bool:
  return value is None or any(type(value) is type(v) and value == v for v in defaults)


def read_meta(folder: str | os.PathLike) -> AdapterMeta:
  """``folder``'s ``adapter_config.json``, refused unless a plain LoRA adapter."""
  folder = Path(folder)
  if not folder.is_dir():
    raise ModelFileNotFoundError(f"adapter folder {folder} does not exist (a PEFT LoRA "
                                 f"folder holds {CONFIG} and {WEIGHTS})")
  cfg_file = folder / CONFIG
  d = read_json_object(cfg_file, "PEFT adapter config")
  if d.get("peft_type") != "LORA":
    raise ModelFileError(f"{cfg_file}: peft_type={d.get('peft_type')!r}; only LORA adapters "
                         f"are supported")
  for u in UNSUPPORTED:
    value = d.get(u.key)
    if not _is_default(value, u.defaults):
      raise ModelFileError(f"{cfg_file}: {u.key}={value!r} ({u.feature}) is not supported; "
                           f"only plain LoRA adapters load here: merge it into the base "
                           f"(peft's merge_and_unload) and start from that folder instead")
  targets = d.get("target_modules")
  if not (isinstance(targets, str) or (isinstance(targets, list)
                                       and all(isinstance(t, str) for t in targets))):
    raise ModelFileError(f"{cfg_file}: target_modules={targets!r} must be a list of module "
                         f"names or a regular expression")
  base = d.get("base_model_name_or_path")
  return AdapterMeta(rank=_number(cfg_file, d, "r", lambda v: v > 0, "a positive integer",
                                  integer=True),
                     alpha=float(_number(cfg_file, d, "lora_alpha", lambda v: v > 0,
                                         "a positive number")),
                     dropout=float(_number(cfg_file, d, "lora_dropout", lambda v: 0 <= v < 1,
                                           "a number in [0, 1)")),
                     target_modules=targets if isinstance(targets, str) else tuple(targets),
                     base_model_name_or_path=base if isinstance(base, str) else None)


def _weights_file(folder: Path) -> Path:
  path = folder / WEIGHTS
  if path.is_file():
    return path
  pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
  if pickles:
    raise ModelFileError(f"{folder}: refusing pickle adapter weights {pickles}: only {WEIGHTS} "
                         f"is accepted (save it with peft's save_pretrained, "
                         f"safe_serialization=True)")
  raise ModelFileNotFoundError(f"missing {path} (the adapter's weights)")


def _tensors(path: Path) -> dict[str, np.ndarray]:
  with open_safetensors(path) as h:
    names = list(h.keys())
    try:
      return {k: h.get_tensor(k) for k in names}
    except Exception as e:  # pylint: disable=broad-except  (an unreadable dtype, say)
      raise ModelFileError(f"{path}: cannot read its tensors: {e}") from None


def _pairs(path: Path, tensors: dict[str, np.ndarray]) -> dict[str, dict[str, tuple]]:
  """``{module: {"A": (key, tensor), "B": (key, tensor)}}``; refuses a key that is no LoRA
  A / B weight, a second adapter name and a key given twice."""
  out: dict[str, dict[str, tuple]] = {}
  names: set[str] = set()
  for key, x in sorted(tensors.items()):
    m = _KEY.match(key.removeprefix(PREFIX))
    if m is None:
      raise ModelFileError(f"{path}: tensor {key!r} is not a LoRA lora_A / lora_B weight of a "
                           f"linear layer; only plain LoRA adapters are supported")
    names.add(m["adapter"] or "default")  # peft drops the default name when it saves
    if len(names) > 1:
      raise ModelFileError(f"{path}: holds several adapters ({sorted(names)}); save one")
    side = out.setdefault(m["module"], {})
    if m["side"] in side:
      raise ModelFileError(f"{path}: tensors {side[m['side']][0]!r} and {key!r} are the same "
                           f"weight")
    side[m["side"]] = (key, x)
  if not out:
    raise ModelFileError(f"{path}: holds no LoRA weights")
  return out


def _float32(path: Path, key: str, x: np.ndarray) -> np.ndarray:
  if not (np.issubdtype(x.dtype, np.floating) or x.dtype == ml_dtypes.bfloat16):
    raise ModelFileError(f"{path}: tensor {key!r} has dtype {x.dtype}; LoRA weights are "
                         f"floating point")
  x = np.asarray(x, np.float32)
  bad = x.size - int(np.count_nonzero(np.isfinite(x)))
  if bad:
    raise ModelFileError(f"{path}: tensor {key!r} holds {bad} non-finite value(s) (NaN or "
                         f"inf) of {x.size}; the adapter is corrupt or diverged")
  return x


def _targets_line(expected: Mapping[str, tuple[int, int]]) -> str:
  if not expected:
    return "the model has no LoRA targets (set model.lora)"
  shorts = sorted({m.rsplit(".", 1)[-1] for m in expected})
  return f"the model's LoRA targets are {', '.join(shorts)} ({len(expected)} modules)"


def read_adapter(folder: str | os.PathLike,
                 expected: Mapping[str, tuple[int, int]] | None = None
                 ) -> tuple[Arrays, AdapterMeta]:
  """``(arrays, meta)`` of a PEFT LoRA adapter folder, arrays in our orientation (float32).
  ``expected`` (``{module: (d_in, d_out)}``, the model's LoRA targets) refuses a module the
  model lacks and a shape that does not match; modules of ``expected`` the file lacks are
  simply absent from ``arrays``."""
  folder = Path(folder)
  meta = read_meta(folder)
  path = _weights_file(folder)
  arrays: Arrays = {}
  for module, sides in _pairs(path, _tensors(path)).items():
    for side in "AB":
      if side not in sides:
        other = sides["B" if side == "A" else "A"][0]
        raise ModelFileError(f"{path}: {other!r} has no lora_{side} partner for module "
                             f"{module!r}")
    (ka, ta), (kb, tb) = sides["A"], sides["B"]
    if expected is not None and module not in expected:
      raise ModelFileError(f"{path}: tensor {ka!r} adapts module {module!r}, which the model "
                           f"does not have as a LoRA target; {_targets_line(expected)}")
    r = meta.rank
    d_in, d_out = expected[module] if expected is not None else (
        ta.shape[-1] if ta.ndim == 2 else -1, tb.shape[0] if tb.ndim == 2 else -1)
    for key, t, want in ((ka, ta, (r, d_in)), (kb, tb, (d_out, r))):
      if tuple(t.shape) != want:
        raise ModelFileError(f"{path}: tensor {key!r} has shape {tuple(t.shape)}, expected "
                             f"{want} (r={r} from {CONFIG}, module {module!r} is "
                             f"{d_in} -> {d_out})")
    arrays[module] = (_float32(path, ka, ta).T.copy(), _float32(path, kb, tb).T.copy())
  return arrays, meta


def merge_into(hf_weights: Mapping[str, np.ndarray], arrays: Mapping[str, tuple[np.ndarray,
                                                                                 np.ndarray]],
               scale: float) -> dict[str, np.ndarray]:
  """A copy of ``hf_weights`` (Hugging Face names, linear weights ``(out, in)``) with each
  adapter added: ``W + (a @ b * scale).T`` in float32, cast back to ``W``'s dtype."""
  out = dict(hf_weights)
  for module, (a, b) in arrays.items():
    name = f"{module}.weight"
    if name not in out:
      raise KeyError(f"adapter for module {module!r}: no weight {name!r} to merge into")
    w = np.asarray(out[name])
    delta = (np.asarray(a, np.float32) @ np.asarray(b, np.float32) * np.float32(scale)).T
    if w.shape != delta.shape:
      raise ValueError(f"adapter for {module!r} is {delta.shape[1]} -> {delta.shape[0]}, "
                       f"weight {name!r} has shape {w.shape}")
    out[name] = (w.astype(np.float32) + delta).astype(w.dtype)
  return out
