"""Clear errors for the first things users get wrong, checked before anything compiles.

A model directory that is not a Hugging Face checkpoint, a dataset whose rows
lack the configured prompt/answer fields, and running out of memory all
surface deep inside the run as raw tracebacks; these checks turn them into
one ``ConfigError`` line that names the key and says what would work.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import ml_collections

from distflow_jax import io_errors
from distflow_jax.config.errors import ConfigError
from distflow_jax.data.sources import BadRow, field_value, open_source

PROMPT_KEYS = ("prompt", "question", "problem", "query", "instruction", "input")
ANSWER_KEYS = ("answer", "solution", "ground_truth", "target", "final_answer", "output",
               "reward_model.ground_truth")  # the last: verl's Parquet layout


def check_model_dir(path: str, key: str = "model.path") -> None:
  """Refuses a model path that is not a local HF directory with config, weights, tokenizer."""
  where = f"{key}={path!r}"
  if not os.path.exists(path):
    raise ConfigError(f"{where} does not exist; nothing is downloaded at run time: copy the "
                      f"model's Hugging Face folder (config.json, *.safetensors, tokenizer.json) "
                      f"to this machine and point {key} at it")
  if not os.path.isdir(path):
    raise ConfigError(f"{where} is a file; give the folder that holds config.json")
  have = sorted(os.listdir(path))
  if "config.json" not in have:
    nested = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(path, "*", "config.json")))
    tip = f"; did you mean {nested[0]!r}?" if nested else ""
    raise ConfigError(f"{where} has no config.json (it holds {have[:8]}): point it at a local "
                      f"Hugging Face model directory (config.json + *.safetensors + "
                      f"tokenizer.json){tip}")
  if not any(f.endswith(".safetensors") for f in have):
    pickles = [f for f in have if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
    why = (f"; {pickles[:3]} are pickle checkpoints, which are refused: save the model with "
           f"safe_serialization=True (transformers' default) or convert it" if pickles else "")
    raise ConfigError(f"{where} has no *.safetensors weights{why}")
  if "tokenizer.json" not in have:
    # Checked before any weight is read: a missing tokenizer should cost seconds, not a load.
    raise ConfigError(f"{where} has no tokenizer.json (the fast-tokenizer file; missing "
                      f"{os.path.join(path, 'tokenizer.json')}); copy it from the model's "
                      f"Hugging Face folder (only tokenizer.json is supported)")
  from distflow_jax.models import hf_io, vl
  from distflow_jax.state import vision
  try:
    if vision.is_vl_checkpoint(path):
      vl.read_vl_config(path)
    else:
      hf_io.read_config(path)
  except (ValueError, OSError) as e:
    raise ConfigError(f"{where}: {e}") from None


def _suggest(row: dict[str, Any], candidates: tuple[str, ...], flag: str) -> str:
  present = [k for k in candidates if field_value(row, k) is not None]
  return f"; set --config.{flag}={present[0]}" if present else ""


def first_row(path: str) -> dict[str, Any] | None:
  """The first readable row of a JSONL/Parquet file (None if it has none)."""
  src = open_source(path)
  for i in range(min(len(src), 8)):
    row = src[i]
    if not isinstance(row, BadRow):
      return row
  return None


def check_dataset_fields(path: str, prompt_key: str, answer_key: str,
                         key: str = "data.train") -> None:
  """Refuses a dataset whose rows lack the prompt or answer field (before every row is skipped)."""
  row = first_row(path)
  if row is None:
    return  # the loader reports unreadable rows itself, with counts by reason
  for field, flag, candidates in ((prompt_key, "data.prompt_key", PROMPT_KEYS),
                                  (answer_key, "data.answer_key", ANSWER_KEYS)):
    # A column, or a dotted path into nested ones (reward_model.ground_truth).
    if field not in row and field_value(row, field) is None:
      raise ConfigError(f"{key}={path!r}: rows have no {field!r} field ({flag}={field!r}); "
                        f"the first row has {sorted(row)}{_suggest(row, candidates, flag)}")


_OOM_MARKERS = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory", "OOM when allocating",
                "Allocator ran out of memory", "Cannot allocate memory")


def is_oom(error: BaseException) -> bool:
  if isinstance(error, MemoryError):
    return True
  if io_errors.find(error) is not None:  # a full disk says RESOURCE_EXHAUSTED too
    return False
  text = str(error)
  return any(m in text for m in _OOM_MARKERS)


def oom_hint(error: BaseException, cfg: ml_collections.ConfigDict | None = None) -> str | None:
  """A what-to-change message when ``error`` is an out-of-memory error, else None."""
  if not is_oom(error):
    return None
  first = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
  knobs = []
  if cfg is not None:
    r, d = cfg.rollout, cfg.data
    knobs = [
        f"rollout.max_concurrent_decodes={r.max_concurrent_decodes} (KV cache: slots x "
        f"(max_prompt_len + max_new_tokens))",
        f"rollout.max_new_tokens={r.max_new_tokens}",
        *_micro_batch_knobs(cfg),
        f"data.max_prompt_len={d.max_prompt_len}",
    ]
    if cfg.model.dtype == "float32":
      knobs.append("model.dtype=bfloat16 (halves weights, optimizer state and KV cache)")
    knobs.append("placement.actor.mesh.fsdp: shard parameters and optimizer state over more "
                 "devices (fsdp=-1 uses them all)")
  lines = [f"out of memory: {first}", "lower one of these and run again:"]
  lines += [f"  --config.{k}" for k in knobs] or ["  the batch, sequence lengths or model size"]
  return "\n".join(lines)


def _micro_batch_knobs(cfg: ml_collections.ConfigDict) -> list[str]:
  """The key that sizes each trained role's micro-batches: its token budget when one is set
  (micro_batch_size is then unused), else micro_batch_size; the critic's only when the DAG
  trains it."""
  fns = {n.get("fn") for n in cfg.dag if isinstance(n, dict)}
  out = []
  for role, fn in (("actor", "train.actor"), ("critic", "train.critic")):
    if role == "critic" and fn not in fns:
      continue
    s = cfg[role]
    budget = s.micro_batch_tokens
    out.append(f"{role}.micro_batch_tokens={budget} (tokens per training micro-batch: "
               f"activations and logits)" if budget else
               f"{role}.micro_batch_size={s.micro_batch_size} (training activations and logits)")
  return out
