"""Reward nodes: rule rewards (``reward.<name>`` of ``distflow_jax.rewards``) and the
learned reward model.  Each adds its (weighted) score to any rewards already in the batch."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from distflow_jax.dag.registry import FUNCTIONS, Registry, rule_reward_spec
from distflow_jax.dag.spec import DagError, Node, Role
from distflow_jax.data import layout as dlayout
from distflow_jax.data.batch import Batch, to_local
from distflow_jax.nodes.common import NodeFn, NodeOut, NodeTable, seq
from distflow_jax.nodes.pass_plan import pass_fn
from distflow_jax.rewards import registry as reward_registry
from distflow_jax.state.metrics import Metrics
from distflow_jax.train import steps as steps_lib
from distflow_jax.state.context import RunContext, put_local
from distflow_jax.data.fields import (BASELINE_MASK, BASELINE_REWARDS, BASELINE_TOKENS,
                                      ENV_REWARDS, ENV_TURN_REWARDS, GROUP_ID, PLACED_REWARDS,
                                      RESPONSE_MASK, RESPONSE_TOKENS, REWARDS, SAMPLE_ID)


def _texts(ctx: RunContext, toks: np.ndarray, mask: np.ndarray) -> list[str]:
  return [ctx.tokenizer.decode(toks[i][mask[i]].tolist()) for i in range(len(toks))]


def _rule_reward(name: str, ctx: RunContext, node: Node, lay: dlayout.Layout,
                 batch: Batch) -> NodeOut:
  baseline = BASELINE_TOKENS in batch.data
  keys = (RESPONSE_TOKENS, RESPONSE_MASK, SAMPLE_ID, GROUP_ID) + (
      (BASELINE_TOKENS, BASELINE_MASK) if baseline else ())
  local = to_local(Batch({k: batch.data[k] for k in keys}, batch.host))
  texts = _texts(ctx, local.data[RESPONSE_TOKENS], local.data[RESPONSE_MASK])
  fields = local.host_fields(local.data[GROUP_ID])
  missing = [int(g) for g, f in zip(local.data[GROUP_ID], fields) if f is None]
  if missing:
    raise DagError(f"DAG node {node.id!r}: prompt groups {missing[:4]} are not on the host "
                   f"that loaded them, so their ground truth is not here; run rule rewards "
                   f"before any node that re-partitions the batch")
  truths = [f["answer"] for f in fields]
  # reward.match (numeric | exact | math_verify) sets how reward.math compares answers.
  fn = reward_registry.configured_reward(name, ctx.section(node, "reward"))
  scores = reward_registry.score_batch(fn, texts, truths,
                                       sample_ids=local.data[SAMPLE_ID].tolist())
  metrics = Metrics()
  metrics.add_mean(f"reward/{node.id}", scores)
  rule = reward_registry.rule_node(name)
  if rule is not None and rule.verifier:  # its score is correctness: the accuracy
    metrics.add_mean("accuracy", scores > 0)
  out = {REWARDS: _weighted(ctx, node, scores, local.data[SAMPLE_ID], "sample id")}
  if baseline:  # each group's greedy response once (its rows all hold it), then to its rows
    _, first, inverse = np.unique(local.data[GROUP_ID], return_index=True, return_inverse=True)
    b_scores = reward_registry.score_batch(
        fn, _texts(ctx, local.data[BASELINE_TOKENS][first], local.data[BASELINE_MASK][first]),
        [truths[i] for i in first])
    metrics.add_mean(f"reward/{node.id}_baseline", b_scores)
    out[BASELINE_REWARDS] = _weighted(ctx, node, b_scores, local.data[GROUP_ID][first],
                                      "the greedy baseline of group")[inverse.reshape(-1)]
  for key in out:
    if key in batch.data:
      out[key] = out[key] + to_local(Batch({key: batch.data[key],
                                            SAMPLE_ID: batch.data[SAMPLE_ID],
                                            GROUP_ID: batch.data[GROUP_ID]})).data[key]
  return NodeOut(put_local(batch, lay, **out), metrics)


def _weighted(ctx: RunContext, node: Node, scores: np.ndarray, ids: np.ndarray,
              what: str) -> np.ndarray:
  """reward.weight times the scores in float32; a non-finite product is refused."""
  weight = ctx.section(node, "reward").weight
  with np.errstate(over="ignore", invalid="ignore"):
    rewards = np.float32(weight) * scores.astype(np.float32)
  if not np.all(np.isfinite(rewards)):
    i = int(np.flatnonzero(~np.isfinite(rewards))[0])
    raise reward_registry.RewardFunctionError(
        f"DAG node {node.id!r}: reward.weight={weight} times the score {scores[i]} of "
        f"{what} {int(ids[i])} is {rewards[i]} in float32; lower the weight or the "
        f"reward's scale")
  return rewards


def rule_reward_node(name: str) -> NodeFn:
  """The node function of a rule reward registered in ``distflow_jax.rewards`` as ``name``;
  plugins use it to expose their own rewards as DAG functions."""
  return functools.partial(_rule_reward, name)


def register_rule_reward(name: str, fn: reward_registry.RewardFn, doc: str, *,
                         verifier: bool = False, registry: Registry = FUNCTIONS) -> None:
  """Makes ``fn(completion, ground_truth) -> float`` the DAG function ``reward.<name>``:
  registers the reward, its spec (derived from the entry) and its node, in one call.  A
  built-in reward's name is refused; a plugin loaded again replaces its own entry."""
  if name in reward_registry.BUILTIN_REWARDS:
    raise ValueError(f"reward {name!r} is built in; give the plugin's reward another name")
  reward_registry.register_reward(name, fn, overwrite=True, node_doc=doc, verifier=verifier)
  registry.register(rule_reward_spec(reward_registry.rule_node(name)), rule_reward_node(name))


