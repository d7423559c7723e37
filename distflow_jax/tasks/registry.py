"""The registry of built-in tasks: what ``builtin:<task>[:<level>]`` names.

A built-in task generates its own verifiable data, so a run needs no files:
``data.train="builtin:arithmetic:basic"`` makes the trainer write that
task's train split into the run directory, and the warm start of the
built-in model learns the task's answer format from its demonstrations.

    task, level = parse("builtin:arithmetic:easy")
    rows = task.generate_split(level, "eval", 256, seed=0, unique=True)
    demos = task.demonstrations(level, 8000, seed=0)

A task is any object with the ``Task`` attributes; ``register`` adds one
(e.g. from a config plugin) under its ``name``.  Unknown names and levels
raise ``UnknownTaskError`` listing the valid ones.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from distflow_jax.tasks import arithmetic, calc, letters, shapes

PREFIX = "builtin:"

# Rows of any task as JSONL, atomically (processes may write the same file at once).
write_jsonl = arithmetic.write_jsonl
read_jsonl = arithmetic.read_jsonl


class UnknownTaskError(ValueError):
  """A task name or level that is not registered; the message lists the valid ones."""


class Task(Protocol):
  """A built-in task.  Rows are ``{"prompt", "answer", ...}`` dicts, as the data loader reads
  them; demonstrations are ``{"prompt", "completion"}`` dicts for supervised training."""

  name: str
  levels: tuple[str, ...]
  default_level: str
  # Optional: a task whose rows carry images names their field as ``image_key`` (read it
  # with ``image_key(task)``; absent or '' = a text task).

  def generate_split(self, level: str, split: str, count: int, *, seed: int,
                     unique: bool = True) -> list[dict[str, str]]:
    """``count`` rows of ``split`` ("train" or "eval", disjoint), deterministic in ``seed``;
    ``unique``: no question repeats."""

  def demonstrations(self, level: str, count: int, *, seed: int,
                     plain_answer_prob: float = 0.0) -> list[dict[str, str]]:
    """``count`` worked (prompt, completion) pairs from the train split; ``plain_answer_prob``
    of them end in a convention the task's verifier does not accept (see the warm start)."""


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
  """Small arithmetic problems with worked answers (tasks/arithmetic.py)."""

  name: str = arithmetic.DATA_SOURCE
  levels: tuple[str, ...] = tuple(arithmetic.PRESETS)
  default_level: str = "medium"

  def generate_split(self, level: str, split: str, count: int, *, seed: int,
                     unique: bool = True) -> list[dict[str, str]]:
    return arithmetic.make_examples(arithmetic.preset(level), split, count, seed=seed, unique=unique)

  def demonstrations(self, level: str, count: int, *, seed: int,
                     plain_answer_prob: float = 0.0) -> list[dict[str, str]]:
    # Questions are drawn with seed + 1: the RL train split of the same run is drawn with
    # `seed`, so the warm start sees other questions than the ones RL then trains on.
    records = arithmetic.make_examples(arithmetic.preset(level), "train", count, seed=seed + 1,
                                  unique=False)
    return arithmetic.sft_examples(records, plain_answer_prob=plain_answer_prob, seed=seed)


TASKS: dict[str, Task] = {}


def register(task: Task) -> None:
  """Adds ``task`` under ``task.name``; a name is registered once."""
  if task.name in TASKS:
    raise ValueError(f"built-in task {task.name!r} is already registered")
  if task.default_level not in task.levels:
    raise ValueError(f"built-in task {task.name!r}: default level {task.default_level!r} is "
                     f"not one of its levels {list(task.levels)}")
  TASKS[task.name] = task


register(ArithmeticTask())
register(letters.TASK)  # letter counting (tasks/letters.py)
register(shapes.TASK)  # counting coloured shapes in an image (tasks/shapes.py)
register(calc.TASK)  # multi-digit products with a calculator tool (tasks/calc.py)


def names() -> list[str]:
  return sorted(TASKS)


def usage() -> str:
  """How to name a built-in task, with every task's levels (for error messages)."""
  levels = "; ".join(f"{t.name}: {'|'.join(t.levels)}" for t in sorted(TASKS.values(),
                                                                       key=lambda t: t.name))
  return f"builtin:<task>[:<level>], levels {levels}"


def image_key(task: Task) -> str:
  """The row field holding a task's images ('' for a text task): such a task can only be
  trained on with images (config/values.py refuses it in text runs)."""
  return getattr(task, "image_key", "") or ""


def is_builtin(spec: str) -> bool:
  """Whether a data spec names a built-in task rather than a file."""
  return spec.startswith(PREFIX)


def get(name: str) -> Task:
  if name not in TASKS:
    raise UnknownTaskError(f"unknown built-in task {name!r}; valid: {names()} ({usage()})")
  return TASKS[name]


def parse(spec: str) -> tuple[Task, str]:
  """``builtin:<task>[:<level>]`` -> (task, level); the level defaults to the task's."""
  if not is_builtin(spec):
    raise UnknownTaskError(f"{spec!r} is not a built-in task spec ({usage()})")
  name, _, level = spec[len(PREFIX):].partition(":")
  task = get(name)
  level = level or task.default_level
  if level not in task.levels:
    raise UnknownTaskError(f"built-in task {name!r} has no level {level!r}; valid: "
                           f"{'|'.join(task.levels)}")
  return task, level
