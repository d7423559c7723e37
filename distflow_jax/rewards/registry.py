"""Reward functions by name, and a batch runner that never hides a failure.

A reward function is ``fn(completion: str, ground_truth: str) -> float``.
Built-ins: ``math`` (#### / \\boxed{} answer, exact numeric match), ``math_lenient``
(also the last number in the text), ``math_string`` (normalised string match),
``math_exact`` (exact string match), ``math_verify`` (symbolic, needs the
math-verify package), ``format`` (ends with a ``#### <number>`` line).
``configured_reward(name, section)`` is what a reward node or ``eval`` scores
with: ``math`` follows the section's ``reward.match``.  ``register_reward`` adds
more; ``weighted_reward`` builds a weighted sum of registered ones.

A reward registered with ``node_doc`` is also the DAG function ``reward.<name>``: its spec
(dag/registry.rule_reward_spec) and its node (nodes/rewards) are derived from its entry
here, so a built-in rule reward is one ``register_reward`` line (a plugin's:
``nodes.rewards.register_rule_reward``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from distflow_jax.rewards import math_answer

RewardFn = Callable[[str, str], float]

_REGISTRY: dict[str, RewardFn] = {}


@dataclasses.dataclass(frozen=True)
class RuleNode:
  """A rule reward that is the DAG function ``reward.<name>``: ``doc`` its one line in the
  function list; ``verifier`` when its score is correctness (the node logs it as the
  step's ``accuracy`` too)."""
  name: str
  doc: str
  verifier: bool = False


_NODES: dict[str, RuleNode] = {}


class RewardFunctionError(RuntimeError):
  """A reward function raised or returned a non-finite / non-numeric score."""


def register_reward(name: str, fn: RewardFn, *, overwrite: bool = False,
                    node_doc: str | None = None, verifier: bool = False) -> RewardFn:
  """Registers ``fn`` as reward ``name``; with ``node_doc`` also as the rule-reward node
  ``reward.<name>`` (module docstring)."""
  if not name or not isinstance(name, str):
    raise ValueError(f"reward name must be a non-empty string, got {name!r}")
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"reward {name!r} is already registered; pass overwrite=True "
                     "to replace it")
  if not callable(fn):
    raise TypeError(f"reward {name!r} must be callable, got {type(fn).__name__}")
  _REGISTRY[name] = fn
  if node_doc is not None:
    _NODES[name] = RuleNode(name, node_doc, verifier)
  else:
    _NODES.pop(name, None)
  return fn


def rule_node(name: str) -> RuleNode | None:
  """The node entry of reward ``name`` (None: a scoring function only)."""
  return _NODES.get(name)


def reward_names() -> list[str]:
  return sorted(_REGISTRY)


def get_reward(name: str) -> RewardFn:
  try:
    return _REGISTRY[name]
  except KeyError:
    raise ValueError(f"unknown reward function {name!r}; valid: "
                     f"{', '.join(reward_names())}") from None


def configured_reward(name: str, section: Any = None) -> RewardFn:
  """The reward ``name`` as a config section sets it up: ``math`` compares answers as
  ``section.match`` says (numeric | exact | math_verify); other names are the registry's.
  ValueError / ImportError (math-verify missing) name the setting."""
  match = getattr(section, "match", "numeric") if section is not None else "numeric"
  if name == "math" and match != "numeric":
    return math_answer.math_reward_for(match)
  return get_reward(name)


def weighted_reward(weights: Mapping[str, float]) -> RewardFn:
  """sum_k w_k * reward_k(completion, ground_truth) over registered names."""
  if not weights:
    raise ValueError("weighted_reward needs at least one {name: weight}")
  fns = {name: get_reward(name) for name in weights}

  def combined(completion: str, ground_truth: str) -> float:
    return float(sum(w * fns[k](completion, ground_truth) for k, w in weights.items()))

  combined.__name__ = "weighted(" + ",".join(f"{k}={w}" for k, w in weights.items()) + ")"
  return combined


def _fn_name(fn: Callable) -> str:
  for name, registered in _REGISTRY.items():
    if registered is fn:
      return name
  return getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))


# What a reward function may return: a real number (bool counts as 0 / 1).  Text ("1.0"),
# None, complex numbers and arrays are refused: float("1.0") would hide a function that
# returns the wrong thing.
_REAL = (bool, int, float, np.bool_, np.integer, np.floating)


def _checked_score(value: Any, name: str, sample_id: Any) -> np.float32:
  """``value`` as the float32 the batch stores; RewardFunctionError naming the function,
  the sample and the value when it is not a real number or not finite AFTER the cast
  (1e300 is finite as a Python float and inf as a float32)."""
  if not isinstance(value, _REAL) and not (
      isinstance(value, np.ndarray) and value.shape == () and
      np.issubdtype(value.dtype, np.number) and not np.iscomplexobj(value)):
    raise RewardFunctionError(
        f"reward function {name!r} returned {value!r} ({type(value).__name__}) for sample "
        f"id {sample_id!r}; it must return a real number (int / float), not "
        f"{type(value).__name__}")
  try:
    with np.errstate(over="ignore", invalid="ignore"):
      cast = np.float32(value)
  except OverflowError:  # an int too large even for a float64
    cast = np.float32(np.inf)
  if not np.isfinite(cast):
    raise RewardFunctionError(
        f"reward function {name!r} returned {value!r} for sample id {sample_id!r}; scores "
        f"must be finite float32 numbers (|score| < {float(np.finfo(np.float32).max):.3g})")
  return cast


def score_batch(reward: "str | RewardFn", completions: Sequence[str],
                ground_truths: Sequence[str],
                sample_ids: Sequence[Any] | None = None) -> np.ndarray:
  """Scores a batch of completions: float32 [B].

  A user function that raises, or returns something that is not a finite
  number (text, None, ...) or is not finite as a float32, stops the batch with
  ``RewardFunctionError`` naming the function, the sample id and the value (the
  cause is chained), never a silent zero.
  """
  fn = get_reward(reward) if isinstance(reward, str) else reward
  name = _fn_name(fn)
  n = len(completions)
  if len(ground_truths) != n or (sample_ids is not None and len(sample_ids) != n):
    raise ValueError(
        f"reward {name!r}: {n} completions, {len(ground_truths)} ground truths"
        + ("" if sample_ids is None else f", {len(sample_ids)} sample ids")
        + "; they must match")
  ids = list(range(n)) if sample_ids is None else list(sample_ids)
  scores = np.empty(n, np.float32)
  for i, (completion, truth) in enumerate(zip(completions, ground_truths)):
    try:
      value = fn(completion, truth)
    except Exception as e:
      raise RewardFunctionError(
          f"reward function {name!r} raised on sample id {ids[i]!r}: "
          f"{type(e).__name__}: {e}") from e
    scores[i] = _checked_score(value, name, ids[i])
  return scores


register_reward("math", math_answer.math_reward, verifier=True,
                node_doc="rule verifier: final answer (#### / \\boxed{}) against the ground truth")
register_reward("math_lenient", functools.partial(math_answer.math_reward,
                                                  last_number_fallback=True), verifier=True,
                node_doc="reward.math, and an answer without #### / \\boxed{} is its last number")
register_reward("math_string", functools.partial(math_answer.math_reward,
                                                 numeric=False))
register_reward("math_exact", math_answer.exact_reward)
register_reward("math_verify", math_answer.math_verify_reward)
register_reward("format", math_answer.format_reward, node_doc="rule reward for answer format")

BUILTIN_RULE_NODES = tuple(_NODES.values())  # the package's own (a plugin's come later)
BUILTIN_REWARDS = frozenset(_REGISTRY)
