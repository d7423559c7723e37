"""The built-in arithmetic task: determinism, disjoint splits, correct answers."""

import ast
import operator
import re

import pytest

from distflow_jax import rewards
from distflow_jax.tasks import arithmetic as ar

_EXPR_RE = re.compile(r"^What is (.+)\?$")
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _eval_expr(expr: str) -> int:
  """Independent reference: Python's own parser and precedence."""
  def ev(node):
    if isinstance(node, ast.BinOp):
      return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
    assert isinstance(node, ast.Constant) and isinstance(node.value, int)
    return node.value
  return ev(ast.parse(expr, mode="eval").body)


def test_worked_answer_hand_example():
  assert ar.worked_answer([12, 7, 3], ["+", "*"]) == "7 * 3 = 21\n12 + 21 = 33\n#### 33"
  assert ar.worked_answer([9, 4, 2], ["-", "+"]) == "9 - 4 = 5\n5 + 2 = 7\n#### 7"
  assert ar.worked_answer([2, 3, 4], ["*", "*"]) == "2 * 3 = 6\n6 * 4 = 24\n#### 24"
  with pytest.raises(ValueError, match="3 operands need 2 operators, got 1"):
    ar.worked_answer([1, 2, 3], ["+"])


def test_records_are_correct_and_well_formed():
  recs = ar.make_examples(ar.preset("medium"), "train", 400, seed=3)
  assert len(recs) == 400
  n_ops = set()
  for r in recs:
    assert set(r) == {"prompt", "answer", "data_source"}
    assert r["data_source"] == "arithmetic"
    expr = _EXPR_RE.match(r["prompt"]).group(1)
    want = _eval_expr(expr)
    assert ar.final_answer(r) == want
    assert want >= 0
    # Every worked step is itself right, and the answer verifies as correct.
    for line in r["answer"].splitlines()[:-1]:
      lhs, rhs = line.split(" = ")
      assert _eval_expr(lhs) == int(rhs)
    assert rewards.math_reward(r["answer"], r["answer"]) == 1.0
    assert rewards.format_reward(r["answer"]) == 1.0
    assert rewards.math_reward(f"#### {want + 1}", r["answer"]) == 0.0
    nums = [int(x) for x in re.findall(r"\d+", expr)]
    n_ops.add(len(nums))
    assert all(1 <= x <= 20 for x in nums)
    for a, b in re.findall(r"(\d+) \* (?=(\d+))", expr):
      assert int(a) <= 9 and int(b) <= 9
  assert n_ops == {2, 3}


def test_deterministic_by_seed_and_unique():
  cfg = ar.preset("medium")
  a = ar.make_examples(cfg, "train", 200, seed=7)
  assert a == ar.make_examples(cfg, "train", 200, seed=7)
  assert a != ar.make_examples(cfg, "train", 200, seed=8)
  assert len({r["prompt"] for r in a}) == 200


@pytest.mark.parametrize("name", ["easy", "basic", "medium"])
def test_train_and_eval_are_disjoint(name):
  cfg = ar.preset(name)
  n_eval = {"easy": 12, "basic": 300, "medium": 300}[name]
  n_train = {"easy": 100, "basic": 1500, "medium": 3000}[name]
  train = [r for s in (0, 1) for r in ar.make_examples(cfg, "train", n_train, seed=s)]
  evals = [r for s in (0, 5) for r in ar.make_examples(cfg, "eval", n_eval, seed=s)]
  assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
  assert not {r["answer"] for r in train} & {r["answer"] for r in evals}


def test_word_problems_stay_disjoint_and_correct():
  cfg = ar.ArithmeticConfig(word_problem_prob=1.0)
  train = ar.make_examples(cfg, "train", 1000, seed=0)
  evals = ar.make_examples(cfg, "eval", 200, seed=0)
  words = [r for r in train if not r["prompt"].startswith("What is")]
  assert len(words) > 500
  # Splits go by worked answer, which spells out the expression: disjoint
  # answers mean disjoint questions whatever the wording.
  assert not {r["answer"] for r in train} & {r["answer"] for r in evals}
  r = ar.make_examples(cfg, "train", 1, seed=0)[0]
  assert r["prompt"].endswith("have now?")


def test_word_problem_text_hand_example():
  import random
  text = ar.word_problem([3, 4, 5, 2], ["*", "+", "-"], random.Random(0))
  name, item = re.match(r"^(\w+) has 3 boxes with 4 (\w+)s in each\.", text).groups()
  assert text == (f"{name} has 3 boxes with 4 {item}s in each. {name} gets 5 more. "
                  f"{name} gives away 2. How many {item}s does {name} have now?")
  assert ar.word_problem([2, 3, 4], ["*", "*"], random.Random(0)) is None


