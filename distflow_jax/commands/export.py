"""``distflow-jax export``: a run checkpoint's actor as a Hugging Face directory.

  distflow-jax export --checkpoint runs/grpo_tiny [--step N] --out /tmp/actor_hf [--overwrite]
                      [--lora=adapter|merged]

``--checkpoint`` is a run directory, its ``checkpoints`` directory or one
numbered step in it (default: the latest complete step).  Writes
``config.json`` + ``model.safetensors`` (+ the tokenizer saved with the run),
loadable by ``transformers`` and by ``--config.model.path``.  Runs on one
process on the host, whatever mesh the checkpoint was written from.  ``--out`` is
checked before anything is read: a non-empty folder needs ``--overwrite`` (its old
model files, a warm-start key among them, are removed first), and a run's own folders
(the run dir, its checkpoints, its warm start) are refused.  For a run trained with LoRA
(``model.lora``), ``--lora=merged`` (the default) writes the adapters merged into the base
weights and ``--lora=adapter`` a PEFT adapter folder (``adapter_config.json`` +
``adapter_model.safetensors``) that ``peft`` loads onto the base model; ``--lora=adapter``
on a run without LoRA is refused.  A LoRA checkpoint holds the adapters only: the base is
the run's ``model.path`` (else its warm start, or the preset from its seed), checked
against the fingerprint saved with the adapters.

``distflow_jax.persist.export.export(checkpoint, out, step)`` is the same as a library call.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax

from distflow_jax.persist import checkpoint
from distflow_jax.persist.export import (PREFIX, actor_model, export, save_actor,  # noqa: F401
                                         vision_base)
from distflow_jax.persist.lora_export import LoraExport, parse_flag


def run(argv: Sequence[str]) -> int:
  """Entry point of ``distflow-jax export``; returns the exit code."""
  parser = argparse.ArgumentParser(prog="distflow-jax export", description=__doc__.split("\n")[0])
  parser.add_argument("--checkpoint", required=True,
                      help="run dir, its checkpoints dir, or one step dir")
  parser.add_argument("--out", required=True, help="Hugging Face directory to write")
  parser.add_argument("--step", type=int, default=None, help="step to export (default: latest)")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace the model files of a non-empty --out folder")
  parser.add_argument("--lora", default=None,
                      help=f"{' | '.join(m.value for m in LoraExport)}: a LoRA run's adapters "
                           f"merged into the weights (default) or a PEFT adapter folder")
  args = parser.parse_args(list(argv))
  lora = parse_flag(args.lora)
  if jax.process_count() > 1:
    raise checkpoint.CheckpointError("export runs on one process; start it without the launcher")
  step = export(args.checkpoint, args.out, args.step, overwrite=args.overwrite,
                lora=lora)
  print(f"exported the actor of step {step} to {args.out}")
  return 0
