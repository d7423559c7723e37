"""Where ``export``, ``eval --out`` and ``generate --out`` may write, checked before anything
is loaded or computed.

    check_folder(out, overwrite=args.overwrite)   # export: a Hugging Face folder
    check_file(out, overwrite=fv.overwrite)       # eval / generate: one file
    clear_model_files(out)                        # just before writing a folder over an old one

A non-empty folder or an existing file is refused unless ``--overwrite``; a run's own
places (the run dir itself, its checkpoints, warm-start, sft, data and TensorBoard folders,
its metrics / config / lock files) are refused even with it: writing there would corrupt
the run or the warm-start cache.  A new file or folder beside them in the run dir
(``runs/x/hf``, ``runs/x/eval.json``) is fine.  Each refusal is one line (exit 2).
"""

from __future__ import annotations

import fnmatch
import os
import tempfile

from distflow_jax.config.errors import ConfigError

# What marks a folder as a run dir (any one of them).
RUN_MARKERS = ("checkpoints", "metrics.jsonl", "config_history.jsonl", "run.lock")
# A run dir's folders that the run itself writes and reads back.
RUN_FOLDERS = ("checkpoints", "warmstart", "warmstart-*", "warmstart-vl", "sft", "data",
               "tensorboard", "wandb")
# A run dir's files that the run itself writes and reads back.
RUN_FILES = ("metrics.jsonl", "config.json", "config_history.jsonl", "run.lock",
             "samples.jsonl", "wandb_run_id")
# The files a model folder of ours holds: with --overwrite, an old folder's copies go
# first, so no stale shard, tokenizer or warm-start key (distflow_warmstart.json: the
# warm-start cache would serve the new weights as its own) survives beside the new ones.
MODEL_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "generation_config.json",
               "chat_template.jinja", "special_tokens_map.json", "preprocessor_config.json",
               "distflow_warmstart.json", "distflow_warmstart.json.tmp",
               "adapter_config.json")


class DestinationError(ConfigError):
  """An output path that must not be written (exit 2)."""


def _is_run_dir(path: str) -> bool:
  return os.path.isdir(path) and any(os.path.exists(os.path.join(path, m)) for m in RUN_MARKERS)


def run_part(path: str) -> str | None:
  """What of a run ``path`` is ("the run dir runs/x", "run runs/x's checkpoints folder"),
  or None when it is none of a run's own places."""
  path = os.path.abspath(path)
  here = path
  while True:
    if _is_run_dir(here):
      rel = os.path.relpath(path, here)
      if rel == ".":
        return f"the run dir {here}"
      parts = rel.split(os.sep)
      if any(fnmatch.fnmatch(parts[0], p) for p in RUN_FOLDERS):
        return f"inside run {here}'s {parts[0]} folder"
      if len(parts) == 1 and parts[0] in RUN_FILES:
        return f"run {here}'s own {parts[0]}"
    parent = os.path.dirname(here)
    if parent == here:
      return None
    here = parent


def _refuse_run_part(path: str, flag: str) -> None:
  part = run_part(path)
  if part is not None:
    raise DestinationError(f"{flag}={path} is {part}; the run reads it back, so nothing is "
                           f"written there (not even with --overwrite): give another {flag}")


def check_folder(path: str, *, overwrite: bool, flag: str = "--out") -> None:
  """Refuses a folder destination that is a file, a run's own place, or (without
  ``overwrite``) a non-empty folder."""
  _refuse_run_part(path, flag)
  if os.path.exists(path) and not os.path.isdir(path):
    raise DestinationError(f"{flag}={path} is a file, not a folder: give a folder path")
  if os.path.isdir(path) and os.listdir(path) and not overwrite:
    raise DestinationError(f"{flag}={path} is a folder that is not empty; pass --overwrite "
                           f"to replace its model files, or give a new folder")


def check_file(path: str, *, overwrite: bool, flag: str = "--out") -> None:
  """Refuses a file destination that is a folder, a run's own place, or (without
  ``overwrite``) an existing file."""
  _refuse_run_part(path, flag)
  if os.path.isdir(path):
    raise DestinationError(f"{flag}={path} is a folder: give a file path")
  if os.path.lexists(path) and not overwrite:
    raise DestinationError(f"{flag}={path} exists; pass --overwrite to replace it, or give "
                           f"another path")
  parent = os.path.dirname(os.path.abspath(path))
  while not os.path.exists(parent):  # the nearest folder that exists is where it is made
    parent = os.path.dirname(parent)
  try:  # a file made and removed there: refused now, not after the work is done
    with tempfile.NamedTemporaryFile(dir=parent, prefix=".distflow-write-probe-"):
      pass
  except OSError as e:
    raise DestinationError(f"{flag}={path}: cannot write in {parent} "
                           f"({e.strerror or type(e).__name__})") from None


def clear_model_files(path: str) -> list[str]:
  """Removes the files of ``MODEL_FILES`` from the folder ``path`` (an --overwrite); returns
  their names.  Other files (a README, the user's own) stay."""
  if not os.path.isdir(path):
    return []
  gone = []
  for name in sorted(os.listdir(path)):
    full = os.path.join(path, name)
    if os.path.isfile(full) and any(fnmatch.fnmatch(name, p) for p in MODEL_FILES):
      os.unlink(full)
      gone.append(name)
  return gone
