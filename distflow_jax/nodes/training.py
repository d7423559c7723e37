"""Train nodes: ``train.actor`` (policy gradient) and ``train.critic`` (value regression).

Each runs ``ppo_epochs`` epochs over ``mini_batches`` mini-batches of the step's batch,
and returns the role's new parameters and optimizer state (the executor puts them in
place of the old; the step donates the old ones).  The actor's
also records the rollout-training log-prob gap and, with an off-policy correction, its
importance weights (``off_policy_metrics``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from distflow_jax.algos import off_policy
from distflow_jax.algos.losses import LossAggMode
from distflow_jax.dag.spec import DagError, Node, Role
from distflow_jax.data import layout as dlayout
from distflow_jax.data.batch import Batch
from distflow_jax.nodes.common import NodeOut, NodeTable, TrainedState, seq
from distflow_jax.nodes.pass_plan import (budget_plan, on_policy, pack_plan, prompt_group,
                                         train_temperature)
from distflow_jax.train import deterministic, micro_batches, steps as steps_lib
from distflow_jax.state.context import RunContext
from distflow_jax.state.metrics import Metrics
from distflow_jax.data.fields import (ADVANTAGES, LOSS_MASK, OLD_LOGPROBS, PROMPT_MASK,
                                      REF_LOGPROBS, RESPONSE_MASK, RETURNS, ROLLOUT_LOGPROBS,
                                      SAMPLE_ID, VALUES)


@dataclasses.dataclass(frozen=True)
class StepShape:
  """How a train node splits its step's rows: ``minis`` mini-batches, ``micro`` micro-batches
  each (None: token-budget micro-batches, ``budget`` tokens), ``parts`` shards x pieces that
  must each hold whole prompt groups to share prompts."""
  minis: int
  micro: int | None
  budget: int
  parts: int
  det: bool


def step_shape(ctx: RunContext, role: Role, section, lay: dlayout.Layout, rows: int
               ) -> StepShape:
  minis = section.mini_batches if role is Role.ACTOR else 1
  budget = section.micro_batch_tokens  # > 0: micro-batches by tokens, M per plan
  micro = None if budget else max(rows // lay.num_shards // minis // section.micro_batch_size, 1)
  det = ctx.cfg.trainer.deterministic
  parts = rows // section.micro_batch_size if det else lay.num_shards * minis * (micro or 1)
  return StepShape(minis, micro, budget, parts, det)


def loss_for(ctx: RunContext, role: Role, section, gs: int):
  """``(loss_fn, agg)`` of the role's train step (actor: the policy loss with the step's
  prompt group size; critic: value regression)."""
  if role is Role.ACTOR:
    loss_cfg = steps_lib.ActorLoss.from_config(section, ctx.cfg.rollout.response_width, gs,
                                               temperature=train_temperature(ctx))
    return functools.partial(_actor_loss, cfg=loss_cfg), loss_cfg.loss_agg
  # the train steps take the config's spelling
  return (functools.partial(_critic_loss, value_clip=section.value_clip),
          LossAggMode.TOKEN_MEAN.value)


def train_step(ctx: RunContext, role: Role, section, lay: dlayout.Layout, shape: StepShape,
               loss_fn, agg: str, gs: int):
  """The role's jitted train step (built once per layout, split and loss)."""
  state = ctx.roles[role]
  if shape.det:
    make = lambda: deterministic.make_train_step(  # noqa: E731
        loss_fn, state.graphdef, state.tx, lay.mesh, section.micro_batch_size, agg,
        section.optimizer.grad_clip, gs, lay.axes)
  else:
    make = lambda: steps_lib.make_train_step(  # noqa: E731
        loss_fn, state.graphdef, state.tx, shape.micro, agg, gs)
  return ctx.jitted(("train", role, lay, shape.micro, agg, loss_fn.keywords.get("cfg"),
                     shape.det), make)


def row_order(ctx: RunContext, lay: dlayout.Layout):
  """Deterministic mode: ``(data, sample_ids) -> data`` in sample-id order.  The batch's
  own row order depends on the layout (each process loads every process_count-th prompt
  and its rows come as a block), and the canonical reduction tree sums units by row
  position, so the rows are put in an order that every layout shares first.  A group's
  samples keep their adjacent ids (prompt_id * n + j), so shared-prompt groups stay whole."""
  def order(d, ids):
    perm = jnp.argsort(ids, stable=True)
    return jax.tree.map(lambda x: x[perm], d)
  return ctx.jitted(("canonical_rows", lay),
                    lambda: jax.jit(order, out_shardings=lay.sharding))


