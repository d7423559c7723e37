"""What ``export --lora`` writes for a run, and the PEFT adapter folder of a LoRA run.

``export_mode`` decides from the run's resolved config (``model.lora``, saved with every
checkpoint): a run with LoRA exports merged weights unless ``--lora=adapter`` asks for
the PEFT adapter folder; ``--lora=adapter`` on a run without LoRA is refused (one line);
``--lora=merged`` on such a run is the plain export (its weights are the whole model).
``save_adapter`` writes a LoRA run's adapters (``models/peft_files.py``) with the run's
rank, alpha and dropout.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from distflow_jax.config.errors import ConfigError
from distflow_jax.models import peft_files
from distflow_jax.persist.checkpoint_contents import CheckpointError


class LoraExport(enum.Enum):
  """``export --lora``: the adapters as a PEFT folder, or merged into the base weights."""
  ADAPTER = "adapter"
  MERGED = "merged"


def parse_flag(text: str | None) -> LoraExport | None:
  """``--lora``'s value (None when not given); `ConfigError` naming the flag otherwise."""
  if text is None:
    return None
  try:
    return LoraExport(text)
  except ValueError:
    raise ConfigError(f"--lora={text!r}: use one of "
                      f"{', '.join(m.value for m in LoraExport)}") from None


def run_lora(run_config: Mapping[str, Any]) -> Mapping[str, Any] | None:
  """The run's ``model.lora`` section when LoRA was on (``model.lora.enabled``), else None
  (a rank is always set: the default config carries one whether LoRA is on or not)."""
  lora = ((run_config or {}).get("model") or {}).get("lora")
  if not isinstance(lora, Mapping):
    return None
  return lora if lora.get("enabled") is True else None


def export_mode(requested: LoraExport | None, run_config: Mapping[str, Any],
                where: str) -> LoraExport | None:
  """What to write for a run: None for a run without LoRA (the whole model, as always),
  else ``requested`` or, by default, ``MERGED``.  ``ADAPTER`` for a run without LoRA is a
  `CheckpointError` naming the checkpoint."""
  if run_lora(run_config) is None:
    if requested is LoraExport.ADAPTER:
      raise CheckpointError(f"{where}: --lora=adapter needs a run trained with LoRA "
                            f"(model.lora.enabled=True), this one trained the whole model: "
                            f"drop --lora to export it")
    return None
  return requested or LoraExport.MERGED


def save_adapter(out: str | os.PathLike, arrays: Mapping[str, tuple[np.ndarray, np.ndarray]],
                 run_config: Mapping[str, Any], linear_modules: Iterable[str],
                 dtype: str = "float32", base: str | None = None) -> None:
  """Writes a LoRA run's adapters as a PEFT folder: the run's ``model.lora`` rank, alpha
  and dropout, ``base`` (default: its starting ``model.path``) as the base model, and
  target_modules covering exactly the adapted modules among the model's
  ``linear_modules`` (HF module names)."""
  lora = run_lora(run_config)
  if lora is None:
    raise ValueError("save_adapter: the run has no LoRA (model.lora.enabled)")
  base = base or ((run_config.get("model") or {}).get("path")) or None
  peft_files.write_adapter(out, arrays, rank=lora["rank"], alpha=lora["alpha"],
                           dropout=lora["dropout"],
                           target_modules=peft_files.peft_targets(arrays, linear_modules),
                           base_model_name_or_path=base, dtype=dtype)
