"""optax optimizers built from a config section (``actor.optimizer``...).

``Optimizer`` and ``Schedule`` are the option enums the config's ``name`` and
``schedule`` are checked against (``config.values``); dispatch is by member.
``with_master_weights`` keeps float32 master parameters (and so float32 moments)
in the optimizer state of a model whose parameters are 16-bit.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from distflow_jax.algos.choice import Choice


class Optimizer(Choice):
  """optimizer"""
  ADAMW = "adamw"
  ADAM = "adam"
  SGD = "sgd"


class Schedule(Choice):
  """learning-rate schedule"""
  CONSTANT = "constant"
  COSINE = "cosine"
  LINEAR = "linear"


# The config's spellings, for messages and docs.
OPTIMIZERS = tuple(o.value for o in Optimizer)
SCHEDULES = tuple(s.value for s in Schedule)


def _parse(choice: type[Choice], value, key: str, names: tuple[str, ...]) -> Choice:
  try:
    return choice.parse(value)
  except ValueError:
    raise ValueError(f"{key}={value!r} is not valid; choose one of {list(names)}") from None


def learning_rate(lr: float, schedule: str | Schedule, warmup_steps: int,
                  total_steps: int) -> optax.Schedule:
  """Linear warm-up to ``lr`` over ``warmup_steps``, then constant, cosine or linear decay."""
  kind = _parse(Schedule, schedule, "optimizer.schedule", SCHEDULES)
  if warmup_steps < 0 or total_steps < 1:
    raise ValueError(f"warmup_steps={warmup_steps} must be >= 0 and total_steps="
                     f"{total_steps} >= 1")
  decay_steps = max(total_steps - warmup_steps, 1)
  if kind is Schedule.CONSTANT:
    after = optax.constant_schedule(lr)
  elif kind is Schedule.COSINE:
    after = optax.cosine_decay_schedule(lr, decay_steps)
  else:
    after = optax.linear_schedule(lr, 0.0, decay_steps)
  if warmup_steps == 0:
    return after
  warm = optax.linear_schedule(0.0, lr, warmup_steps)
  return optax.join_schedules([warm, after], [warmup_steps])


def make_optimizer(*, name: str | Optimizer, lr: float, weight_decay: float, b1: float,
                   b2: float, eps: float, schedule: str | Schedule, warmup_steps: int,
                   grad_clip: float, total_steps: int) -> optax.GradientTransformation:
  """The optimizer of one role; keyword names match the config section's keys."""
  sched = learning_rate(lr, schedule, warmup_steps, total_steps)
  kind = _parse(Optimizer, name, "optimizer.name", OPTIMIZERS)
  if kind is Optimizer.ADAMW:
    opt = optax.adamw(sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
  elif kind is Optimizer.ADAM:
    opt = optax.adam(sched, b1=b1, b2=b2, eps=eps)
  else:
    opt = optax.sgd(sched)
  if grad_clip and grad_clip > 0:
    opt = optax.chain(optax.clip_by_global_norm(grad_clip), opt)
  return opt


def from_config(section, total_steps: int) -> optax.GradientTransformation:
  """``section`` is a config's ``<role>.optimizer`` (its ConfigDict, its typed view or a
  plain dict)."""
  return make_optimizer(total_steps=total_steps,
                        **(section.to_dict() if hasattr(section, "to_dict") else section))


class MasterState(NamedTuple):
  """``with_master_weights``'s state: the float32 parameters and the inner optimizer's."""
  master: Any
  inner: Any


def _f32(tree: Any) -> Any:
  return jax.tree.map(lambda x: x.astype(jnp.float32)
                      if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def with_master_weights(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` run on a float32 master copy of the parameters kept in the optimizer state.

  A bfloat16 parameter cannot take an update much smaller than itself (8 mantissa bits:
  lr * grad below ~1/256 of the weight rounds away); the master copy accumulates them.
  The update returned is float32 ``master - params``, so ``optax.apply_updates`` leaves
  the parameters at the master's rounding to their own dtype.
  """

  def init(params):
    # Own buffers even for float32 leaves (a critic's value head): the train step donates
    # parameters and optimizer state, and one buffer may not be donated twice.
    master = jax.tree.map(lambda x: x.copy(), _f32(params))
    return MasterState(master, tx.init(master))

  def update(grads, state, params=None):
    if params is None:
      raise ValueError("with_master_weights: update needs the parameters")
    updates, inner = tx.update(_f32(grads), state.inner, state.master)
    master = optax.apply_updates(state.master, updates)
    step = jax.tree.map(lambda m, p: m - p.astype(m.dtype), master, params)
    return step, MasterState(master, inner)

  return optax.GradientTransformation(init, update)
