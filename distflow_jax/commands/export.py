"""``distflow-jax export``: a run checkpoint's actor as a Hugging Face directory.

  distflow-jax export --checkpoint runs/grpo_tiny [--step N] --out /tmp/actor_hf

``--checkpoint`` is a run directory, its ``checkpoints`` directory or one
numbered step in it (default: the latest complete step).  Writes
``config.json`` + ``model.safetensors`` (+ the tokenizer saved with the run),
loadable by ``transformers`` and by ``--config.model.path``.  Runs on one
process on the host, whatever mesh the checkpoint was written from.

``export(checkpoint, out, step)`` is the same as a library call.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from distflow_jax.models import hf_io
from distflow_jax.models.sharding import path_str
from distflow_jax.models.tokenizer import Tokenizer
from distflow_jax.models.transformer import Transformer
from distflow_jax.workflow import checkpoint

PREFIX = "actor.params."


def actor_model(arrays: dict, meta: dict, where: str) -> Transformer:
  """The actor rebuilt from a checkpoint's arrays; errors name what does not fit."""
  model_cfg = checkpoint.model_config_from_meta(meta)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))))
  flat = nnx.to_flat_state(state)
  wanted = {f"{PREFIX}{path_str(k)}.value".replace("/", "."): k for k, _ in flat}
  saved = {k for k in arrays if k.startswith(PREFIX)}
  missing, extra = sorted(set(wanted) - saved), sorted(saved - set(wanted))
  if missing or extra:
    raise checkpoint.CheckpointError(
        f"{where}: the actor's arrays do not match its model config "
        f"({model_cfg.arch}, {model_cfg.num_layers} layers): missing {missing[:5]}, "
        f"unexpected {extra[:5]}")
  values = {}
  abstract = {k: v.get_value() for k, v in flat}
  for name, key in wanted.items():
    spec = abstract[key]
    x = arrays[name]
    if tuple(x.shape) != tuple(spec.shape):
      raise checkpoint.CheckpointError(f"{where}: {name} has shape {x.shape}, the model "
                                       f"config expects {tuple(spec.shape)}")
    values[key] = jnp.asarray(x, spec.dtype)
  for key, var in flat:
    var.set_value(values[key])
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def export(checkpoint_path: str, out: str, step: int | None = None) -> int:
  """Writes the actor of ``checkpoint_path`` to ``out``; returns the exported step."""
  root, found = checkpoint.resolve(checkpoint_path)
  step, arrays, meta = checkpoint.read_arrays(root, step if step is not None else found)
  model = actor_model(arrays, meta, f"checkpoint {root}/{step}")
  tok_dir = os.path.join(root, checkpoint.STATIC, "tokenizer")
  tokenizer = Tokenizer.from_dir(tok_dir) if os.path.isdir(tok_dir) else None
  hf_io.save_pretrained(out, model, tokenizer)
  return step


def run(argv: Sequence[str]) -> int:
  """Entry point of ``distflow-jax export``; returns the exit code."""
  parser = argparse.ArgumentParser(prog="distflow-jax export", description=__doc__.split("\n")[0])
  parser.add_argument("--checkpoint", required=True,
                      help="run dir, its checkpoints dir, or one step dir")
  parser.add_argument("--out", required=True, help="Hugging Face directory to write")
  parser.add_argument("--step", type=int, default=None, help="step to export (default: latest)")
  args = parser.parse_args(list(argv))
  if jax.process_count() > 1:
    raise checkpoint.CheckpointError("export runs on one process; start it without the launcher")
  step = export(args.checkpoint, args.out, args.step)
  print(f"exported the actor of step {step} to {args.out}")
  return 0
