"""Workflow rules beyond the graph: what the executor would otherwise get wrong silently
or only after set-up and a first rollout.  Every error is one line naming the node(s).

* One producer per batch field (rewards are summed, so several may make them): the
  executor carries one batch along the chain, so a second producer would overwrite the
  first even where no single node sees both.
* One trainer per role: a role has one parameter set and one optimizer state.
* A critic that is read (``values``) is also trained (``train.critic``).
* Something trains the actor: a workflow whose only trainer is the critic's would run
  rollouts, rewards and critic updates forever while the policy never changes.
* ``check_kl_reference`` (needs the config, called by ``plan_from_config``): a KL
  coefficient > 0 needs reference log-probs made before the node that reads them.
* ``check_off_policy_logprobs`` (likewise): an off-policy correction needs both the
  rollout's log-probs and the trainer's recomputed old ones made before ``train.actor``.
* ``check_baseline_rewards``: an estimator that reads the greedy baseline's rewards (ReMax)
  needs every reward before it to score the baseline too, so each reward node must be a
  rule reward (``scores_baseline``) that runs after ``generate.greedy``.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from distflow_jax.dag.graph import short_list
from distflow_jax.dag.registry import Registry
from distflow_jax.dag.spec import DagError, Node, NodeType, Role
from distflow_jax.data.fields import (BASELINE_TOKENS, OLD_LOGPROBS, REF_LOGPROBS, REWARDS,
                                      ROLLOUT_LOGPROBS, SUMMED)

if TYPE_CHECKING:
  from distflow_jax.dag.graph import Dag

# Functions that read 'ref_logprobs' when actor.kl.coef > 0: the actor's loss term
# (actor.kl.in_reward False), and every function whose spec says ``kl_reward`` (the
# advantages that subtract a per-token KL penalty from the rewards, in_reward True,
# plugin estimators included).  Group advantages use outcome rewards only.
KL_LOSS_FNS = frozenset({"train.actor"})


def check_workflow(dag: "Dag", registry: Registry) -> None:
  _check_one_producer(dag, registry)
  _check_one_trainer(dag)
  _check_critic_trained(dag)
  _check_actor_trained(dag)


def _check_one_producer(dag: "Dag", registry: Registry) -> None:
  makers: dict[str, list[str]] = {}
  for n in dag.nodes:
    for field in registry.spec(n.fn).produces:
      makers.setdefault(field, []).append(n.id)
  for field in sorted(makers):
    if field not in SUMMED and len(makers[field]) > 1:
      raise DagError(f"DAG nodes {short_list(makers[field])} all produce {field!r}; the "
                     f"batch holds one {field!r}, so one would overwrite the other (only "
                     f"rewards are summed): keep one producer")


def _check_one_trainer(dag: "Dag") -> None:
  trainers: dict[Role, list[str]] = {}
  for n in dag.nodes:
    if n.type is NodeType.MODEL_TRAIN and n.role is not None:
      trainers.setdefault(n.role, []).append(n.id)
  for role in sorted(trainers, key=lambda r: r.value):
    if len(trainers[role]) > 1:
      raise DagError(f"DAG nodes {short_list(trainers[role])} all train the {role.value} "
                     f"model; a role has one set of weights and one optimizer: keep one "
                     f"MODEL_TRAIN node for it")


def _check_critic_trained(dag: "Dag") -> None:
  readers = [n.id for n in dag.nodes
             if n.role is Role.CRITIC and n.type is not NodeType.MODEL_TRAIN]
  trained = any(n.role is Role.CRITIC and n.type is NodeType.MODEL_TRAIN for n in dag.nodes)
  if readers and not trained:
    raise DagError(f"DAG node(s) {short_list(readers)} run the CRITIC model, but no node "
                   f"trains it, so its values would never learn: add a train.critic node "
                   f"(deps: the advantage node and {readers[0]!r})")


def _check_actor_trained(dag: "Dag") -> None:
  trainers = [n for n in dag.nodes if n.type is NodeType.MODEL_TRAIN]
  if trainers and not any(n.role is Role.ACTOR for n in trainers):
    roles = sorted({n.role.value if n.role else "no role" for n in trainers})
    raise DagError(f"DAG node(s) {short_list([n.id for n in trainers])} train only the "
                   f"{'/'.join(roles)} model and no node trains the actor, so nothing would "
                   f"change the policy (every step would sample the same model): add a "
                   f"train.actor node (deps: the advantage node)")


def check_kl_reference(steps: Iterable[Any], registry: Registry, coef: Any,
                       in_reward: Any) -> None:
  """Refuses a KL coefficient > 0 whose reader runs before any node makes 'ref_logprobs'.

  ``steps``: the plan's chain (objects with ``.node``), in execution order; the
  executor's batch holds every field made earlier in the chain.  ``coef`` and
  ``in_reward``: ``actor.kl.coef`` and ``actor.kl.in_reward``; a ``train.actor``
  node's own ``config=dict(kl=...)`` overrides them for its loss.
  """
  made: set[str] = set()
  for step in steps:
    node = step.node
    need = ""
    if node.fn in KL_LOSS_FNS:
      c, r, where = _node_kl(node, registry, coef, in_reward)
      if c > 0 and not r:
        need = f"{where}kl.coef={c} > 0 with kl.in_reward=False (a KL loss term)"
    elif registry.spec(node.fn).kl_reward:
      c, r = _number(coef, "actor.kl.coef", node), _flag(in_reward, "actor.kl.in_reward", node)
      if c > 0 and r:
        need = f"actor.kl.coef={c} > 0 with actor.kl.in_reward=True (a KL penalty in its rewards)"
    if need and REF_LOGPROBS not in made:
      raise DagError(f"DAG node {node.id!r} (fn {node.fn!r}): {need} needs {REF_LOGPROBS!r}, "
                     f"but no ref_logprob node runs before it; add one to its deps, or set "
                     f"actor.kl.coef=0")
    made |= registry.spec(node.fn).produces


def _node_kl(node: Node, registry: Registry, coef: Any, in_reward: Any):
  where = "actor."
  over = node.overrides.get("kl") if registry.spec(node.fn).section == "actor" else None
  if over is not None:
    if not isinstance(over, Mapping):
      raise DagError(f"DAG node {node.id!r}: config override 'kl' must be a dict, got {over!r}")
    if "coef" in over or "in_reward" in over:
      where = "its config override "
    coef, in_reward = over.get("coef", coef), over.get("in_reward", in_reward)
  return (_number(coef, f"{where}kl.coef", node), _flag(in_reward, f"{where}kl.in_reward", node),
          where)


def _number(value: Any, key: str, node: Node) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise DagError(f"DAG node {node.id!r}: {key}={value!r} must be a number")
  return float(value)


def _flag(value: Any, key: str, node: Node) -> bool:
  if not isinstance(value, bool):
    raise DagError(f"DAG node {node.id!r}: {key}={value!r} must be True or False")
  return value


# What an off-policy correction (actor.off_policy.correction, algos/off_policy.py) reads,
# and which kind of node makes it.
OFF_POLICY_FIELDS = ((ROLLOUT_LOGPROBS, "a rollout that records its log-probs (generate)"),
                     (OLD_LOGPROBS, "a logprob node (the trainer's recomputed log-probs)"))


def check_off_policy_logprobs(steps: Iterable[Any], registry: Registry, correction: Any) -> None:
  """Refuses an off-policy correction on a ``train.actor`` node before which the chain
  makes no 'rollout_logprobs' or no 'old_logprobs'.  ``correction``: the global
  ``actor.off_policy.correction``; a node's ``config=dict(off_policy=...)`` overrides it."""
  from distflow_jax.algos.off_policy import OffPolicyCorrection  # here: rules stay jax-free
  made: set[str] = set()
  for step in steps:
    node = step.node
    if node.fn in KL_LOSS_FNS:
      over = node.overrides.get("off_policy")
      where, value = "actor.", correction
      if isinstance(over, Mapping) and "correction" in over:
        where, value = "its config override ", over["correction"]
      if OffPolicyCorrection.parse(value) is not OffPolicyCorrection.NONE:
        for field, maker in OFF_POLICY_FIELDS:
          if field not in made:
            raise DagError(
                f"DAG node {node.id!r} (fn {node.fn!r}): {where}off_policy.correction="
                f"{value!r} needs {field!r}, but no node before it makes it; add "
                f"{maker} to its deps, or set actor.off_policy.correction=none")
    made |= registry.spec(node.fn).produces


