"""optax optimizers built from a config section (``actor.optimizer``...)."""

from __future__ import annotations

import optax

OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("constant", "cosine", "linear")


def learning_rate(lr: float, schedule: str, warmup_steps: int, total_steps: int) -> optax.Schedule:
  """Linear warm-up to ``lr`` over ``warmup_steps``, then constant, cosine or linear decay."""
  if schedule not in SCHEDULES:
    raise ValueError(f"optimizer.schedule={schedule!r} is not valid; choose one of "
                     f"{list(SCHEDULES)}")
  if warmup_steps < 0 or total_steps < 1:
    raise ValueError(f"warmup_steps={warmup_steps} must be >= 0 and total_steps="
                     f"{total_steps} >= 1")
  decay_steps = max(total_steps - warmup_steps, 1)
  if schedule == "constant":
    after = optax.constant_schedule(lr)
  elif schedule == "cosine":
    after = optax.cosine_decay_schedule(lr, decay_steps)
  else:
    after = optax.linear_schedule(lr, 0.0, decay_steps)
  if warmup_steps == 0:
    return after
  warm = optax.linear_schedule(0.0, lr, warmup_steps)
  return optax.join_schedules([warm, after], [warmup_steps])


def make_optimizer(*, name: str, lr: float, weight_decay: float, b1: float, b2: float,
                   eps: float, schedule: str, warmup_steps: int, grad_clip: float,
                   total_steps: int) -> optax.GradientTransformation:
  """The optimizer of one role; keyword names match the config section's keys."""
  sched = learning_rate(lr, schedule, warmup_steps, total_steps)
  if name == "adamw":
    opt = optax.adamw(sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
  elif name == "adam":
    opt = optax.adam(sched, b1=b1, b2=b2, eps=eps)
  elif name == "sgd":
    opt = optax.sgd(sched)
  else:
    raise ValueError(f"optimizer.name={name!r} is not valid; choose one of {list(OPTIMIZERS)}")
  if grad_clip and grad_clip > 0:
    opt = optax.chain(optax.clip_by_global_norm(grad_clip), opt)
  return opt


def from_config(section, total_steps: int) -> optax.GradientTransformation:
  """``section`` is a config's ``<role>.optimizer`` ConfigDict (or a plain dict)."""
  return make_optimizer(total_steps=total_steps, **dict(section))
