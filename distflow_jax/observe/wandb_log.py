"""Weights & Biases logging of a run (``logging.wandb``; off by default).

    --config.logging.wandb.enabled=True [--config.logging.wandb.project=P]
        [--config.logging.wandb.name=N] [--config.logging.wandb.mode=online|offline]

When on, process 0 logs every numeric metric of each row that goes to
metrics.jsonl and TensorBoard (the same keys, at the row's ``step``), and the
held-out samples of each evaluation (observe/samples.py) as a ``wandb.Table``
under ``eval/samples``.  The resolved config is the W&B run's config.  Files go
to ``WANDB_DIR`` where it is set, else to ``run_dir`` (``run_dir/wandb``).  A
resumed run continues the W&B run it started (its id is kept in
``run_dir/wandb_run_id``).  ``mode=""`` leaves the mode to wandb (``WANDB_MODE``,
else online).

wandb is an optional extra (``pip install 'distflow-jax[wandb]'``): asking for it
without the package is refused in one line before any work (``check``).  This
module imports neither jax nor wandb at import time.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from distflow_jax.config.errors import ConfigError
from distflow_jax.observe.run_config import as_plain

MODES = ("", "online", "offline")  # "": wandb's own choice (WANDB_MODE, else online)
ID_FILE = "wandb_run_id"
SAMPLES_KEY = "eval/samples"
SAMPLE_COLUMNS = ("step", "index", "prompt", "response", "reward", "correct", "answer")
MISSING = ("logging.wandb.enabled=True needs the wandb package, which is not installed: "
           "pip install 'distflow-jax[wandb]' (or pip install wandb)")


def has_wandb() -> bool:
  return importlib.util.find_spec("wandb") is not None


def check(cfg) -> None:
  """Raises ``ConfigError`` (one line) for a bad ``logging.wandb`` section, or when it asks
  for wandb and the package is not installed."""
  w = cfg.logging.wandb
  if not isinstance(w.enabled, bool):
    raise ConfigError(f"logging.wandb.enabled={w.enabled!r} must be True or False")
  if w.mode not in MODES:
    raise ConfigError(f"logging.wandb.mode={w.mode!r} must be one of {list(MODES)} "
                      f"(\"\" = WANDB_MODE, else online)")
  for key in ("project", "name"):
    if not isinstance(w[key], str):
      raise ConfigError(f"logging.wandb.{key}={w[key]!r} must be a string")
  if w.enabled and not w.project:
    raise ConfigError("logging.wandb.project is empty: name the W&B project, e.g. "
                      "--config.logging.wandb.project=distflow-jax")
  if w.enabled and not has_wandb():
    raise ConfigError(MISSING)


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
  """The row's numbers as TensorBoard gets them: no ``step``, no booleans, finite only."""
  out = {}
  for key, value in record.items():
    if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
      continue
    if math.isfinite(value):
      out[key] = float(value)
  return out


class WandbWriter:
  """``write(row)`` like JsonlWriter, ``add_samples(step, samples)``, ``close()``; a no-op
  unless ``enabled`` (process 0) and ``logging.wandb.enabled``."""

  def __init__(self, cfg, enabled: bool, *, resuming: bool = False):
    self._run = None
    self._wandb = None
    if not enabled or "logging" not in cfg or not cfg.logging.wandb.enabled:
      return
    check(cfg)
    w = cfg.logging.wandb
    import wandb  # pylint: disable=import-outside-toplevel
    os.makedirs(cfg.run_dir, exist_ok=True)
    id_path = os.path.join(cfg.run_dir, ID_FILE)
    run_id = None
    if resuming and os.path.exists(id_path):
      with open(id_path) as f:
        run_id = f.read().strip() or None
    try:
      self._run = wandb.init(
          project=w.project, name=w.name or cfg.name, mode=w.mode or None, id=run_id,
          resume="allow" if run_id else None, config=as_plain(cfg),
          dir=None if os.environ.get("WANDB_DIR") else cfg.run_dir,
          # Our progress line stays as it is: wandb does not capture the console.
          settings=wandb.Settings(console="off"))
    except Exception as e:  # noqa: BLE001 - no login, no network, a bad project name, ...
      detail = " ".join(str(e).split()) or type(e).__name__
      raise RuntimeError(f"logging.wandb: wandb.init failed: {detail} (set "
                         f"--config.logging.wandb.mode=offline, or WANDB_MODE=offline, to "
                         f"log without a login; `wandb sync` uploads later)") from None
    self._wandb = wandb
    with open(id_path, "w") as f:
      f.write(self._run.id + "\n")

  @property
  def enabled(self) -> bool:
    return self._run is not None

  @property
  def run_dir(self) -> str | None:
    """The W&B run's local folder (holding its ``run-<id>.wandb`` file), when on."""
    return os.path.dirname(self._run.dir) if self._run is not None else None

  def write(self, record: Mapping[str, Any]) -> None:
    if self._run is None:
      return
    data = scalars(record)
    if data:
      self._run.log(data, step=int(record["step"]))

  def add_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
    """One table per evaluation: a row per sample (observe/samples.py's records)."""
    if self._run is None or not samples:
      return
    table = self._wandb.Table(columns=list(SAMPLE_COLUMNS))
    for s in samples:
      table.add_data(int(step), int(s["index"]), str(s["prompt"]), str(s["response"]),
                     float(s["reward"]), bool(s["correct"]), str(s["answer"]))
    self._run.log({SAMPLES_KEY: table}, step=int(step))

  def close(self, exit_code: int = 0) -> None:
    if self._run is not None:
      self._run.finish(exit_code=exit_code)
      self._run = None
