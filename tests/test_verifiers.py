"""reward.math's comparison modes (reward.match): numeric, exact strings, math-verify."""

import pytest

from distflow_jax.config import loading
from distflow_jax.rewards import math_answer, registry

SECTION = type("Section", (), {})


def section(match):
  s = SECTION()
  s.match = match
  return s


def test_numeric_is_the_default_and_accepts_leading_zeros():
  fn = registry.configured_reward("math", None)
  assert fn("so #### 09", "#### 009") == 1.0
  assert registry.configured_reward("math", section("numeric"))("#### 9", "009") == 1.0


def test_exact_mode_compares_the_strings():
  fn = registry.configured_reward("math", section("exact"))
  assert fn("so #### 09", "#### 009") == 0.0
  assert fn("so #### 009", "#### 009") == 1.0
  assert fn("\\boxed{ 3/4 }", "3/4") == 1.0
  assert fn("#### 0.75", "3/4") == 0.0
  assert fn("no answer", "3/4") == 0.0
  assert registry.get_reward("math_exact") is fn
  # Other rewards ignore reward.match.
  assert registry.configured_reward("format", section("exact")) is registry.get_reward("format")


def test_bad_mode_is_one_line_naming_the_key():
  from distflow_jax.config import validators
  with pytest.raises(loading.ConfigError, match=r"^reward\.match='fuzzy' is not valid; choose "
                     r"one of \['numeric', 'exact', 'math_verify'\]$"):
    validators.option("fuzzy", "reward.match", "match")
  with pytest.raises(ValueError, match="reward.match='fuzzy'"):
    math_answer.math_reward_for("fuzzy")


def test_math_verify_missing_is_refused_in_one_line(monkeypatch):
  from distflow_jax.config import defaults, values
  monkeypatch.setattr(math_answer, "has_math_verify", lambda: False)
  cfg = defaults.base()
  cfg.reward.match = "math_verify"
  with pytest.raises(loading.ConfigError) as e:
    values.check_values(cfg)
  msg = str(e.value)
  assert "\n" not in msg and "pip install 'distflow-jax[math]'" in msg
  assert msg.startswith("reward.match='math_verify' needs the math-verify package")
  with pytest.raises(ImportError, match="math-verify"):
    math_answer.math_reward_for("math_verify")


def test_math_verify_mode_checks_latex_and_symbols():
  pytest.importorskip("math_verify", reason="math-verify is not installed (pip install "
                      "'distflow-jax[math]'); reward.match='math_verify' is untested here")
  fn = registry.configured_reward("math", section("math_verify"))
  assert fn("so \\boxed{\\frac{1}{\\sqrt{2}}}", "\\sqrt{2}/2") == 1.0
  assert fn("The answer is \\boxed{0.5}", "\\frac{1}{2}") == 1.0
  assert fn("#### (x+1)^2", "x^2+2x+1") == 1.0
  assert fn("#### 72", "#### 72") == 1.0
  assert fn("\\boxed{4}", "3") == 0.0
  assert fn("", "3") == 0.0
  assert fn("I think it is \\(\\frac{3}{4}\\)", "0.75") == 1.0  # no marker: math-verify looks
