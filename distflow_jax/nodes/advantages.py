"""Advantage nodes: ``advantage.<kind>`` runs one ``Estimator`` of ``algos.estimators``.

The node gathers this host's rows, checks prompt groups are whole when the estimator
needs them, builds the per-token rewards (with the KL penalty) or reads the critic's
values only for estimators that read them, runs the estimator, and whitens over the
whole batch when the estimator says so.  ``register_estimator`` adds an estimator
(spec and node) in one call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from distflow_jax.algos import advantages as adv_lib
from distflow_jax.algos import kl as kl_lib, masked
from distflow_jax.dag.registry import FUNCTIONS, Registry, estimator_spec
from distflow_jax.dag.spec import DagError, Node
from distflow_jax.data import layout as dlayout
from distflow_jax.data.batch import Batch
from distflow_jax.nodes.common import NodeFn, NodeOut, NodeTable, local_fields
from distflow_jax.algos.estimators import BUILTIN_ESTIMATORS, AdvantageInput, Estimator
from distflow_jax.state.context import RunContext, put_local
from distflow_jax.state.metrics import Metrics, gather_processes
from distflow_jax.train.loss_mask import loss_mask
from distflow_jax.data.fields import (ADVANTAGES, BASELINE_REWARDS, GROUP_ID, LOSS_MASK,
                                      OLD_LOGPROBS, PLACED_REWARDS, REF_LOGPROBS, RESPONSE_MASK,
                                      RETURNS, REWARDS, ROLLOUT_LOGPROBS, SAMPLE_ID,
                                      SUM_PI_SQUARED, VALUES)


def advantage_node(est: Estimator) -> NodeFn:
  """The node function that runs ``est``."""
  return functools.partial(_advantage, est)


def register_estimator(est: Estimator, registry: Registry = FUNCTIONS) -> None:
  """Makes ``est`` a DAG function: registers its spec (derived from ``est``, so the
  planner's view and the node's agree) and binds its node."""
  registry.register(estimator_spec(est), advantage_node(est))


def _check_groups(node: Node, group_ids: np.ndarray, n: int) -> None:
  blocks = group_ids.reshape(-1, n) if group_ids.size % n == 0 else None
  if blocks is None or (blocks != blocks[:, :1]).any():
    raise DagError(f"DAG node {node.id!r} needs the {n} samples of each prompt together on "
                   f"this host, but its rows hold groups {group_ids[:2 * n].tolist()}...: "
                   f"a group was split (check rollout.n and the re-partition before it)")


def token_rewards_of(rewards_B: jax.Array, placed_BxT: jax.Array | None, mask: jax.Array
                     ) -> jax.Array:
  """Per-token rewards: the part of each reward placed at given tokens (``placed_rewards``:
  a multi-turn episode's per-turn rewards, on each turn's last generated token) stays
  there, the rest goes on the last generated token."""
  if placed_BxT is None:
    return adv_lib.outcome_to_token_rewards(rewards_B, mask)
  placed = placed_BxT.astype(jnp.float32) * mask
  return adv_lib.outcome_to_token_rewards(rewards_B - placed.sum(1), mask) + placed


def _token_rewards(ctx: RunContext, node: Node, loc: dict, mask: jax.Array,
                   metrics: Metrics) -> jax.Array:
  placed = loc.get(PLACED_REWARDS)
  token_rewards = token_rewards_of(jnp.asarray(loc[REWARDS]),
                                   None if placed is None else jnp.asarray(placed), mask)
  kl_cfg = ctx.cfg.actor.kl
  coef = ctx.kl_coef if ctx.kl_coef is not None else kl_cfg.coef
  if kl_cfg.in_reward and coef:
    if REF_LOGPROBS not in loc:
      raise DagError(f"DAG node {node.id!r}: actor.kl.in_reward needs 'ref_logprobs'; add a "
                     f"ref_logprob node to its dependencies")
    logp = loc.get(OLD_LOGPROBS, loc[ROLLOUT_LOGPROBS])
    kl = kl_lib.kl_divergence(logp, loc[REF_LOGPROBS], kl_cfg.estimator, kl_cfg.k3_cap)
    token_rewards = kl_lib.apply_kl_penalty(token_rewards, kl, mask, coef)
    metrics.add("kl_coef", coef)
    metrics.add("kl_penalty", float(jnp.sum(kl * mask)), float(mask.sum()))
  return token_rewards


def _baseline_rewards(node: Node, loc: dict) -> jax.Array:
  if BASELINE_REWARDS not in loc:
    raise DagError(f"DAG node {node.id!r} reads the greedy baseline's rewards, but no rule "
                   f"reward scored a baseline: put a generate.greedy node before the reward "
                   f"nodes (deps: generate -> generate.greedy -> reward.math -> {node.id})")
  return jnp.asarray(loc[BASELINE_REWARDS])


def _advantage(est: Estimator, ctx: RunContext, node: Node, lay: dlayout.Layout,
               batch: Batch) -> NodeOut:
  algo, n = ctx.section(node, "algo"), ctx.cfg.rollout.n
  metrics = Metrics()
  keys = [REWARDS, RESPONSE_MASK, ROLLOUT_LOGPROBS] + [
      k for k in (VALUES, OLD_LOGPROBS, REF_LOGPROBS, LOSS_MASK, PLACED_REWARDS, BASELINE_REWARDS,
                  SUM_PI_SQUARED) if k in batch.data]
  loc = local_fields(batch, *keys)
  # The generated tokens: a multi-turn episode's observation tokens get no reward, no KL
  # and no advantage, and GAE skips them as it skips padding (train/loss_mask.py).
  mask = loss_mask({k: jnp.asarray(v) for k, v in loc.items()})
  if est.needs_groups:
    _check_groups(node, loc[GROUP_ID], n)
  out = est.fn(AdvantageInput(
      rewards_B=jnp.asarray(loc[REWARDS]), mask_BxT=mask, group_size=n, algo=algo,
      token_rewards_BxT=(_token_rewards(ctx, node, loc, mask, metrics)
                         if est.token_rewards else None),
      values_BxT=jnp.asarray(loc[VALUES]) if est.values else None,
      baseline_rewards_B=_baseline_rewards(node, loc) if est.baseline else None,
      old_logprobs_BxT=jnp.asarray(loc[OLD_LOGPROBS]) if est.token_stats else None,
      sum_pi_squared_BxT=jnp.asarray(loc[SUM_PI_SQUARED]) if est.token_stats else None))
  advantages = out.advantages_BxT
  if est.whiten:
    advantages = global_whiten(np.asarray(advantages), np.asarray(mask), loc[SAMPLE_ID])
  metrics.add_mean("reward", loc[REWARDS])
  metrics.add("reward_sq", float(np.sum(np.square(loc[REWARDS]))), loc[REWARDS].size)
  # The observed range bounds the report's mean +- std band (0/1 rewards never go below 0).
  # The minimum travels negated because hosts reduce by maximum (executor.py turns it back);
  # every host sets both keys, rows or not, so the gathered vectors line up.
  rewards = np.asarray(loc[REWARDS], np.float64)
  metrics.set_max("reward_max", float(np.max(rewards, initial=-np.inf)))
  metrics.set_max("reward_min_neg", float(np.max(-rewards, initial=-np.inf)))
  return NodeOut(put_local(batch, lay, **{ADVANTAGES: np.asarray(advantages, np.float32)},
                           **{RETURNS: np.asarray(out.returns_BxT, np.float32)}), metrics)


def global_whiten(x: np.ndarray, mask: np.ndarray, sample_ids: np.ndarray) -> np.ndarray:
  """``algos.masked.masked_whiten`` over the whole batch of every host.

  The statistics come from per-row sums gathered from every host and added in sample-id
  order, so the result is bitwise the same however samples are spread over hosts.
  """
  m = mask.astype(np.float64)
  xr = np.where(m > 0, x.astype(np.float64), 0.0)

  def ordered_total(per_row: np.ndarray) -> np.ndarray:
    rows = gather_processes(np.concatenate([sample_ids[:, None].astype(np.float64), per_row],
                                           axis=1)).reshape(-1, per_row.shape[1] + 1)
    return rows[np.argsort(rows[:, 0], kind="stable"), 1:].sum(axis=0)

  n, s1 = ordered_total(np.stack([m.sum(axis=1), xr.sum(axis=1)], axis=1))
  mean = s1 / max(n, 1.0)
  s2 = ordered_total(((xr - mean) ** 2 * m).sum(axis=1)[:, None])[0]
  var = s2 / max(n - 1.0, 1.0)
  return ((xr - mean) / np.sqrt(var + masked.WHITEN_EPS) * m).astype(np.float32)


NODES: NodeTable = {est.name: advantage_node(est) for est in BUILTIN_ESTIMATORS}
