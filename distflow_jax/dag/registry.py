"""The registry of node functions, one entry per name.

A ``FunctionSpec`` says what a node function is allowed to be (node types and
roles), where it runs (``placement``), which batch fields it needs and makes,
and which config section its per-node overrides patch.  Implementations are
bound to a name separately (``bind``) by the modules that define them, so the
planner can validate and plan a workflow without importing model code.

Users add functions without editing the package: a module listed in
``config.plugins`` calls ``FUNCTIONS.register(FunctionSpec(...), impl)`` (an advantage
estimator: ``nodes.advantages.register_estimator(Estimator(...))``).

The advantage estimators' specs are derived from their table
(``algos.estimators``, which imports no jax) by ``estimator_spec``, so a spec and its
estimator cannot disagree on group needs or inputs; the rule rewards' from theirs
(``rewards.registry``) by ``rule_reward_spec``.  The other built-in functions' specs are
listed here, beside no code, because the planner imports no jax and their nodes do.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
from collections.abc import Callable, Iterable

from distflow_jax.dag.spec import DagError, NodeType, Role
from distflow_jax.algos.estimators import BUILTIN_ESTIMATORS, Estimator
from distflow_jax.rewards.registry import BUILTIN_RULE_NODES, RuleNode
from distflow_jax.data.fields import (ADVANTAGES, BASELINE_MASK, BASELINE_TOKENS, OLD_LOGPROBS,
                                      REF_LOGPROBS, RESPONSE, RETURNS, REWARDS, ROLLOUT_LOGPROBS,
                                      SEQ, SUM_PI_SQUARED, VALUES)


class Placement(enum.Enum):
  # Per-host rollout replicas on the role's local devices (generation).
  ROLLOUT = "rollout"
  # The role's mesh; the batch is split over its data-parallel axes.
  ROLE_MESH = "role_mesh"
  # Host-side compute where the data already is (rewards, advantages).
  INHERIT = "inherit"




@dataclasses.dataclass(frozen=True)
class FunctionSpec:
  name: str
  types: frozenset[NodeType]
  roles: frozenset[Role | None]
  placement: Placement
  section: str  # config section that per-node overrides patch
  requires: frozenset[str] = frozenset()
  produces: frozenset[str] = frozenset()
  # Needs every sample of a prompt group on one host (group statistics).
  needs_groups: bool = False
  # Subtracts actor.kl's per-token penalty from its rewards when actor.kl.in_reward, so
  # it reads 'ref_logprobs' then (the advantages that use per-token rewards).
  kl_reward: bool = False
  # A reward that also scores the greedy baseline's responses ('baseline_tokens', from
  # generate.greedy) into 'baseline_rewards' when the batch holds them (ReMax).
  scores_baseline: bool = False
  doc: str = ""

  def implied_type(self) -> NodeType | None:
    return next(iter(self.types)) if len(self.types) == 1 else None

  def implied_role(self) -> Role | None | str:
    if len(self.roles) == 1:
      return next(iter(self.roles))
    return None if None in self.roles else "ambiguous"


class Registry:
  """Name -> spec (+ optional implementation)."""

  def __init__(self, what: str):
    self._what = what
    self._specs: dict[str, FunctionSpec] = {}
    self._impls: dict[str, Callable] = {}

  def register(self, spec: FunctionSpec, impl: Callable | None = None) -> None:
    if spec.name in self._specs and self._specs[spec.name] != spec:
      raise ValueError(f"{self._what} {spec.name!r} is already registered differently")
    self._specs[spec.name] = spec
    if impl is not None:
      self.bind(spec.name, impl)

  def bind(self, name: str, impl: Callable) -> None:
    self.spec(name)  # must be registered first
    self._impls[name] = impl

  def unregister(self, name: str) -> None:
    """Removes a function (spec and implementation), e.g. one a test registered."""
    self.spec(name)
    del self._specs[name]
    self._impls.pop(name, None)

  def names(self) -> list[str]:
    return sorted(self._specs)

  def __contains__(self, name: str) -> bool:
    return name in self._specs

  def spec(self, name: str) -> FunctionSpec:
    try:
      return self._specs[name]
    except KeyError:
      raise DagError(unknown_name_message(self._what, name, self._specs)) from None

  def impl(self, name: str) -> Callable:
    self.spec(name)
    try:
      return self._impls[name]
    except KeyError:
      raise DagError(f"{self._what} {name!r} is registered but has no implementation "
                     f"bound; bound ones: {sorted(self._impls)}") from None


def unknown_name_message(what: str, name: str, valid: Iterable[str]) -> str:
  valid = sorted(valid)
  close = difflib.get_close_matches(name, valid, n=3)
  hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
  return f"unknown {what} {name!r}.{hint} Registered: {', '.join(valid)}"


def _spec(name, types, roles, placement, section, requires=(), produces=(),
          needs_groups=False, kl_reward=False, scores_baseline=False, doc=""):
  return FunctionSpec(name=name, types=frozenset(types), roles=frozenset(roles),
                      placement=placement, section=section,
                      requires=frozenset(requires), produces=frozenset(produces),
                      needs_groups=needs_groups, kl_reward=kl_reward,
                      scores_baseline=scores_baseline, doc=doc)


_INF, _TRAIN, _COMP = NodeType.MODEL_INFERENCE, NodeType.MODEL_TRAIN, NodeType.COMPUTE


def estimator_spec(est: Estimator) -> FunctionSpec:
  """The spec of an advantage estimator's node: host-side where the rewards are, patched
  by ``algo`` overrides; reads rewards (and values, and the greedy baseline's rollout),
  makes advantages (and returns)."""
  return _spec(est.name, [_COMP], [None], Placement.INHERIT, "algo",
               requires=[REWARDS, *([VALUES] if est.values else []),
                         *([BASELINE_TOKENS] if est.baseline else []),
                         *([OLD_LOGPROBS, SUM_PI_SQUARED] if est.token_stats else [])],
               produces=[ADVANTAGES, *([RETURNS] if est.values else [])],
               needs_groups=est.needs_groups, kl_reward=est.token_rewards, doc=est.doc)


def rule_reward_spec(rule: RuleNode) -> FunctionSpec:
  """The DAG function ``reward.<name>`` of a rule reward; it scores the greedy baseline's
  responses too when there are some (generate.greedy, ReMax)."""
  return _spec(f"reward.{rule.name}", [_COMP], [Role.REWARD, None], Placement.INHERIT,
               "reward", requires=RESPONSE, produces=[REWARDS], scores_baseline=True,
               doc=rule.doc)


# The greedy baseline's responses (generate.greedy: 'baseline_tokens' and 'baseline_mask')
# are scored by the rule rewards after it into 'baseline_rewards'.

BUILTIN_SPECS = (
    _spec("generate", [_INF], [Role.ACTOR], Placement.ROLLOUT, "rollout",
          produces=[*SEQ, ROLLOUT_LOGPROBS], doc="n samples per prompt with the rollout engine"),
    _spec("generate.greedy", [_INF], [Role.ACTOR], Placement.ROLLOUT, "rollout",
          requires=SEQ, produces=[BASELINE_TOKENS, BASELINE_MASK],
          doc="one greedy response per prompt, the ReMax baseline (baseline_tokens)"),
    *(rule_reward_spec(rule) for rule in BUILTIN_RULE_NODES),
    _spec("reward.env", [_COMP], [Role.REWARD, None], Placement.INHERIT, "reward",
          requires=RESPONSE, produces=[REWARDS],
          doc="the environment's rewards of multi-turn episodes (rollout.env)"),
    _spec("reward.model", [_INF], [Role.REWARD], Placement.ROLE_MESH, "reward",
          requires=SEQ, produces=[REWARDS], doc="scalar-head reward model"),
    _spec("logprob", [_INF], [Role.ACTOR], Placement.ROLE_MESH, "actor",
          requires=SEQ, produces=[OLD_LOGPROBS], doc="actor log-probs before update"),
    _spec("logprob.stats", [_INF], [Role.ACTOR], Placement.ROLE_MESH, "actor",
          requires=SEQ, produces=[OLD_LOGPROBS, SUM_PI_SQUARED],
          doc="logprob, always run, plus sum pi^2 per token (the optimal token baseline's)"),
    _spec("ref_logprob", [_INF], [Role.REFERENCE], Placement.ROLE_MESH, "reference",
          requires=SEQ, produces=[REF_LOGPROBS], doc="frozen reference log-probs"),
    _spec("values", [_INF], [Role.CRITIC], Placement.ROLE_MESH, "critic",
          requires=SEQ, produces=[VALUES], doc="critic values per token"),
    *(estimator_spec(est) for est in BUILTIN_ESTIMATORS),
    _spec("train.actor", [_TRAIN], [Role.ACTOR], Placement.ROLE_MESH, "actor",
          requires=[ADVANTAGES, *SEQ], doc="policy-gradient update"),
    _spec("train.critic", [_TRAIN], [Role.CRITIC], Placement.ROLE_MESH, "critic",
          requires=[RETURNS, VALUES], doc="value regression update"),
)


def default_registry() -> Registry:
  reg = Registry("node function")
  for spec in BUILTIN_SPECS:
    reg.register(spec)
  return reg


FUNCTIONS = default_registry()
