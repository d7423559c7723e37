"""``--model`` of ``eval`` and ``generate``: a Hugging Face folder, or a run's checkpoint.

    kind = model_source.kind(path)                  # before jax is imported: no I/O but stat
    ...
    folder, step = model_source.checkpoint_as_hf(path)   # after distributed.initialize()

A run directory (``runs/x``: its latest complete checkpoint), its ``checkpoints``
directory, or one numbered step in it (``runs/x/checkpoints/40``) is read as
``distflow-jax export`` reads it: the actor's weights are written with the
run's tokenizer to a temporary Hugging Face folder (removed at exit), which
then serves as ``model.path``, so every check and loader downstream is the one
a Hugging Face folder gets.  A LoRA run's actor is its base (the run's model.path
or warm start, checked against the base fingerprint saved with the adapters) with
the adapters merged in (persist/lora_actor.py).  One process only: under several,
``export`` the run once and pass the folder.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any, Literal

from absl import logging as absl_logging

from distflow_jax.config.errors import ConfigError

Kind = Literal["hf", "checkpoint"]
HOW = ("a Hugging Face folder (config.json + *.safetensors + tokenizer.json), a run directory, "
       "or RUN_DIR/checkpoints/<step>")


def _is_step_dir(path: str) -> bool:
  return os.path.basename(os.path.normpath(path)).isdigit() and \
      os.path.isdir(os.path.join(path, "meta"))


def kind(path: str, flag: str = "--model") -> Kind:
  """Whether ``path`` is a Hugging Face folder or a run checkpoint; a folder that is neither
  is left to the Hugging Face checks, whose errors name what is missing."""
  if not os.path.exists(path):
    raise ConfigError(f"{flag}={path!r} does not exist; give {HOW}")
  # A run directory first: it holds a config.json too (the run's config, not a model's).
  if os.path.isdir(os.path.join(path, "checkpoints")) or _is_step_dir(path):
    return "checkpoint"
  if os.path.isfile(os.path.join(path, "config.json")):
    return "hf"
  if os.path.isdir(path) and any(_is_step_dir(os.path.join(path, d)) for d in os.listdir(path)):
    return "checkpoint"  # the checkpoints directory itself
  return "hf"


def _run_tokenizer(root: str, meta: dict[str, Any], where: str) -> Any:
  """The tokenizer saved with the run; else the one its config named (the built-in one, or
  the model folder it started from, when that is still there)."""
  from distflow_jax.models.tokenizer import Tokenizer
  from distflow_jax.persist import checkpoint
  saved = os.path.join(root, checkpoint.STATIC, "tokenizer")
  if os.path.isdir(saved):
    return Tokenizer.from_dir(saved)
  start = ((meta.get("config") or {}).get("model") or {}).get("path", "")
  if not start:
    return Tokenizer.builtin()
  if os.path.isfile(os.path.join(start, "tokenizer.json")):
    return Tokenizer.from_dir(start)
  raise ConfigError(f"{where} has no saved tokenizer ({saved}) and the run's model.path "
                    f"{start!r} holds none; export it with `distflow-jax export` and copy the "
                    f"tokenizer files into the folder")


def checkpoint_as_hf(path: str, flag: str = "--model") -> tuple[str, int]:
  """(temporary Hugging Face folder, step) holding the actor of the checkpoint at ``path``."""
  import jax
  from distflow_jax.persist import export
  from distflow_jax.persist import checkpoint
  if jax.process_count() > 1:
    # Every process would read and write the whole model; export once instead.
    raise ConfigError(f"{flag}={path!r}: a run checkpoint is read on one process; under "
                      f"several, export it first (distflow-jax export --checkpoint {path} "
                      f"--out HF_DIR) and pass {flag}=HF_DIR")
  root, step = checkpoint.resolve(path)
  verbosity = absl_logging.get_verbosity()
  # orbax warns that it skips the loader item, which is not wanted here.
  absl_logging.set_verbosity(absl_logging.ERROR)
  try:
    step, arrays, meta = checkpoint.read_arrays(root, step)
  finally:
    absl_logging.set_verbosity(verbosity)
  where = f"checkpoint {root}/{step}"
  model = export.whole_actor(arrays, meta, where, root)
  tokenizer = _run_tokenizer(root, meta, where)
  folder = tempfile.mkdtemp(prefix=f"distflow-step{step}-")
  atexit.register(shutil.rmtree, folder, ignore_errors=True)
  export.save_actor(folder, model, tokenizer, meta, where)
  return folder, step
