"""The built-in ``calc`` environment: a calculator tool for multi-turn episodes.

``rollout.env=calc`` with the ``tag`` parser: a turn that ends in
``<tool>calc(EXPR)</tool>`` gets the observation `` = VALUE`` + newline (``observation``), or
`` error: WHY`` + newline for an expression it cannot read; a turn with no tool call is the
model's final answer, scored by the ``math`` verifier against the row's ``answer`` (1 or
0, the episode's reward) and the episode ends.  The built-in task ``builtin:calc``
(tasks/calc.py) is made for it.

``EXPR`` is read by a small recursive-descent parser, never Python's ``eval``: integers,
``+``, ``-``, ``*``, unary minus, parentheses and spaces between them, nothing else (no ``**``, no
``/``, no names).  Limits keep a hostile expression cheap: at most ``MAX_EXPR_CHARS``
characters, ``MAX_DIGITS`` digits a number, ``MAX_DEPTH`` nested brackets, and every
intermediate value within ``MAX_ABS``; anything else is a ``CalcError`` whose message
the environment returns as the observation.

    evaluate("347*28")   # 9716
    evaluate("9**9**9")  # CalcError: '*' at 2: expected a number or '('
"""

from __future__ import annotations

from typing import Any, Mapping

from distflow_jax.envs import parsers
from distflow_jax.rewards import math_answer

TOOL = "calc"
MAX_EXPR_CHARS = 64
MAX_DIGITS = 12
MAX_DEPTH = 16
MAX_ABS = 10 ** 18


class CalcError(ValueError):
  """An expression outside the calculator's grammar or limits (the message says where)."""


class _Parser:
  """expr := term (('+' | '-') term)*;  term := factor ('*' factor)*;
  factor := '-' factor | number | '(' expr ')'."""

  def __init__(self, text: str):
    self.s = text
    self.i = 0
    self.depth = 0

  def _peek(self) -> str:
    """The next character after any spaces (spaces separate tokens, never split a number)."""
    while self.i < len(self.s) and self.s[self.i] == " ":
      self.i += 1
    return self.s[self.i] if self.i < len(self.s) else ""

  def _fail(self, what: str) -> CalcError:
    got = repr(self._peek()) if self._peek() else "the end"
    return CalcError(f"{got} at {self.i}: expected {what}")

  def _checked(self, value: int) -> int:
    if abs(value) > MAX_ABS:
      raise CalcError(f"a value exceeds {MAX_ABS:.0e} in magnitude")
    return value

  def expr(self) -> int:
    value = self.term()
    while self._peek() in ("+", "-"):
      op = self._peek()
      self.i += 1
      rhs = self.term()
      value = self._checked(value + rhs if op == "+" else value - rhs)
    return value

  def term(self) -> int:
    value = self.factor()
    while self._peek() == "*":
      self.i += 1
      value = self._checked(value * self.factor())
    return value

  def factor(self) -> int:
    c = self._peek()
    if c == "-":
      self.i += 1
      return -self._nested(self.factor)
    if c == "(":
      self.i += 1
      value = self._nested(self.expr)
      if self._peek() != ")":
        raise self._fail("')'")
      self.i += 1
      return value
    start = self.i
    while self.i < len(self.s) and self.s[self.i] in "0123456789":
      self.i += 1
    digits = self.s[start:self.i]
    if not digits:
      raise self._fail("a number or '('")
    if len(digits) > MAX_DIGITS:
      raise CalcError(f"a number of {len(digits)} digits at {start} (at most {MAX_DIGITS})")
    return int(digits)

  def _nested(self, fn) -> int:
    self.depth += 1
    if self.depth > MAX_DEPTH:
      raise CalcError(f"more than {MAX_DEPTH} nested brackets or signs")
    try:
      return fn()
    finally:
      self.depth -= 1


def evaluate(expr: str) -> int:
  """The integer value of ``expr`` (module doc's grammar); ``CalcError`` otherwise."""
  if not isinstance(expr, str):
    raise CalcError(f"expected text, got {type(expr).__name__}")
  if len(expr) > MAX_EXPR_CHARS:
    raise CalcError(f"expression of {len(expr)} characters (at most {MAX_EXPR_CHARS})")
  p = _Parser(expr)
  if not expr.strip(" "):
    raise CalcError("empty expression")
  value = p.expr()
  if p._peek():  # pylint: disable=protected-access
    raise p._fail("an operator (+ - *) or the end")  # pylint: disable=protected-access
  return value


def call_text(expr: str) -> str:
  """The tool call a model writes (``tag`` parser)."""
  return f"<tool>{TOOL}({expr})</tool>"


def observation(value: int) -> str:
  """What the environment answers a good call with."""
  return f" = {value}\n"


def error_observation(why: str) -> str:
  return f" error: {why}\n"


class CalcEnv:
  """``rollout.env=calc`` (module doc).  Rows need an ``answer`` (``#### N`` or a number)."""

  parser = parsers.tool_parser(parsers.ToolParser.TAG.value)

  def reset(self, row: Mapping[str, Any]) -> str:
    self.answer = str(row.get("answer", ""))
    return ""

  def step(self, action_text: str) -> tuple[str, float, bool]:
    call = self.parser.parse(action_text)
    if call is None:  # no tool call: the final answer
      return "", float(math_answer.math_reward(action_text, self.answer) > 0), True
    if call.error:
      return error_observation(call.error), 0.0, False
    if call.name != TOOL:
      return error_observation(f"unknown tool {call.name[:20]!r}; the tool is {TOOL}(EXPR)"), \
          0.0, False
    try:
      return observation(evaluate(call.arguments)), 0.0, False
    except CalcError as e:
      return error_observation(str(e)), 0.0, False
