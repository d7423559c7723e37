"""Config checks of vision-language runs: which combinations take images.

A run has images when `data.image_key` is set or `data.train` is a built-in visual task
(tasks/shapes.py).  This slice supports them with a Qwen2.5-VL checkpoint in `model.path`
(the built-in models are text-only), the `reference` rollout backend, padded passes
(no `model.pack_sequences`) and a frozen vision tower (`model.train_vision=False`); any
other combination is refused in one line naming the setting to change, because a run that
silently ignored the images would train on the questions alone.
"""

from __future__ import annotations

from distflow_jax.config.errors import ConfigError
from distflow_jax.tasks import registry as tasks


def _task_image_key(spec) -> str:
  if not isinstance(spec, str) or not tasks.is_builtin(spec):
    return ""
  try:
    task, _ = tasks.parse(spec)
  except tasks.UnknownTaskError:
    return ""  # named with the valid tasks where the data is prepared (dataset_paths)
  return tasks.image_key(task)


def run_image_key(cfg) -> str:
  """The row field holding the run's images ('' for a text-only run)."""
  d = cfg.data
  return d.image_key or _task_image_key(d.train)


def check_images(cfg) -> None:
  d, m = cfg.data, cfg.model
  if not isinstance(d.image_key, str):
    raise ConfigError(f"data.image_key={d.image_key!r} must be a field name ('' = text-only)")
  if m.train_vision:
    raise ConfigError("model.train_vision=True: training the vision tower is not built yet; "
                      "leave it False (the tower is frozen, its features computed once per "
                      "prompt)")
  key = run_image_key(cfg)
  eval_key = _task_image_key(d.eval)
  if eval_key and not key:
    raise ConfigError(f"data.eval={d.eval!r} is a vision task but data.train is text-only: "
                      f"evaluate on a text task, or train on images too")
  if not key:
    return
  where = f"data.image_key={key!r}" if d.image_key else f"data.train={d.train!r}"
  if m.lora.enabled:
    raise ConfigError(f"model.lora.enabled=True with images ({where}): LoRA on a "
                      f"vision-language model is not built yet; set model.lora.enabled=False")
  if not m.path:
    raise ConfigError(f"{where}: images need a Qwen2.5-VL checkpoint in model.path (the "
                      f"built-in models are text-only)")
  if cfg.rollout.backend != "reference":
    raise ConfigError(f"{where}: rollout.backend={cfg.rollout.backend!r} does not take images "
                      f"yet; set rollout.backend=reference")
  critic = [n.get("id", n.get("fn")) for n in cfg.dag
            if n.get("fn") in ("values", "train.critic")]
  if critic:
    raise ConfigError(f"{where}: the critic's passes (DAG nodes {critic}) do not take images "
                      f"yet; use a critic-free algorithm (e.g. configs/grpo.py)")
  if m.pack_sequences:
    raise ConfigError(f"{where}: model.pack_sequences=True does not take images yet; set "
                      f"model.pack_sequences=False")
