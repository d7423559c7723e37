"""Rule rewards: answer extraction, number parsing, matching, registry, batch runner."""

from fractions import Fraction

import numpy as np
import pytest

from distflow_jax import rewards
from distflow_jax.rewards import math_answer as ma


@pytest.mark.parametrize("text, want", [
    ("so 7 * 3 = 21\n12 + 21 = 33\n#### 33", "33"),
    ("#### 1\nwait, no\n#### 2", "2"),
    ("The answer is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}} and nothing else", "\\frac{1}{2}"),
    ("#### 5 then \\boxed{6}", "6"),
    ("\\boxed{6} then #### 5", "5"),
    ("#### 42 apples", "42 apples"),
    ("no marker 3 then 4", None),
    ("", None),
    ("\\boxed{12", None),
])
def test_extract_answer(text, want):
  assert ma.extract_answer(text) == want


def test_last_number_fallback_is_switchable():
  text = "first 3, then 1,250 and finally -4.5 units"
  assert ma.extract_answer(text) is None
  assert ma.extract_answer(text, last_number_fallback=True) == "-4.5"
  # A marker wins over the fallback; its line's first number is the answer.
  assert ma.math_reward("#### 7 but later 9", "7", last_number_fallback=True) == 1.0


@pytest.mark.parametrize("s, want", [
    ("42", Fraction(42)), ("-2", Fraction(-2)), ("+3", Fraction(3)),
    ("1,000", Fraction(1000)), ("1,234,567.5", Fraction(2469135, 2)),
    ("3.50", Fraction(7, 2)), (".5", Fraction(1, 2)), ("1/2", Fraction(1, 2)),
    ("-3 / 4", Fraction(-3, 4)), ("\\frac{1}{2}", Fraction(1, 2)),
    ("-\\dfrac{3}{6}", Fraction(-1, 2)), ("$5.", Fraction(5)), ("\\$1,000", Fraction(1000)),
    ("50%", Fraction(1, 2)), ("\u22127", Fraction(-7)),
    ("1,00", None), ("abc", None), ("", None), ("1/0", None), ("2+3", None),
])
def test_parse_number(s, want):
  assert ma.parse_number(s) == want


def test_answers_match_numeric_and_string():
  assert ma.answers_match("3.50", "7/2")
  assert ma.answers_match("1,000", "1000")
  assert ma.answers_match("42 apples", "42")
  assert not ma.answers_match("41", "42")
  assert ma.answers_match("0.3333", "1/3", rel_tol=1e-3, abs_tol=0.0)
  assert not ma.answers_match("0.3333", "1/3", rel_tol=0.0, abs_tol=0.0)
  assert ma.answers_match("33.0000000001", "33")
  # String mode: exact after whitespace/case normalisation only.
  assert not ma.answers_match("3.50", "3.5", numeric=False)
  assert ma.answers_match("  Paris ", "paris", numeric=False)
  # Non-numbers fall back to string comparison even in numeric mode.
  assert ma.answers_match("x = y", "x  =  y")
  assert not ma.answers_match("", "")


def test_math_reward():
  truth = "7 * 3 = 21\n12 + 21 = 33\n#### 33"
  assert rewards.math_reward("12+21=33\n#### 33", truth) == 1.0
  assert rewards.math_reward("The answer is \\boxed{33}", truth) == 1.0
  assert rewards.math_reward("#### 34", truth) == 0.0
  assert rewards.math_reward("it is 33", truth) == 0.0
  assert rewards.math_reward("it is 33", truth, last_number_fallback=True) == 1.0
  assert rewards.math_reward("", truth) == 0.0
  assert rewards.math_reward("#### 1,000", "1000") == 1.0


def test_format_reward():
  assert rewards.format_reward("a\nb\n#### 12\n") == 1.0
  assert rewards.format_reward("#### -3") == 1.0
  assert rewards.format_reward("#### 12 apples") == 0.0
  assert rewards.format_reward("#### 12\nmore text") == 0.0
  assert rewards.format_reward("\\boxed{12}") == 0.0
  assert rewards.format_reward("") == 0.0


def test_registry():
  assert {"math", "math_lenient", "math_string", "format"} <= set(rewards.reward_names())
  assert rewards.get_reward("math")("#### 2", "#### 2") == 1.0
  assert rewards.get_reward("math_lenient")("so 2", "2") == 1.0
  assert rewards.get_reward("math_string")("#### 2.0", "2") == 0.0
  with pytest.raises(ValueError, match=r"unknown reward function 'maths'; valid: .*format.*math"):
    rewards.get_reward("maths")
  with pytest.raises(ValueError, match="already registered"):
    rewards.register_reward("math", lambda c, g: 0.0)
  combo = rewards.weighted_reward({"math": 1.0, "format": 0.1})
  assert combo("#### 5", "5") == pytest.approx(1.1)
  assert combo("it is \\boxed{5}", "5") == pytest.approx(1.0)
  assert combo("#### 4", "5") == pytest.approx(0.1)


def test_score_batch_and_errors():
  scores = rewards.score_batch("math", ["#### 1", "#### 3", ""], ["1", "2", "3"])
  np.testing.assert_array_equal(scores, np.array([1, 0, 0], np.float32))
  assert scores.dtype == np.float32

  def picky(completion, truth):
    if "boom" in completion:
      raise KeyError("no such key")
    return 1.0

  with pytest.raises(rewards.RewardFunctionError,
                     match=r"'test_score_batch_and_errors.<locals>.picky' raised on "
                           r"sample id 'p7-s1': KeyError") as info:
    rewards.score_batch(picky, ["ok", "boom"], ["", ""], sample_ids=["p7-s0", "p7-s1"])
  assert isinstance(info.value.__cause__, KeyError)
  with pytest.raises(rewards.RewardFunctionError, match=r"returned nan for sample id 1"):
    rewards.score_batch(lambda c, g: float("nan") if c == "b" else 0.0, ["a", "b"], ["", ""])
  with pytest.raises(rewards.RewardFunctionError, match=r"returned None .*sample id 0"):
    rewards.score_batch(lambda c, g: None, ["a"], [""])
  with pytest.raises(ValueError, match="2 completions, 1 ground truths"):
    rewards.score_batch("math", ["a", "b"], ["1"])
