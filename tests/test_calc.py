"""The built-in calculator tool (envs/calc.py) and its task ``builtin:calc`` (tasks/calc.py):
the safe grammar (never Python's eval), the environment's observations and reward, the
task's rows and demonstrations."""

import random

import pytest

from distflow_jax.envs import base, calc as calc_env
from distflow_jax.envs.calc import CalcError, evaluate
from distflow_jax.tasks import calc as calc_task, registry

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("expr,value", [
    ("347*28", 9716), ("347 * 28", 9716), ("2+3*4", 14), ("(2+3)*4", 20), ("10-3-2", 5),
    ("-(2-5)*3", 9), ("  7 ", 7), ("((1))", 1), ("0*999999999999", 0), ("-4*-4", 16),
])
def test_grammar_values(expr, value):
  assert evaluate(expr) == value


def _random_expr(rng, depth=0):
  if depth > 2 or rng.random() < 0.3:  # at most 8 numbers
    return str(rng.randint(0, 99))  # so no value passes 99 ** 8 < MAX_ABS
  op = rng.choice("+-*")
  left, right = _random_expr(rng, depth + 1), _random_expr(rng, depth + 1)
  return f"({left}){op}{right}" if rng.random() < 0.5 else f"{left} {op} {right}"


def test_grammar_agrees_with_integer_arithmetic_on_random_expressions():
  rng = random.Random(0)
  for _ in range(500):
    expr = _random_expr(rng)
    if len(expr) > calc_env.MAX_EXPR_CHARS:
      continue
    # The oracle: Python's own integer arithmetic on digits, + - * and brackets only.
    assert evaluate(expr) == eval(expr, {"__builtins__": {}}), expr  # pylint: disable=eval-used


@pytest.mark.parametrize("expr,needle", [
    ("", "empty"), ("   ", "empty"), ("1+", "expected a number"), ("(1", "expected ')'"),
    ("1)", "expected an operator"), ("2 3", "expected an operator"),
    ("9**9**9", "expected a number"), ("2**64", "expected a number"), ("6/3", "'/'"),
    ("__import__('os')", "'_'"), ("1e9", "'e'"), ("3.5*2", "'.'"), ("0x10", "'x'"),
    ("١٢", "'١'"), ("9" * 13, "13 digits"), ("(" * 17 + "1" + ")" * 17, "nested"),
    ("-" * 17 + "1", "nested"), ("999999999999*999999999999", "exceeds"),
    ("1+" * 40 + "1", "characters"),
])
def test_grammar_refuses_what_it_does_not_know(expr, needle):
  with pytest.raises(CalcError, match=None) as e:
    evaluate(expr)
  assert needle in str(e.value), (expr, str(e.value))


def test_non_text_is_refused():
  with pytest.raises(CalcError):
    evaluate(123)  # type: ignore[arg-type]


def _env(answer="#### 9716"):
  env = base.env_factory("calc")()
  assert env.reset({"prompt": "What is 347 * 28?", "answer": answer}) == ""
  return env


def test_calc_is_a_built_in_environment():
  assert base.env_factory("calc") is calc_env.CalcEnv
  assert "calc" in base.env_names()


def test_a_call_gets_the_value_and_the_episode_goes_on():
  assert _env().step("<tool>calc(347 * 28)</tool>") == (" = 9716\n", 0.0, False)


@pytest.mark.parametrize("action,needle", [
    ("<tool>calc(9**9**9)</tool>", "expected a number"),
    ("<tool>calc(1+)</tool>", "expected a number"),
    ("<tool>calc()</tool>", "empty"),
    ("<tool>calc(" + "9" * 200 + ")</tool>", "characters"),
    ("<tool>rm(-rf)</tool>", "unknown tool 'rm'"),
    ("<tool>calc 1+1</tool>", "expected name(args)"),
])
def test_a_bad_call_is_an_error_observation_not_an_exception(action, needle):
  obs, reward, done = _env().step(action)
  assert obs.startswith(" error: ") and needle in obs and obs.endswith("\n"), obs
  assert (reward, done) == (0.0, False)


