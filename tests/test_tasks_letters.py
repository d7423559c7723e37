"""The built-in letter-counting task: worked answers, determinism, disjoint splits, the
verifier, the warm start's demonstrations and the registry's ``builtin:letters``."""

import re

import pytest

from distflow_jax import rewards
from distflow_jax.tasks import letters as lt
from distflow_jax.tasks import registry

_PROMPT_RE = re.compile(r"^How many '([a-z])' in '([a-z]+)'\?$")


def test_worked_answer_hand_examples():
  assert lt.worked_answer("banana", "a") == "ba1na2na3\n#### 3"
  assert lt.worked_answer("banana", "b") == "b1anana\n#### 1"
  assert lt.worked_answer("banana", "z") == "banana\n#### 0"
  assert lt.prompt("banana", "a") == "How many 'a' in 'banana'?"


@pytest.mark.parametrize("level", list(lt.PRESETS))
def test_records_are_correct_short_and_verified(level):
  cfg = lt.preset(level)
  recs = lt.make_examples(cfg, "train", 300, seed=3)
  counts = set()
  for r in recs:
    assert set(r) == {"prompt", "answer", "data_source"} and r["data_source"] == "letters"
    letter, word = _PROMPT_RE.match(r["prompt"]).groups()
    assert cfg.min_len <= len(word) <= cfg.max_len and set(word) <= set(cfg.alphabet)
    assert lt.final_answer(r) == word.count(letter)  # Python's own count is the oracle
    counts.add(word.count(letter))
    steps = r["answer"].splitlines()[0]
    assert re.sub(r"\d", "", steps) == word  # the worked line spells the string
    # Within the default run's lengths: prompt <= 32 characters, answer + EOS <= 32.
    assert len(r["prompt"]) <= 32 and len(r["answer"]) <= 31
    assert rewards.math_reward(r["answer"], r["answer"]) == 1.0
    assert rewards.format_reward(r["answer"]) == 1.0
    assert rewards.math_reward(f"#### {lt.final_answer(r) + 1}", r["answer"]) == 0.0
  assert 0 in counts and len(counts) >= 3  # absent letters and several counts occur


def test_deterministic_by_seed_and_unique():
  cfg = lt.preset("basic")
  a = lt.make_examples(cfg, "train", 300, seed=7)
  assert a == lt.make_examples(cfg, "train", 300, seed=7)
  assert a != lt.make_examples(cfg, "train", 300, seed=8)
  assert len({r["prompt"] for r in a}) == 300


@pytest.mark.parametrize("level", list(lt.PRESETS))
def test_train_and_eval_are_disjoint(level):
  cfg = lt.preset(level)
  train = [r for s in (0, 1) for r in lt.make_examples(cfg, "train", 1000, seed=s)]
  evals = [r for s in (0, 5) for r in lt.make_examples(cfg, "eval", 256, seed=s)]
  assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
  assert not {r["answer"] for r in train} & {r["answer"] for r in evals}


def test_too_small_a_question_space_is_refused():
  tiny = lt.LettersConfig(min_len=1, max_len=1, alphabet="ab", absent_prob=0.0)
  with pytest.raises(ValueError, match="too small"):
    lt.make_examples(tiny, "train", 50, seed=0)
  with pytest.raises(ValueError, match="unknown split"):
    lt.make_examples(tiny, "test", 1, seed=0)
  with pytest.raises(ValueError, match="max_len"):
    lt.LettersConfig(max_len=14)
  with pytest.raises(ValueError, match="unknown letters preset"):
    lt.preset("huge")


def test_demonstrations_mix_conventions_and_come_from_train():
  task, level = registry.parse("builtin:letters")
  assert task is lt.TASK and level == "basic"
  demos = task.demonstrations(level, 400, seed=0, plain_answer_prob=0.5)
  assert len(demos) == 400
  plain = [d for d in demos if d["completion"].endswith(".")]
  assert 100 < len(plain) < 300  # about half end "The answer is N.", which scores 0
  evals = {r["prompt"] for r in task.generate_split(level, "eval", 256, seed=0)}
  for d in demos:
    letter, word = _PROMPT_RE.match(d["prompt"]).groups()
    assert d["prompt"] not in evals
    want = word.count(letter)
    score = rewards.math_reward(d["completion"], lt.worked_answer(word, letter))
    assert score == (0.0 if d in plain else 1.0)
    if d in plain:
      assert d["completion"].endswith(f"The answer is {want}.")


def test_registry_names_the_task_and_its_levels():
  assert "letters" in registry.names()
  assert "letters: easy|basic|medium|hard" in registry.usage()
  assert registry.parse("builtin:letters:hard") == (lt.TASK, "hard")
  with pytest.raises(registry.UnknownTaskError, match="easy|basic"):
    registry.parse("builtin:letters:nope")


def test_trainer_writes_the_builtin_splits(tmp_path):
  from distflow_jax.config import loading
  from distflow_jax.run import trainer
  cfg = loading.load("grpo:tiny", [f"run_dir={tmp_path}", "data.train=builtin:letters:easy",
                                   "data.eval=builtin:letters:easy", "data.eval_size=64"])
  train_path, eval_path = trainer.dataset_paths(cfg)
  assert train_path.endswith("letters_easy_train.jsonl")
  rows = registry.read_jsonl(eval_path)
  assert len(rows) == 64 and all(r["data_source"] == "letters" for r in rows)
  assert not {r["prompt"] for r in rows} & {r["prompt"] for r in registry.read_jsonl(train_path)}