def minibatch_take(ctx: RunContext, minis: int, gs: int, lay: dlayout.Layout):
  """Mini-batch i: whole groups (blocks of gs rows) dealt round robin, as micro-batches are."""
  def take_minibatch(d, i):
    return jax.tree.map(lambda x: x[i], micro_batches.deal_rows(d, minis, gs))
  return ctx.jitted(("minibatch", minis, gs, lay), lambda: jax.jit(
      take_minibatch, out_shardings=lay.sharding))


def _train(role: Role, ctx: RunContext, node: Node, lay: dlayout.Layout,
           batch: Batch) -> NodeOut:
  metrics = Metrics()
  if role is Role.ACTOR and ctx.step < ctx.cfg.critic.warmup_steps:
    metrics.add("actor/critic_warmup", 1.0)  # the critic learns first; actor unchanged
    return NodeOut(batch, metrics)
  state = ctx.roles[role]
  section = ctx.section(node, role.value.lower())
  data = seq(batch)
  shape = step_shape(ctx, role, section, lay, data[RESPONSE_MASK].shape[0])
  minis, micro, budget = shape.minis, shape.micro, shape.budget
  # on the sequence fields alone: the same compiled check as the log-prob passes'
  gs = prompt_group(ctx, node, data, shape.parts, metrics) if role is Role.ACTOR else 1
  if LOSS_MASK in batch.data:  # multi-turn episodes: observation tokens are not trained on
    data[LOSS_MASK] = batch.data[LOSS_MASK]
  loss_fn, agg = loss_for(ctx, role, section, gs)
  if role is Role.ACTOR:
    data[ADVANTAGES] = batch.data[ADVANTAGES]
    data[OLD_LOGPROBS] = batch.data.get(OLD_LOGPROBS, batch.data[ROLLOUT_LOGPROBS])
    loss_cfg = loss_fn.keywords["cfg"]
    if loss_cfg.correction is not off_policy.OffPolicyCorrection.NONE:
      data[ROLLOUT_LOGPROBS] = batch.data[ROLLOUT_LOGPROBS]  # mu, the behaviour policy
    off_policy_metrics(ctx, lay, batch, loss_cfg, metrics)
    if loss_cfg.kl_in_loss and loss_cfg.kl_coef:
      if REF_LOGPROBS not in batch.data:
        raise DagError(f"DAG node {node.id!r}: actor.kl.coef > 0 needs 'ref_logprobs'; add a "
                       f"ref_logprob node to its deps or set actor.kl.coef=0")
      data[REF_LOGPROBS] = batch.data[REF_LOGPROBS]
  else:
    data.update({VALUES: batch.data[VALUES], RETURNS: batch.data[RETURNS]})
  if shape.det:
    data = row_order(ctx, lay)(data, batch.data[SAMPLE_ID])
  step = train_step(ctx, role, section, lay, shape, loss_fn, agg, gs)
  take = minibatch_take(ctx, minis, gs, lay)
  prefix = "actor" if role is Role.ACTOR else "critic"
  # model.pack_sequences: one packing plan per mini-batch (its micro-batches' plans stacked;
  # with <role>.micro_batch_tokens, its token-budget micro-batches); gs > 1 lays each
  # group's prompt once.
  masks = {k: data[k] for k in (PROMPT_MASK, RESPONSE_MASK)}
  plans = [None] * minis
  if budget:
    plans = [budget_plan(ctx, node, lay, masks if minis == 1 else take(masks, i), metrics,
                         budget, prefix, gs) for i in range(minis)]
  elif ctx.cfg.model.pack_sequences:
    plans = [pack_plan(ctx, node, lay, masks if minis == 1 else take(masks, i), metrics,
                       micro, gs, gs) for i in range(minis)]
  params, opt_state = state.params, state.opt_state
  for epoch in range(section.ppo_epochs):
    for i in range(minis):
      mb = data if minis == 1 else take(data, i)
      if plans[i] is not None:
        mb = {**mb, "pack": plans[i]}
      rng = dropout_rng(ctx, node, role, lay, epoch * minis + i)
      params, opt_state, stats = step(params, opt_state, mb, rng)
      result = steps_lib.finalize_stats(jax.device_get(stats), node.id)
      for k, v in result.items():
        metrics.add(f"{prefix}/{k}", v)
  return NodeOut(batch, metrics, {role: TrainedState(params, opt_state)})


