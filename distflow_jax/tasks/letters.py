"""Built-in verifiable task: count a letter's occurrences in a string.

A different kind of problem from arithmetic: no operations, but reading a string
letter by letter and keeping a running count.  Records are ``{"prompt", "answer",
"data_source": "letters"}``; the answer is a worked solution that copies the string
with the running count after each occurrence of the letter, then ``#### <count>``,
so the ``math`` reward (rewards/math_answer.py) verifies it::

  prompt: How many 'a' in 'banana'?
  answer: ba1na2na3
          #### 3

The strings are drawn from a small alphabet (so letters repeat); the letter asked is
one of the string's, or now and then one it lacks (count 0).  Prompts are short for a
character-level tokenizer: at most 32 characters at every level, and worked answers at
most 31 (the default run's max_new_tokens of 32, less the EOS).

Train and eval splits are disjoint as arithmetic's are: each question goes to a split
by a stable hash of its worked answer (which spells the string and, through the counts,
the letter; the count-0 questions of one string share one answer and hence one split),
and seeds only choose which questions of a split are drawn.

    rows = make_examples(preset("basic"), "eval", 256, seed=0)
    demos = TASK.demonstrations("basic", 8000, seed=0, plain_answer_prob=0.7)
"""

from __future__ import annotations

import dataclasses
import random

from distflow_jax.tasks import arithmetic

DATA_SOURCE = "letters"
SPLITS = arithmetic.SPLITS
MAX_COUNT = 9  # one-digit counts keep every worked answer within 31 characters


@dataclasses.dataclass(frozen=True)
class LettersConfig:
  """Difficulty knobs: string lengths in [min_len, max_len] over ``alphabet``;
  ``absent_prob``: the chance the letter asked is not in the string (count 0);
  ``eval_fraction``: the share of the question space kept for the eval split."""
  min_len: int = 4
  max_len: int = 8
  alphabet: str = "abcde"
  absent_prob: float = 0.1
  eval_fraction: float = 0.2

  def __post_init__(self):
    if not 1 <= self.min_len <= self.max_len <= 13:
      raise ValueError(f"need 1 <= min_len ({self.min_len}) <= max_len ({self.max_len}) "
                       f"<= 13 (longer strings overflow the 32-character prompt)")
    if len(set(self.alphabet)) != len(self.alphabet) or not self.alphabet.isalpha() \
        or not self.alphabet.islower():
      raise ValueError(f"alphabet {self.alphabet!r}: distinct lower-case letters wanted")
    if len(self.alphabet) < 2:
      raise ValueError(f"alphabet {self.alphabet!r}: at least 2 letters wanted")
    if not 0.0 <= self.absent_prob <= 1.0:
      raise ValueError(f"absent_prob must be in [0, 1], got {self.absent_prob}")
    if not 0.0 < self.eval_fraction < 1.0:
      raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")


PRESETS = {
    # Short strings of three letters: counts of 0-5.
    "easy": LettersConfig(min_len=3, max_len=6, alphabet="abc"),
    # The level that matches arithmetic:basic's budget: 4-8 letters of five.
    "basic": LettersConfig(),
    "medium": LettersConfig(min_len=5, max_len=10, alphabet="abcdefgh"),
    "hard": LettersConfig(min_len=8, max_len=13, alphabet="abcdefghijkl"),
}


def preset(name: str) -> LettersConfig:
  try:
    return PRESETS[name]
  except KeyError:
    raise ValueError(f"unknown letters preset {name!r}; valid: {', '.join(PRESETS)}") from None


def prompt(word: str, letter: str) -> str:
  return f"How many '{letter}' in '{word}'?"


def worked_answer(word: str, letter: str) -> str:
  """The string with the running count after each ``letter``, then ``#### count``."""
  out, count = [], 0
  for ch in word:
    out.append(ch)
    if ch == letter:
      count += 1
      out.append(str(count))
  return f"{''.join(out)}\n#### {count}"


def _sample(cfg: LettersConfig, rng: random.Random) -> tuple[str, str]:
  word = "".join(rng.choice(cfg.alphabet) for _ in range(rng.randint(cfg.min_len, cfg.max_len)))
  absent = [c for c in cfg.alphabet if c not in word]
  if absent and rng.random() < cfg.absent_prob:
    return word, rng.choice(absent)
  return word, rng.choice(word)  # letters that occur often are asked about often


def make_examples(config: LettersConfig, split: str, num_examples: int, seed: int,
                  *, unique: bool = True) -> list[dict[str, str]]:
  """``num_examples`` deterministic records of ``split`` for ``seed``; ``unique``: no
  question repeats.  Raises ValueError when the split's question space is too small."""
  def draw(rng):
    word, letter = _sample(config, rng)
    if word.count(letter) > MAX_COUNT:
      return None
    answer, question = worked_answer(word, letter), prompt(word, letter)
    return answer, question, lambda: {"prompt": question, "answer": answer,
                                      "data_source": DATA_SOURCE}

  return arithmetic.draw_records(
      "letters", config, split, num_examples, seed, draw, eval_fraction=config.eval_fraction,
      unique=unique, widen="widen the alphabet or lengths, or pass unique=False")


def final_answer(record: dict[str, str]) -> int:
  """The count after ``####`` in a record's answer."""
  return int(record["answer"].rsplit("####", 1)[1].strip())


@dataclasses.dataclass(frozen=True)
class LettersTask:
  """The task as tasks/registry.py names it: ``builtin:letters[:<level>]``."""

  name: str = DATA_SOURCE
  levels: tuple[str, ...] = tuple(PRESETS)
  default_level: str = "basic"

  def generate_split(self, level: str, split: str, count: int, *, seed: int,
                     unique: bool = True) -> list[dict[str, str]]:
    return make_examples(preset(level), split, count, seed=seed, unique=unique)

  def demonstrations(self, level: str, count: int, *, seed: int,
                     plain_answer_prob: float = 0.0) -> list[dict[str, str]]:
    # seed + 1, as arithmetic's: the warm start sees other questions than RL's train draw.
    records = make_examples(preset(level), "train", count, seed=seed + 1, unique=False)
    # The same teacher as arithmetic's: plain_answer_prob of the completions end with
    # "The answer is N." instead of "#### N", which the verifier rejects.
    return arithmetic.sft_examples(records, plain_answer_prob=plain_answer_prob, seed=seed)


TASK = LettersTask()
