"""Built-in task ``builtin:calc``: multi-digit products, made for the ``calc`` tool.

Records are ``{"prompt", "answer", "data_source": "calc"}``; the answer is ``#### N``, as
the ``math`` reward reads it::

  prompt: What is 347 * 28?
  answer: #### 9716

Products of a 3-digit and a 2-digit number (``basic``) are beyond the tiny built-in model
without working; with ``rollout.env=calc`` (envs/calc.py) it can ask the calculator and copy
the result.  The warm start's demonstrations show both ways: a share ``tool_prob`` of them
call the tool, see its observation and answer, the rest answer at once::

  <tool>calc(347 * 28)</tool> = 9716
  #### 9716

(the observation `` = 9716`` + newline is the environment's, written as the environment writes it).
In a run without the environment the same text is a single response, the "observation"
the model's own guess.

Train and eval splits are disjoint as arithmetic's are: each question goes to a split by
a stable hash of ``a*b``; seeds only choose which questions of a split are drawn.

    rows = make_examples(preset("basic"), "eval", 256, seed=0)
    demos = TASK.demonstrations("basic", 8000, seed=0)
"""

from __future__ import annotations

import dataclasses
import random

from distflow_jax.envs import calc as calc_env
from distflow_jax.tasks import arithmetic

DATA_SOURCE = "calc"
SPLITS = arithmetic.SPLITS


@dataclasses.dataclass(frozen=True)
class CalcConfig:
  """``a * b`` with ``a`` of ``a_digits`` digits and ``b`` of ``b_digits``; ``tool_prob``:
  the share of warm-start demonstrations that call the tool; ``eval_fraction``: the
  share of the question space kept for the eval split."""
  a_digits: int = 3
  b_digits: int = 2
  tool_prob: float = 0.3
  eval_fraction: float = 0.2

  def __post_init__(self):
    for name in ("a_digits", "b_digits"):
      if not 1 <= getattr(self, name) <= 6:
        raise ValueError(f"{name} must be in [1, 6], got {getattr(self, name)}")
    if not 0.0 <= self.tool_prob <= 1.0:
      raise ValueError(f"tool_prob must be in [0, 1], got {self.tool_prob}")
    if not 0.0 < self.eval_fraction < 1.0:
      raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")


PRESETS = {
    "easy": CalcConfig(a_digits=2, b_digits=2),
    "basic": CalcConfig(),
    "hard": CalcConfig(a_digits=3, b_digits=3),
}


def preset(name: str) -> CalcConfig:
  try:
    return PRESETS[name]
  except KeyError:
    raise ValueError(f"unknown calc preset {name!r}; valid: {', '.join(PRESETS)}") from None


def prompt(a: int, b: int) -> str:
  return f"What is {a} * {b}?"


def _number(digits: int, rng: random.Random) -> int:
  return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def make_examples(config: CalcConfig, split: str, num_examples: int, seed: int,
                  *, unique: bool = True) -> list[dict[str, str]]:
  """``num_examples`` deterministic records of ``split`` for ``seed``; ``unique``: no
  question repeats.  Raises ValueError when the split's question space is too small."""
  def draw(rng):
    a, b = _number(config.a_digits, rng), _number(config.b_digits, rng)
    key = f"{a}*{b}"
    return key, key, lambda: {"prompt": prompt(a, b), "answer": f"#### {a * b}",
                              "data_source": DATA_SOURCE}

  return arithmetic.draw_records("calc", config, split, num_examples, seed, draw,
                                 eval_fraction=config.eval_fraction, unique=unique,
                                 widen="use more digits, or pass unique=False")


def operands(record: dict[str, str]) -> tuple[int, int]:
  """``(a, b)`` of a record's prompt."""
  a, _, b = record["prompt"][len("What is "):-1].partition(" * ")
  return int(a), int(b)


def tool_completion(record: dict[str, str]) -> str:
  """The call, the calculator's observation, then the answer (module doc)."""
  a, b = operands(record)
  expr = f"{a} * {b}"  # as the prompt writes it: the call copies the prompt's text
  return calc_env.call_text(expr) + calc_env.observation(calc_env.evaluate(expr)) + record["answer"]


def demonstrations(config: CalcConfig, count: int, *, seed: int,
                   plain_answer_prob: float = 0.0) -> list[dict[str, str]]:
  """``count`` (prompt, completion) pairs drawn from the train split with ``seed + 1`` (RL's
  train draw uses ``seed``): ``config.tool_prob`` of them use the tool; ``plain_answer_prob``
  of all end in "The answer is N." (which the verifier rejects), as arithmetic's teacher."""
  records = make_examples(config, "train", count, seed=seed + 1, unique=False)
  rng = random.Random(f"calc-tool:{seed}")
  worked = [dict(r, answer=tool_completion(r)) if rng.random() < config.tool_prob else r
            for r in records]
  return arithmetic.sft_examples(worked, plain_answer_prob=plain_answer_prob, seed=seed)


@dataclasses.dataclass(frozen=True)
class CalcTask:
  """The task as tasks/registry.py names it: ``builtin:calc[:<level>]``."""

  name: str = DATA_SOURCE
  levels: tuple[str, ...] = tuple(PRESETS)
  default_level: str = "basic"

  def generate_split(self, level: str, split: str, count: int, *, seed: int,
                     unique: bool = True) -> list[dict[str, str]]:
    return make_examples(preset(level), split, count, seed=seed, unique=unique)

  def demonstrations(self, level: str, count: int, *, seed: int,
                     plain_answer_prob: float = 0.0) -> list[dict[str, str]]:
    return demonstrations(preset(level), count, seed=seed, plain_answer_prob=plain_answer_prob)


TASK = CalcTask()
