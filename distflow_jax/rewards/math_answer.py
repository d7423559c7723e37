"""Rule verifiers for math answers: extraction, number normalisation, matching.

Host-side pure Python on strings.  A completion's final answer is the text
after its last ``#### `` marker (GSM8K style) or inside its last
``\\boxed{...}``, whichever comes later in the text; optionally the last number
in the text when neither marker is present.  Numbers are parsed to exact
``Fraction``s ("1,000", "3.50", "-2", "1/2", "\\frac{1}{2}", "$5", "50%" are
all understood), so "3.50" equals "7/2" exactly.

How answers are compared (``reward.match``, see ``MATCH_MODES``): ``numeric``
(the default: equal values, so ``#### 09`` is right for ``009``), ``exact``
(the extracted strings are equal, surrounding whitespace aside: ``09`` is not
``009``), or ``math_verify`` (the ``math-verify`` package's symbolic check, for
LaTeX and expressions: ``\\frac{1}{\\sqrt{2}}`` equals ``\\sqrt{2}/2``; an optional
extra, ``pip install 'distflow-jax[math]'``).
"""

from __future__ import annotations

import importlib.util
import math
import re
import threading
from collections.abc import Callable
from fractions import Fraction

_HASH_RE = re.compile(r"####[ \t]*([^\n]*)")
_BOXED = "\\boxed"
_FRAC_RE = re.compile(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_DECIMAL = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_NUMBER_RE = re.compile(rf"^[+-]?(?:{_DECIMAL})$")
_SLASH_RE = re.compile(rf"^([+-]?(?:{_DECIMAL}))\s*/\s*([+-]?(?:{_DECIMAL}))$")
# A number somewhere in free text, for the last-number fallback and for
# answers such as "42 apples".
_NUMBER_IN_TEXT_RE = re.compile(
    rf"[+-]?(?:{_DECIMAL})(?:\s*/\s*(?:{_DECIMAL}))?")


def _last_boxed(text: str) -> tuple[int, str] | None:
  """(position, content) of the last ``\\boxed{...}``, braces balanced."""
  start = text.rfind(_BOXED + "{")
  if start < 0:
    return None
  depth, i = 0, start + len(_BOXED)
  for j in range(i, len(text)):
    if text[j] == "{":
      depth += 1
    elif text[j] == "}":
      depth -= 1
      if depth == 0:
        return start, text[i + 1:j]
  return None  # unbalanced: treat as no answer rather than guess


def extract_answer(text: str, *, last_number_fallback: bool = False) -> str | None:
  """The final-answer string of a completion, or None if it gives none."""
  candidates = []
  hashes = list(_HASH_RE.finditer(text))
  if hashes:
    candidates.append((hashes[-1].start(), hashes[-1].group(1).strip()))
  boxed = _last_boxed(text)
  if boxed is not None:
    candidates.append((boxed[0], boxed[1].strip()))
  if candidates:
    return max(candidates)[1]
  if last_number_fallback:
    numbers = _NUMBER_IN_TEXT_RE.findall(text)
    if numbers:
      return numbers[-1].strip()
  return None


def _clean(s: str) -> str:
  s = s.strip().replace("\u2212", "-").replace("\\!", "").replace("\\,", "")
  s = s.replace("\\$", "").replace("$", "").replace("\\%", "%")
  s = re.sub(r"\\(?:text|mathrm)\{[^{}]*\}", "", s).strip()
  s = s.rstrip(".").strip()
  return s


def parse_number(s: str) -> Fraction | None:
  """Exact value of a number written as an integer, decimal, fraction or %.

  Returns None for anything else (an expression, a word, an empty string).
  """
  s = _clean(s)
  scale = Fraction(1)
  if s.endswith("%"):
    s, scale = s[:-1].strip(), Fraction(1, 100)
  sign = 1
  m = _FRAC_RE.match(s.lstrip("+-"))
  if m:
    sign = -1 if s.startswith("-") else 1
    num, den = parse_number(m.group(1)), parse_number(m.group(2))
    if num is None or den is None or den == 0:
      return None
    return sign * num / den * scale
  if _NUMBER_RE.match(s):
    return Fraction(s.replace(",", "")) * scale
  m = _SLASH_RE.match(s)
  if m:
    num, den = Fraction(m.group(1).replace(",", "")), Fraction(m.group(2).replace(",", ""))
    return None if den == 0 else num / den * scale
  return None


def answer_value(answer: str) -> Fraction | None:
  """The number an extracted answer states: the whole string, else its first
  number ("42 apples" -> 42)."""
  value = parse_number(answer)
  if value is not None:
    return value
  m = _NUMBER_IN_TEXT_RE.search(_clean(answer))
  return parse_number(m.group(0)) if m else None


def normalize_string(s: str) -> str:
  return " ".join(_clean(s).split()).lower()


def answers_match(predicted: str, truth: str, *, numeric: bool = True,
                  rel_tol: float = 0.0, abs_tol: float = 1e-6) -> bool:
  """Whether two extracted answers agree.

  ``numeric``: both parse to numbers and |p - t| <= max(rel_tol * |t|, abs_tol)
  (with both tolerances 0 the comparison is exact on fractions); otherwise, or
  when either side is not a number, the whitespace- and case-normalised strings
  must be equal.
  """
  if numeric:
    p, t = answer_value(predicted), answer_value(truth)
    if p is not None and t is not None:
      if rel_tol == 0.0 and abs_tol == 0.0:
        return p == t
      return math.isclose(float(p), float(t), rel_tol=rel_tol, abs_tol=abs_tol)
  return normalize_string(predicted) == normalize_string(truth) != ""


def ground_truth_answer(ground_truth: str) -> str:
  """The answer in a ground-truth field: after ``####``/in ``\\boxed{}`` if it
  has one (a GSM8K-style worked answer), else the whole string."""
  found = extract_answer(ground_truth)
  return (found if found is not None else ground_truth).strip()


def math_reward(completion: str, ground_truth: str, *,
                last_number_fallback: bool = False, numeric: bool = True,
                rel_tol: float = 0.0, abs_tol: float = 1e-6) -> float:
  """1.0 if the completion's final answer matches the ground truth, else 0.0.

  A completion without an answer (including an empty one) scores 0.0.
  """
  predicted = extract_answer(completion, last_number_fallback=last_number_fallback)
  if predicted is None:
    return 0.0
  ok = answers_match(predicted, ground_truth_answer(ground_truth), numeric=numeric,
                     rel_tol=rel_tol, abs_tol=abs_tol)
  return 1.0 if ok else 0.0


MATCH_MODES = ("numeric", "exact", "math_verify")
MATH_VERIFY_MISSING = ("reward.match='math_verify' needs the math-verify package, which is not "
                       "installed: pip install 'distflow-jax[math]' (or pip install math-verify), "
                       "or set --config.reward.match=numeric")


def has_math_verify() -> bool:
  return importlib.util.find_spec("math_verify") is not None


def exact_reward(completion: str, ground_truth: str) -> float:
  """1.0 if the completion's final answer is the ground truth's answer string exactly
  (surrounding whitespace aside): no number parsing, so ``09`` is wrong for ``009``."""
  predicted = extract_answer(completion)
  truth = ground_truth_answer(ground_truth)
  return 1.0 if predicted is not None and predicted.strip() == truth != "" else 0.0


def math_verify_reward(completion: str, ground_truth: str) -> float:
  """1.0 if ``math_verify.verify`` finds the answers equal (LaTeX, fractions, radicals,
  expressions).  The completion's ``####`` / ``\\boxed{}`` answer is what is compared when it
  has one; otherwise math-verify looks for an answer in the whole text."""
  try:
    import math_verify  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ImportError(MATH_VERIFY_MISSING) from None
  # math-verify's timeouts use signal.alarm, which only works on the main thread.
  timeout = 5 if threading.current_thread() is threading.main_thread() else None
  predicted = extract_answer(completion)
  pred_text = completion if predicted is None else f"\\boxed{{{predicted}}}"
  gold = math_verify.parse(f"\\boxed{{{ground_truth_answer(ground_truth)}}}",
                           parsing_timeout=timeout)
  pred = math_verify.parse(pred_text, parsing_timeout=timeout)
  if not gold or not pred:
    return 0.0
  return 1.0 if math_verify.verify(gold, pred, timeout_seconds=timeout) else 0.0


def math_reward_for(match: str = "numeric") -> Callable[[str, str], float]:
  """The ``math`` verifier in one of ``MATCH_MODES`` (``reward.match``); ValueError names a
  bad mode, ImportError says how to install math-verify."""
  if match == "numeric":
    return math_reward
  if match == "exact":
    return exact_reward
  if match == "math_verify":
    if not has_math_verify():
      raise ImportError(MATH_VERIFY_MISSING)
    return math_verify_reward
  raise ValueError(f"reward.match={match!r} is not valid; valid: {list(MATCH_MODES)}")


_FINAL_LINE_RE = re.compile(rf"^####[ \t]*[+-]?(?:{_DECIMAL})$")


def format_reward(completion: str, ground_truth: str = "") -> float:
  """1.0 if the completion's last non-empty line is ``#### <number>``.

  ``ground_truth`` is ignored; it is accepted so every reward function has
  the same signature.
  """
  del ground_truth
  lines = [ln.strip() for ln in completion.strip().splitlines() if ln.strip()]
  return 1.0 if lines and _FINAL_LINE_RE.match(lines[-1]) else 0.0