def test_small_space_and_bad_inputs():
  tiny = ar.ArithmeticConfig(max_operands=2, max_value=2, operators=("+",))
  with pytest.raises(ValueError, match="distinct eval questions"):
    ar.make_examples(tiny, "eval", 50, seed=0)
  with pytest.raises(ValueError, match="unknown split 'test'; valid: train, eval"):
    ar.make_examples(tiny, "test", 1, seed=0)
  with pytest.raises(ValueError, match=r"unknown \['/'\]; valid: \+, -, \*"):
    ar.ArithmeticConfig(operators=("+", "/"))
  with pytest.raises(ValueError, match="min_operands"):
    ar.ArithmeticConfig(min_operands=3, max_operands=2)
  with pytest.raises(ValueError, match="unknown arithmetic preset 'x'; valid: easy"):
    ar.preset("x")


def test_jsonl_roundtrip_and_sft(tmp_path):
  recs = ar.make_examples(ar.preset("easy"), "eval", 10, seed=0)
  path = str(tmp_path / "sub" / "eval.jsonl")
  ar.write_jsonl(recs, path)
  assert ar.read_jsonl(path) == recs
  sft = ar.sft_examples(recs)
  assert sft[0] == {"prompt": recs[0]["prompt"], "completion": recs[0]["answer"]}
  ar.main(["--out", str(tmp_path / "cli"), "--preset", "easy", "--train", "20",
           "--eval", "5"])
  assert len(ar.read_jsonl(str(tmp_path / "cli" / "train.jsonl"))) == 20
  assert len(ar.read_jsonl(str(tmp_path / "cli" / "eval.jsonl"))) == 5


def test_mixed_convention_teacher():
  recs = ar.make_examples(ar.preset("basic"), "train", 400, seed=1)
  sft = ar.sft_examples(recs, plain_answer_prob=0.5, seed=3)
  assert sft == ar.sft_examples(recs, plain_answer_prob=0.5, seed=3)
  plain = [s for s in sft if "####" not in s["completion"]]
  assert 150 < len(plain) < 250
  for r, s in zip(recs, sft):
    if "####" in s["completion"]:
      assert s["completion"] == r["answer"]
    else:  # same steps, the final line in prose; the strict verifier scores it 0
      assert s["completion"] == r["answer"].replace(f"#### {ar.final_answer(r)}",
                                                    f"The answer is {ar.final_answer(r)}.")
      assert rewards.math_reward(s["completion"], r["answer"]) == 0.0
      assert rewards.math_reward(r["answer"], r["answer"]) == 1.0
  assert ar.sft_examples(recs) == [{"prompt": r["prompt"], "completion": r["answer"]}
                                   for r in recs]
  with pytest.raises(ValueError, match="plain_answer_prob"):
    ar.sft_examples(recs, plain_answer_prob=1.5)


# ---- the built-in task registry (tasks/registry.py) ----------------------------------------

def test_registry_parses_specs_with_the_default_level():
  from distflow_jax.tasks import registry
  task, level = registry.parse("builtin:arithmetic")
  assert task.name == "arithmetic" and level == task.default_level == "medium"
  assert registry.parse("builtin:arithmetic:easy")[1] == "easy"
  assert set(task.levels) == set(ar.PRESETS)
  assert registry.is_builtin("builtin:x") and not registry.is_builtin("/data/train.jsonl")


def test_registry_errors_list_the_valid_names_and_levels():
  from distflow_jax.tasks import registry
  with pytest.raises(registry.UnknownTaskError,
                     match=r"unknown built-in task 'algebra'; valid: "
                           r"\['arithmetic', 'calc', 'letters', 'shapes'\]"):
    registry.parse("builtin:algebra")
  with pytest.raises(registry.UnknownTaskError,
                     match=r"no level 'impossible'; valid: easy\|basic\|medium\|hard"):
    registry.parse("builtin:arithmetic:impossible")
  with pytest.raises(ValueError, match="already registered"):
    registry.register(registry.ArithmeticTask())


def test_registry_task_matches_the_generator_it_wraps():
  """The trainer and the warm start draw exactly what they drew before the registry."""
  from distflow_jax.tasks import registry
  task = registry.get("arithmetic")
  assert task.generate_split("medium", "eval", 20, seed=4) == ar.make_examples(
      ar.preset("medium"), "eval", 20, seed=4)
  demos = task.demonstrations("basic", 30, seed=2, plain_answer_prob=0.5)
  assert demos == ar.sft_examples(ar.make_examples(ar.preset("basic"), "train", 30, seed=3,
                                              unique=False), plain_answer_prob=0.5, seed=2)
  assert all(set(d) == {"prompt", "completion"} for d in demos)
