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
import ml_collections
from flax import nnx

from distflow_jax.config import vision_checks
from distflow_jax.models import hf_io
from distflow_jax.models.lora import adapter_arrays
from distflow_jax.models.tokenizer import Tokenizer
from distflow_jax.models.transformer import Transformer
from distflow_jax.models.vl import load_vl_pretrained, save_vl_pretrained
from distflow_jax.persist import actor_arrays, checkpoint, destination, lora_actor
from distflow_jax.persist.actor_arrays import PREFIX  # noqa: F401 (re-exported)
from distflow_jax.persist.lora_export import LoraExport, export_mode, save_adapter
from distflow_jax.state import vision



def actor_model(arrays: dict, meta: dict, where: str) -> Transformer:
  """The actor rebuilt from a checkpoint's arrays; errors name what does not fit, and an
  array holding NaN or inf (a diverged run's weights)."""
  model_cfg = checkpoint.model_config_from_meta(meta)
  return actor_arrays.fill(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))),
                           arrays, where, f"{model_cfg.arch}, {model_cfg.num_layers} layers")


def whole_actor(arrays: dict, meta: dict, where: str, root: str) -> Transformer:
  """The actor as one plain model: a LoRA run's adapters merged into the base they were
  trained on (lora_actor.py), else the checkpoint's weights (eval / generate from a run)."""
  if lora_actor.is_lora(meta):
    return lora_actor.load(arrays, meta, where, root).merged
  return actor_model(arrays, meta, where)


def vision_base(meta: dict, where: str) -> str:
  """The Qwen2.5-VL folder a vision-language run started from ('' for a text run): its
  frozen tower is the run's, so the export puts the trained decoder back beside it."""
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
  mode = export_mode(lora, meta.get("config") or {}, where)
  tok_dir = os.path.join(root, checkpoint.STATIC, "tokenizer")
  tokenizer = Tokenizer.from_dir(tok_dir) if os.path.isdir(tok_dir) else None
  if mode is LoraExport.ADAPTER:
    actor = lora_actor.load(arrays, meta, where, root)
    if overwrite:
      destination.clear_model_files(out)
    save_adapter(out, adapter_arrays(actor.model), meta.get("config") or {},
                 actor.linear_modules(), base=actor.base_path or None)
    return step
  model = whole_actor(arrays, meta, where, root)  # a LoRA run's: merged
  if overwrite:
    destination.clear_model_files(out)
  save_actor(out, model, tokenizer, meta, where)
  return step
