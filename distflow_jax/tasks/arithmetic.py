"""Built-in verifiable task: small arithmetic problems with integer answers.

Records are ``{"prompt": str, "answer": str, "data_source": "arithmetic"}``.
The answer is a GSM8K-style worked solution, one operation per line in
precedence order, ending with ``#### <result>``; it is both the ground truth
for the ``math`` reward and the SFT target of the warm start::

  prompt: What is 12 + 7 * 3?
  answer: 7 * 3 = 21
          12 + 21 = 33
          #### 33

Train and eval splits are disjoint by construction: every question is
assigned to a split by a hash of its worked answer, and each split only keeps
its own questions.  So no expression, whatever its wording, is in both, and
neither is any worked solution (``6 + 2 * 3`` and ``2 * 3 + 6`` share one and
hence a split).  Seeds choose *which* questions of a split are drawn, so any
train seed and any eval seed are disjoint.

Write the default splits as JSONL::

  python -m distflow_jax.tasks.arithmetic --out /tmp/arith --train 5000 --eval 500
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
from typing import Callable, Iterable, Sequence

DATA_SOURCE = "arithmetic"
SPLITS = ("train", "eval")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana")
_ITEMS = ("apple", "pen", "card", "stamp", "marble", "book", "shell", "coin")


@dataclasses.dataclass(frozen=True)
class ArithmeticConfig:
  """Difficulty knobs.

  Operands are drawn from [min_value, max_value], except the factors of a
  ``*``, drawn from [min_value, max_mul_operand] to keep products small.
  ``allow_negative=False`` rejects questions with a negative intermediate or
  final result.  ``word_problem_prob`` is the chance a question is worded as
  a short story instead of "What is ...?".  ``eval_fraction`` is the share of
  the question space reserved for the eval split.
  """
  min_operands: int = 2
  max_operands: int = 3
  min_value: int = 1
  max_value: int = 20
  operators: tuple[str, ...] = ("+", "-", "*")
  max_mul_operand: int = 9
  allow_negative: bool = False
  word_problem_prob: float = 0.0
  eval_fraction: float = 0.1

  def __post_init__(self):
    if not 2 <= self.min_operands <= self.max_operands:
      raise ValueError(f"need 2 <= min_operands ({self.min_operands}) <= "
                       f"max_operands ({self.max_operands})")
    if not 0 <= self.min_value <= self.max_value:
      raise ValueError(f"need 0 <= min_value ({self.min_value}) <= max_value "
                       f"({self.max_value})")
    bad = [op for op in self.operators if op not in _OPS]
    if bad or not self.operators:
      raise ValueError(f"operators {self.operators!r}: unknown {bad}; valid: "
                       f"{', '.join(_OPS)}")
    if "*" in self.operators and self.max_mul_operand < self.min_value:
      raise ValueError(f"max_mul_operand ({self.max_mul_operand}) < min_value "
                       f"({self.min_value})")
    if not 0.0 <= self.word_problem_prob <= 1.0:
      raise ValueError(f"word_problem_prob must be in [0, 1], got "
                       f"{self.word_problem_prob}")
    if not 0.0 < self.eval_fraction < 1.0:
      raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")


PRESETS = {
    # One-digit sums and differences: a tiny model learns these fast.
    "easy": ArithmeticConfig(min_operands=2, max_operands=2, max_value=9,
                             operators=("+", "-")),
    # Chains of 2-3 one-digit sums and differences: every step is a small fact seen often in
    # training, the chains are new.  The default run's task: a short warm start is right
    # part of the time, and RL improves it.
    "basic": ArithmeticConfig(min_operands=2, max_operands=3, max_value=9,
                              operators=("+", "-"), eval_fraction=0.2),
    # 2-3 operands, up to 20, small products: right sometimes after a short SFT.
    "medium": ArithmeticConfig(),
    "hard": ArithmeticConfig(max_value=99, max_mul_operand=12),
    # Two-step word problems in prose (three operands up to 10, sums and differences), no
    # answer format asked for: the real-model recipe's task (configs/grpo.py:smollm2).
    # SmolLM2-135M-Instruct answers 11.5% of 200 held-out ones right (greedy, its last number).
    "words": ArithmeticConfig(min_operands=3, max_operands=3, max_value=10,
                              operators=("+", "-"), word_problem_prob=1.0, eval_fraction=0.2),
}


def preset(name: str) -> ArithmeticConfig:
  try:
    return PRESETS[name]
  except KeyError:
    raise ValueError(f"unknown arithmetic preset {name!r}; valid: "
                     f"{', '.join(PRESETS)}") from None


# --------------------------------------------------------------------------
# Expressions and worked answers.


def expression(operands: Sequence[int], ops: Sequence[str]) -> str:
  parts = [str(operands[0])]
  for op, x in zip(ops, operands[1:]):
    parts += [op, str(x)]
  return " ".join(parts)


def solve_steps(operands: Sequence[int], ops: Sequence[str]
                ) -> tuple[list[tuple[int, str, int, int]], int]:
  """The operations (a, op, b, result) in evaluation order, and the result.

  Products first (left to right), then sums and differences left to right:
  the usual precedence, one binary operation per step.
  """
  if len(operands) != len(ops) + 1:
    raise ValueError(f"{len(operands)} operands need {len(operands) - 1} "
                     f"operators, got {len(ops)}")
  vals, ops = list(operands), list(ops)
  steps = []
  for prec in (("*",), ("+", "-")):
    i = 0
    while i < len(ops):
      if ops[i] in prec:
        a, b = vals[i], vals[i + 1]
        r = _OPS[ops[i]](a, b)
        steps.append((a, ops[i], b, r))
        vals[i:i + 2] = [r]
        del ops[i]
      else:
        i += 1
  return steps, vals[0]


def worked_answer(operands: Sequence[int], ops: Sequence[str]) -> str:
  steps, result = solve_steps(operands, ops)
  lines = [f"{a} {op} {b} = {r}" for a, op, b, r in steps]
  return "\n".join(lines + [f"#### {result}"])


def _terms(operands: Sequence[int], ops: Sequence[str]) -> list[tuple[str, list[int]]]:
  """The expression as signed products: [(sign, factors), ...]."""
  terms = [("+", [operands[0]])]
  for op, x in zip(ops, operands[1:]):
    if op == "*":
      terms[-1][1].append(x)
    else:
      terms.append((op, [x]))
  return terms


def word_problem(operands: Sequence[int], ops: Sequence[str],
                 rng: random.Random) -> str | None:
  """A short story for the expression, or None if it has no simple wording
  (a product of three or more factors)."""
  terms = _terms(operands, ops)
  if any(len(f) > 2 for _, f in terms):
    return None
  name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
  _, first = terms[0]
  if len(first) == 1:
    sentences = [f"{name} has {first[0]} {item}s."]
  else:
    sentences = [f"{name} has {first[0]} boxes with {first[1]} {item}s in each."]
  for sign, f in terms[1:]:
    if sign == "+":
      sentences.append(f"{name} gets {f[0]} more." if len(f) == 1 else
                       f"{name} buys {f[0]} packs of {f[1]} {item}s each.")
    else:
      sentences.append(f"{name} gives away {f[0]}." if len(f) == 1 else
                       f"{name} gives away {f[0]} bags of {f[1]} {item}s each.")
  sentences.append(f"How many {item}s does {name} have now?")
  return " ".join(sentences)


# --------------------------------------------------------------------------
# Sampling and splits.


def split_of(key: str, eval_fraction: float) -> str:
  """'eval' or 'train' for a question, from a stable hash of its key (the
  worked answer)."""
  h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
  return "eval" if h / 2.0 ** 64 < eval_fraction else "train"


def _sample(cfg: ArithmeticConfig, rng: random.Random
            ) -> tuple[list[int], list[str]] | None:
  n = rng.randint(cfg.min_operands, cfg.max_operands)
  ops = [rng.choice(cfg.operators) for _ in range(n - 1)]
  in_product = [False] * n
  for i, op in enumerate(ops):
    if op == "*":
      in_product[i] = in_product[i + 1] = True
  operands = [rng.randint(cfg.min_value, cfg.max_mul_operand if p else cfg.max_value)
              for p in in_product]
  if not cfg.allow_negative:
    steps, _ = solve_steps(operands, ops)
    if any(r < 0 for *_, r in steps):
      return None
  return operands, ops


def draw_records(task: str, config: object, split: str, num_examples: int, seed: int,
                 draw: Callable[[random.Random], tuple[str, str, Callable[[], dict]] | None],
                 *, eval_fraction: float, unique: bool, widen: str) -> list[dict[str, str]]:
  """The built-in tasks' draw: ``num_examples`` records of ``split``, deterministic in
  ``task`` and ``seed``.  ``draw(rng)`` gives ``(split key, question, build)`` or None (a
  sample the task skips); a sample is kept when ``split_of(split key)`` is ``split`` and,
  with ``unique``, its question is new; ``build()`` then makes its record (it may draw
  from ``rng`` too).  Raises ValueError naming ``widen`` when the question space is too
  small to supply that many."""
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
  if num_examples < 0:
    raise ValueError(f"num_examples must be >= 0, got {num_examples}")
  rng = random.Random(f"{task}:{split}:{seed}")
  records, seen = [], set()
  max_tries = 200 * num_examples + 10_000
  for _ in range(max_tries):
    if len(records) == num_examples:
      break
    sample = draw(rng)
    if sample is None:
      continue
    key, question, build = sample
    if split_of(key, eval_fraction) != split or (unique and question in seen):
      continue
    seen.add(question)
    records.append(build())
  if len(records) < num_examples:
    raise ValueError(f"found only {len(records)} of {num_examples} distinct {split} questions "
                     f"in {max_tries} tries: the question space of {config} is too small; "
                     f"{widen}")
  return records


def make_examples(config: ArithmeticConfig, split: str, num_examples: int, seed: int,
                  *, unique: bool = True) -> list[dict[str, str]]:
  """``num_examples`` deterministic records of ``split`` for ``seed``.

  ``unique``: no question (expression) repeats within the returned list.
  Raises ValueError if the config's question space for the split is too
  small to supply that many.
  """
  def draw(rng):
    sample = _sample(config, rng)
    if sample is None:
      return None
    operands, ops = sample
    expr = expression(operands, ops)
    answer = worked_answer(operands, ops)

    def build():
      prompt = None
      if config.word_problem_prob and rng.random() < config.word_problem_prob:
        prompt = word_problem(operands, ops, rng)
      return {"prompt": prompt or f"What is {expr}?", "answer": answer,
              "data_source": DATA_SOURCE}
    return answer, expr, build

  return draw_records("arithmetic", config, split, num_examples, seed, draw,
                      eval_fraction=config.eval_fraction, unique=unique,
                      widen="widen max_value, operators or operands, or pass unique=False")


def final_answer(record: dict[str, str]) -> int:
  """The integer after ``####`` in a record's answer."""
  return int(record["answer"].rsplit("####", 1)[1].strip())