def check_baseline_rewards(steps: Iterable[Any], registry: Registry) -> None:
  """Refuses a baseline-reading advantage node (ReMax) whose rewards the baseline's do not
  match: a reward node before it that does not score baselines (a reward model, the
  environment's), or one that runs before ``generate.greedy`` made them."""
  rewards: list[tuple[Node, bool]] = []  # (reward node, baseline made before it)
  made: set[str] = set()
  for step in steps:
    node, spec = step.node, registry.spec(step.node.fn)
    if REWARDS in spec.produces:
      rewards.append((node, BASELINE_TOKENS in made))
    if BASELINE_TOKENS in spec.requires and spec.name.startswith("advantage."):
      for reward, after in rewards:
        if not registry.spec(reward.fn).scores_baseline:
          raise DagError(f"DAG node {node.id!r} ({node.fn}) subtracts the greedy baseline's "
                         f"reward, but reward node {reward.id!r} ({reward.fn}) does not score "
                         f"the baseline; use rule rewards only (reward.math, "
                         f"reward.math_lenient, reward.format)")
        if not after:
          raise DagError(f"DAG node {node.id!r} ({node.fn}) subtracts the greedy baseline's "
                         f"reward, but reward node {reward.id!r} runs before the "
                         f"generate.greedy node, so the baseline is not scored by it; make "
                         f"{reward.id!r} depend on the generate.greedy node")
    made |= spec.produces