@pytest.mark.parametrize("final,reward", [
    ("#### 9716", 1.0), ("#### 9715", 0.0), ("9716", 0.0), ("", 0.0),
    ("#### 9716.0", 1.0), ("The answer is 9716.", 0.0),
])
def test_the_final_answer_is_the_reward(final, reward):
  env = _env()
  env.step("<tool>calc(347*28)</tool>")
  assert env.step(final) == ("", reward, True)


def test_task_rows_are_deterministic_disjoint_and_right():
  task, level = registry.parse("builtin:calc")
  assert (task.name, level) == ("calc", "basic")
  a = task.generate_split(level, "train", 300, seed=3)
  assert a == task.generate_split(level, "train", 300, seed=3)
  assert a != task.generate_split(level, "train", 300, seed=4)
  held = task.generate_split(level, "eval", 300, seed=3)
  assert not {r["prompt"] for r in a} & {r["prompt"] for r in held}
  assert len({r["prompt"] for r in a}) == 300  # unique
  for r in a + held:
    x, y = calc_task.operands(r)
    assert 100 <= x <= 999 and 10 <= y <= 99
    assert r["answer"] == f"#### {x * y}" and r["data_source"] == "calc"
  x, y = calc_task.operands(registry.parse("builtin:calc:hard")[0].generate_split(
      "hard", "eval", 1, seed=0)[0])
  assert 100 <= y <= 999


def test_demonstrations_show_the_tool_as_the_environment_answers():
  cfg = calc_task.preset("basic")
  demos = calc_task.demonstrations(cfg, 2000, seed=0)
  assert demos == calc_task.demonstrations(cfg, 2000, seed=0)
  tool = [d for d in demos if d["completion"].startswith("<tool>")]
  assert abs(len(tool) / len(demos) - cfg.tool_prob) < 0.05
  for d in demos:
    x, y = calc_task.operands(d)
    if not d["completion"].startswith("<tool>"):
      assert d["completion"] == f"#### {x * y}"
      continue
    # The call as the model would write it, then exactly what the environment answers it.
    env = _env(f"#### {x * y}")
    call_end = calc_env.CalcEnv.parser.call_end(d["completion"])
    obs, _, done = env.step(d["completion"][:call_end])
    assert d["completion"] == d["completion"][:call_end] + obs + f"#### {x * y}"
    assert not done and env.step(f"#### {x * y}")[1] == 1.0


def test_task_knobs_are_checked():
  with pytest.raises(ValueError, match="tool_prob"):
    calc_task.CalcConfig(tool_prob=1.5)
  with pytest.raises(ValueError, match="a_digits"):
    calc_task.CalcConfig(a_digits=0)
  with pytest.raises(registry.UnknownTaskError, match="easy"):
    registry.parse("builtin:calc:nope")


def test_the_readmes_example_environment_runs(tmp_path, monkeypatch):
  """docs/multi_turn.md: its ~30-line plugin, as written there, registers and plays."""
  import pathlib
  import sys
  text = (pathlib.Path(__file__).parent.parent / "docs" / "multi_turn.md").read_text()
  section = text.split("# Multi-turn episodes", 1)[1]
  code = section.split("```python\n", 1)[1].split("```", 1)[0]
  (tmp_path / "my_envs.py").write_text(code)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.delitem(sys.modules, "my_envs", raising=False)
  try:
    __import__("my_envs")
    env = base.env_factory("adder")()
    env.reset({"prompt": "What is 2 + 3?", "answer": "5"})
    assert env.step("<tool>add(2, 3)</tool>") == (" = 5\n", 0.0, False)
    assert env.step("it is 5\n#### 5") == ("", 1.0, True)
    assert env.step("#### 56") == ("", 0.0, True)  # exact: 5 is not in 56's place
    assert env.step("it is 5") == ("", 0.0, True)  # no final answer line
  finally:
    base._REGISTRY.pop("adder", None)  # pylint: disable=protected-access