def sft_examples(records: Iterable[dict[str, str]], plain_answer_prob: float = 0.0,
                 seed: int = 0) -> list[dict[str, str]]:
  """(prompt, completion) pairs for the supervised warm start: the worked
  answer is the target completion.

  ``plain_answer_prob`` imitates a teacher that mixes answer conventions: that
  share of completions ends with ``The answer is N.`` instead of ``#### N``.
  The math verifier accepts only ``#### N`` (or ``\\boxed{N}``), so such an
  answer scores 0 however right N is.
  """
  if not 0.0 <= plain_answer_prob <= 1.0:
    raise ValueError(f"plain_answer_prob must be in [0, 1], got {plain_answer_prob}")
  rng = random.Random(f"sft:{seed}")
  out = []
  for r in records:
    answer = r["answer"]
    if plain_answer_prob and rng.random() < plain_answer_prob:
      steps, _, result = answer.rpartition("#### ")
      answer = f"{steps}The answer is {result}."
    out.append({"prompt": r["prompt"], "completion": answer})
  return out


def write_jsonl(records: Iterable[dict], path: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp"  # processes may write the same file at once
  with open(tmp, "w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(r, ensure_ascii=False) + "\n")
  os.replace(tmp, path)  # never leave a half-written file under the real name


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def main(argv: Sequence[str] | None = None) -> None:
  p = argparse.ArgumentParser(description="Write arithmetic train/eval JSONL.")
  p.add_argument("--out", required=True, help="output directory")
  p.add_argument("--preset", default="medium", choices=sorted(PRESETS))
  p.add_argument("--train", type=int, default=5000)
  p.add_argument("--eval", type=int, default=500)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  cfg = preset(args.preset)
  for split, n in (("train", args.train), ("eval", args.eval)):
    path = os.path.join(args.out, f"{split}.jsonl")
    write_jsonl(make_examples(cfg, split, n, args.seed), path)
    print(f"wrote {n} {split} records to {path}")


if __name__ == "__main__":
  main()