def off_policy_metrics(ctx: RunContext, lay: dlayout.Layout, batch: Batch,
                       loss_cfg: steps_lib.ActorLoss, metrics: Metrics) -> None:
  """Where the trainer recomputed the old log-probs, records in ``metrics``
  ``off_policy/logprob_gap`` (mean
  |logp_old - logp_mu| over response tokens, the rollout-training mismatch); with a
  correction also ``off_policy/is_weight_mean`` / ``_max`` (of r = pi_old / mu) and
  ``off_policy/clipped_frac`` (tokens with r > actor.off_policy.tis_cap),
  ``off_policy/dropped_frac`` (tokens the correction gives weight 0: rejected, or above
  decoupled PPO's cap) and ``off_policy/logprob_gap_max``, see algos/off_policy.py.  One
  small reduction per step: the weights do not change with the parameters, so every epoch
  and mini-batch shares them."""
  d = batch.data
  if OLD_LOGPROBS not in d or ROLLOUT_LOGPROBS not in d or on_policy(ctx):
    return  # the old log-probs are the rollout's own: nothing to compare
  fn = off_policy_stats(ctx, lay, loss_cfg)
  # bool, as the program plan --lower lowers; episodes: their generated tokens only
  mask = d[RESPONSE_MASK] if LOSS_MASK not in d else d[RESPONSE_MASK] & d[LOSS_MASK]
  s = jax.device_get(fn(d[OLD_LOGPROBS], d[ROLLOUT_LOGPROBS], mask))
  tokens = float(s["tokens"])
  if tokens <= 0:
    return
  metrics.add("off_policy/logprob_gap", float(s["gap_sum"]), tokens)
  metrics.set_max("off_policy/logprob_gap_max", float(s["gap_max"]))
  if loss_cfg.correction is off_policy.OffPolicyCorrection.NONE:
    return
  metrics.add("off_policy/is_weight_mean", float(s["ratio_sum"]), tokens)
  metrics.set_max("off_policy/is_weight_max", float(s["ratio_max"]))
  metrics.add("off_policy/clipped_frac", float(s["above_cap"]), tokens)
  metrics.add("off_policy/dropped_frac", float(s["dropped"]), tokens)


def off_policy_stats(ctx: RunContext, lay: dlayout.Layout, loss_cfg: steps_lib.ActorLoss):
  """The jitted ``off_policy.weight_stats`` over a step's batch on ``lay`` (replicated out)."""
  kw = dict(cap=loss_cfg.tis_cap, correction=loss_cfg.off_policy,
            reject_low=loss_cfg.reject_low, reject_high=loss_cfg.reject_high)
  return ctx.jitted(("off_policy_stats", lay, tuple(sorted(kw.items()))), lambda: jax.jit(
      functools.partial(off_policy.weight_stats, **kw),
      out_shardings=NamedSharding(lay.mesh, PartitionSpec())))


def _drops(ctx: RunContext, role: Role) -> bool:
  """Whether ``role``'s train steps take an adapter-dropout key (``model.lora.dropout`` > 0,
  the actor only: a critic has no adapters)."""
  lo = ctx.cfg.model.lora
  return role is Role.ACTOR and lo.enabled and lo.dropout > 0


def dropout_rng(ctx: RunContext, node: Node, role: Role, lay: dlayout.Layout, call: int
                ) -> jax.Array | None:
  """The raw key data of a train step call's LoRA adapter dropout, replicated on the
  layout's mesh; None without dropout.  From (seed, step, node) and the call's index among
  the node's epochs x mini-batches, so a resumed run draws the same masks, and the same on
  every process."""
  if not _drops(ctx, role):
    return None
  return steps_lib.replicated_key(jax.random.fold_in(ctx.step_rng(node), call), lay.mesh)


def dropout_rng_spec(ctx: RunContext, role: Role, lay: dlayout.Layout
                     ) -> jax.ShapeDtypeStruct | None:
  """``dropout_rng``'s shape, dtype and sharding (None without dropout): the abstract
  argument ``plan --lower`` lowers the step with."""
  if not _drops(ctx, role):
    return None
  data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
  return jax.ShapeDtypeStruct(data.shape, data.dtype,
                              sharding=NamedSharding(lay.mesh, PartitionSpec()))


def _actor_loss(g, p, mb, cfg):
  return steps_lib.actor_loss(g, p, mb, cfg, 512)


def _critic_loss(g, p, mb, value_clip):
  return steps_lib.critic_loss(g, p, mb, value_clip)


NODES: NodeTable = {
    "train.actor": functools.partial(_train, Role.ACTOR),
    "train.critic": functools.partial(_train, Role.CRITIC),
}
