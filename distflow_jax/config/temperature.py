"""The temperature the training passes read the policy at: the rollout's.

    t = train_temperature(cfg, nodes, registry)   # rollout.temperature; 1 for greedy
    check(cfg, plan, registry)                    # what training at t != 1 needs

The samples come from softmax(logits / T), so the policy gradient, the PPO ratio, the KL
to the reference and the entropy are those of that distribution: every training pass
(old log-probs, reference log-probs, the actor's loss) divides the logits by T, as verl
and TRL do.  At T = 1 nothing changes.  At T != 1 the rollout's own log-probs (which are
temperature 1) cannot stand in for the old ones, so the ``logprob`` node recomputes them
(``nodes/passes.on_policy``), and an off-policy correction, whose behaviour policy is
those temperature-1 log-probs, is refused.
"""

from __future__ import annotations

from distflow_jax.config import checks
from distflow_jax.config.response import pass_temperature
from distflow_jax.config.loading import ConfigError
from distflow_jax.dag.graph import Dag


def check_training(cfg, plan, registry) -> None:
  """What only training needs of the sampling (eval and generate may decode greedily or at
  any temperature): sampled groups (checks.check_group_sampling) and what the rollout's
  temperature asks of the passes (``check``)."""
  checks.check_group_sampling(cfg, plan, registry)
  check(cfg, plan, registry)


def rollout_temperatures(cfg, nodes, registry) -> dict[str, float]:
  """Each rollout node's effective temperature (its own override, else the global one)."""
  return {n.id: float(checks.node_section(cfg, n, registry).temperature) for n in nodes
          if registry.spec(n.fn).section == "rollout"}


def train_temperature(cfg, nodes, registry) -> float:
  """The rollout node's temperature (a DAG has one: two producers of its tokens are
  refused), or the global one; 1 for greedy."""
  temps = list(rollout_temperatures(cfg, nodes, registry).values())
  return pass_temperature(temps[0] if temps else cfg.rollout.temperature)


def check(cfg, plan, registry) -> None:
  """For training at T != 1: an old-log-prob node before each actor trainer and no
  off-policy correction."""
  nodes = tuple(s.node for s in plan.steps)
  t = train_temperature(cfg, nodes, registry)
  if t == 1.0:
    return
  dag = Dag(nodes, entry=nodes[0].id)
  for s in plan.steps:
    if s.node.fn != "train.actor":
      continue
    correction = checks.node_section(cfg, s.node, registry).off_policy.correction
    if correction != "none":
      raise ConfigError(
          f"actor.off_policy.correction={correction!r} at rollout.temperature={t:g}: the "
          f"rollout records temperature-1 log-probs, not those of the distribution it "
          f"sampled from, so the correction's weights would be wrong; sample at "
          f"temperature 1 or set actor.off_policy.correction=none")
    if not any("old_logprobs" in registry.spec(dag.node(i).fn).produces
               for i in dag.ancestors(s.node.id)):
      raise ConfigError(
          f"rollout.temperature={t:g}: node {s.node.id!r} (train.actor) needs the old "
          f"log-probs at that temperature, and the rollout's are temperature 1; add "
          f"dict(id='old_logprob', fn='logprob', deps=['generate']) to its deps")
