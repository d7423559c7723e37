"""A run checkpoint's actor as a Hugging Face directory (``distflow-jax export``'s work).

``actor_model`` rebuilds the actor from a checkpoint's arrays (errors name what does not
fit), ``save_actor`` writes it as a Qwen2 / Llama / Qwen3 folder or, for a vision-language
run, the whole Qwen2.5-VL (``vision_base``: the starting folder's frozen tower beside the
trained decoder), and ``export(checkpoint, out, step)`` does both for one step.  Used by
commands/export.py and by run/model_source.py (eval / generate from a checkpoint).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from distflow_jax.models import hf_io
from distflow_jax.models.sharding import path_str
from distflow_jax.models.tokenizer import Tokenizer
from distflow_jax.models.transformer import Transformer
from distflow_jax.persist import checkpoint, destination
from distflow_jax.persist.lora_export import LoraExport, export_mode

PREFIX = "actor.params."
# One fused reduction per array: read once, no host copy (recompiled per shape and dtype).
_all_finite = jax.jit(lambda x: jnp.all(jnp.isfinite(x)))


def actor_model(arrays: dict, meta: dict, where: str) -> Transformer:
  """The actor rebuilt from a checkpoint's arrays; errors name what does not fit, and an
  array holding NaN or inf (a diverged run's weights)."""
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
    if not bool(_all_finite(values[key])):
      raise checkpoint.CheckpointError(
          f"{where}: the actor's {name} holds non-finite values (NaN or inf); the run "
          f"diverged before this step was saved: use an earlier step (export --step N, or "
          f"--model=RUN_DIR/checkpoints/<step>)")
  for key, var in flat:
    var.set_value(values[key])
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def vision_base(meta: dict, where: str) -> str:
  """The Qwen2.5-VL folder a vision-language run started from ('' for a text run): its
  frozen tower is the run's, so the export puts the trained decoder back beside it."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  from distflow_jax.config import vision_checks  # pylint: disable=import-outside-toplevel
  from distflow_jax.state import vision  # pylint: disable=import-outside-toplevel
  run_cfg = meta.get("config") or {}
  start = (run_cfg.get("model") or {}).get("path", "")
  if vision.is_vl_checkpoint(start):
    return start
  try:
    images = vision_checks.run_image_key(ml_collections.ConfigDict(run_cfg))
  except (AttributeError, KeyError, TypeError, ValueError):
    images = ""
  if images:
    raise checkpoint.CheckpointError(
        f"{where}: a vision-language run (images in field {images!r}) whose vision tower "
        f"stays in its starting model.path={start!r}, which is not a Qwen2.5-VL folder "
        f"now; put that folder back at the same path to export the whole model")
  return ""


def save_actor(out: str, model: Transformer, tokenizer: Tokenizer | None, meta: dict,
               where: str) -> None:
  """Writes the actor as a Hugging Face folder: a Qwen2 / Llama / Qwen3 one, or for a
  vision-language run the whole Qwen2.5-VL (the starting folder's frozen tower + the
  trained decoder), so that ``eval`` and ``generate`` still see images."""
  base = vision_base(meta, where)
  if not base:
    hf_io.save_pretrained(out, model, tokenizer)
    return
  from distflow_jax.models.vl import load_vl_pretrained, save_vl_pretrained  # pylint: disable=import-outside-toplevel
  vl = load_vl_pretrained(base, dtype=model.cfg.dtype)
  vl.language = model
  save_vl_pretrained(out, vl)
  if tokenizer is not None and jax.process_index() == 0:
    tokenizer.save(out)


def export(checkpoint_path: str, out: str, step: int | None = None, *,
           overwrite: bool = False, lora: LoraExport | None = None) -> int:
  """Writes the actor of ``checkpoint_path`` to ``out``; returns the exported step.  ``out``
  is checked first (``destination.check_folder``): a non-empty folder needs ``overwrite``,
  whose old model files (``destination.MODEL_FILES``) are removed just before writing.
  ``lora`` (``export --lora``) is checked against the run (`lora_export.export_mode`)."""
  destination.check_folder(out, overwrite=overwrite)
  root, found = checkpoint.resolve(checkpoint_path)
  step, arrays, meta = checkpoint.read_arrays(root, step if step is not None else found)
  where = f"checkpoint {root}/{step}"
  if export_mode(lora, meta.get("config") or {}, where) is not None:
    # Issue 34: a LoRA run's actor is rebuilt with models/lora.py's adapters, then written
    # by lora_export.save_adapter (ADAPTER) or merged with peft_files.merge_into (MERGED).
    raise checkpoint.CheckpointError(f"{where}: a LoRA run cannot be exported yet (the "
                                     f"model side of issue 34 is not connected)")
  model = actor_model(arrays, meta, where)
  tok_dir = os.path.join(root, checkpoint.STATIC, "tokenizer")
  tokenizer = Tokenizer.from_dir(tok_dir) if os.path.isdir(tok_dir) else None
  if overwrite:
    destination.clear_model_files(out)
  save_actor(out, model, tokenizer, meta, where)
  return step