def reward_model(ctx: RunContext, node: Node, lay: dlayout.Layout, batch: Batch) -> NodeOut:
  """The learned reward model's score of prompt + response, on the reward mesh; added to
  any rewards already in the batch (rule rewards), times ``reward.weight``."""
  state = ctx.roles[Role.REWARD]
  fn = ctx.jitted(("reward_model", lay), lambda: pass_fn(
      ctx, lay, steps_lib.sequence_scores, ctx.cfg.actor.micro_batch_size))
  scores = fn(state.graphdef, state.params, seq(batch))
  weight = ctx.section(node, "reward").weight
  metrics = Metrics()
  metrics.add(f"reward/{node.id}", float(jnp.sum(scores)), scores.shape[0])
  rewards = weight * scores
  if REWARDS in batch.data:
    rewards = rewards + batch.data[REWARDS]
  return NodeOut(batch.replace(**{REWARDS: rewards}), metrics)


def env_reward(ctx: RunContext, node: Node, lay: dlayout.Layout, batch: Batch) -> NodeOut:
  """The environment's rewards of each episode (summed over its turns, rollout.env), times
  ``reward.weight``, added to any rewards already in the batch; each turn's also placed on
  its last generated token (``placed_rewards``)."""
  if ENV_REWARDS not in batch.data:
    raise DagError(f"DAG node {node.id!r}: reward.env reads the environment's rewards of "
                   f"multi-turn episodes; set rollout.env (an environment) or use another "
                   f"reward")
  scores = batch.data[ENV_REWARDS]
  metrics = Metrics()
  metrics.add(f"reward/{node.id}", float(jnp.sum(scores)), scores.shape[0])
  weight = ctx.section(node, "reward").weight
  rewards, placed = weight * scores, weight * batch.data[ENV_TURN_REWARDS]
  if REWARDS in batch.data:
    rewards = rewards + batch.data[REWARDS]
  if PLACED_REWARDS in batch.data:
    placed = placed + batch.data[PLACED_REWARDS]
  # The same rewards, also where each turn earned them (per-token rewards: GAE).
  return NodeOut(batch.replace(**{REWARDS: rewards, PLACED_REWARDS: placed}), metrics)


NODES: NodeTable = {
    "reward.env": env_reward,
    **{f"reward.{rule.name}": rule_reward_node(rule.name)
       for rule in reward_registry.BUILTIN_RULE_NODES},
    "reward.model": reward_model,
}
