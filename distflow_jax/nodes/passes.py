"""Sequence-pass nodes: one forward pass of a model over prompt + response.

``logprob`` (the actor's log-probs before the update, i.e. the old policy), ``ref_logprob``
(the frozen reference's) and ``values`` (the critic's per-token values).  ``pass_fn`` and
``prompt_group`` are shared with the reward model and the train steps; so are ``pack_plan``
(``model.pack_sequences``: padding-free passes, train/packing.py) and ``budget_plan`` (the
train steps' token-budget micro-batches, train/token_budget.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from distflow_jax.algos.off_policy import OffPolicyCorrection
from distflow_jax.config.response import pass_temperature
from distflow_jax.dag import FUNCTIONS
from distflow_jax.dag.spec import Node, Role
from distflow_jax.data import layout as dlayout
from distflow_jax.data.batch import Batch
from distflow_jax.data.fields import (OLD_LOGPROBS, PROMPT_MASK, REF_LOGPROBS, RESPONSE_MASK,
                                      ROLLOUT_LOGPROBS, SUM_PI_SQUARED, VALUES)
from distflow_jax.models import lora
from distflow_jax.nodes.common import NodeOut, NodeTable, seq
from distflow_jax.state.context import RunContext, shared_prompt_group
from distflow_jax.state.metrics import Metrics
from distflow_jax.state.roles import ModelState
from distflow_jax.train import (deterministic, hidden, packing, placement, steps as steps_lib,
                                token_budget)


def train_temperature(ctx: RunContext) -> float:
  """The temperature every training pass reads the policy at: the rollout's (1 for greedy;
  config/temperature.py)."""
  temps = [ctx.section(s.node, "rollout").temperature for s in ctx.plan.steps
           if FUNCTIONS.spec(s.node.fn).section == "rollout"]
  return pass_temperature(temps[0] if temps else ctx.cfg.rollout.temperature)


def on_policy(ctx: RunContext) -> bool:
  """One epoch over one mini-batch: the policy is still the one that sampled, so the
  rollout's own log-probs (untruncated, at the temperature the passes read) are the old
  log-probs -- unless an off-policy correction weighs the trainer's log-probs against them."""
  actor = ctx.cfg.actor
  return (actor.ppo_epochs == 1 and actor.mini_batches == 1 and not actor.recompute_old_logprobs
          and not corrects_off_policy(ctx))


def corrects_off_policy(ctx: RunContext) -> bool:
  """Whether any ``train.actor`` node's actor.off_policy.correction is other than none."""
  return any(ctx.section(s.node, "actor").off_policy.correction != OffPolicyCorrection.NONE.value
             for s in ctx.plan.steps if s.node.fn == "train.actor")


def prompt_group(ctx: RunContext, node: Node, data: dict, num_parts: int,
                 metrics: Metrics) -> int:
  """Rows per shared prompt for this pass: rollout.n when sharing is on, `num_parts` parts of
  the batch hold whole groups and the rows are so grouped (checked on device), else 1;
  recorded in `metrics` as `prompt_group/<node>`."""
  gs = shared_prompt_group(ctx.cfg, data[RESPONSE_MASK].shape[0], num_parts)
  if gs > 1:
    check = grouped_check(ctx, gs)
    if not bool(check(data)):
      gs = 1
  metrics.add(f"prompt_group/{node.id}", float(gs))
  return gs


def grouped_check(ctx: RunContext, gs: int) -> Callable:
  """The jitted on-device check that a batch's rows come in groups of ``gs``."""
  return ctx.jitted(("grouped", gs), lambda: jax.jit(
      functools.partial(hidden.prompts_grouped, group_size=gs)))


def pack_plan(ctx: RunContext, node: Node, lay: dlayout.Layout, data: dict, metrics: Metrics,
              num_parts: int | None = None, block: int = 1, group_size: int = 1):
  """The packing plan of `data`'s rows under model.pack_sequences (None when off), put on
  `lay`'s mesh (replicated); records in `metrics` `pad_fraction/<node>` (padding slots of the packed
  rows) and `pad_fraction_padded/<node>` (of the padded rows the pass would run otherwise).
  `num_parts`: one plan per micro-batch of `train.micro_batches.deal_rows(data, num_parts,
  block)`, stacked on a leading axis (the train step's); None: one plan (a pass's).
  `group_size` (`prompt_group`'s, rows checked grouped): each group's prompt laid once in
  its row."""
  m = ctx.cfg.model
  if not m.pack_sequences:
    return None
  pm = packing.host_array(data[PROMPT_MASK])
  rm = packing.host_array(data[RESPONSE_MASK])
  shards = lay.num_shards
  if num_parts is None:
    plan, stats = packing.plan(pm, rm, m.pack_len, shards if pm.shape[0] % shards == 0 else 1,
                               group_size)
  else:
    plan, stats = packing.plan_parts(pm, rm, m.pack_len, num_parts, block, shards, group_size)
  return _placed(node, lay, plan, stats, metrics)


def budget_plan(ctx: RunContext, node: Node, lay: dlayout.Layout, data: dict, metrics: Metrics,
                budget: int, prefix: str, group_size: int = 1):
  """`pack_plan` for a train step with token-budget micro-batches (`<prefix>.micro_batch_tokens`
  = `budget`, train/token_budget.py); also records `<prefix>/micro_batches` (M) and
  `<prefix>/micro_batch_fill_max` / `_min` (the fullest and emptiest micro-batch on any
  shard, real tokens as a fraction of the budget; the max exceeds 1 only for a sample
  longer than the budget, alone in its micro-batch)."""
  pm = packing.host_array(data[PROMPT_MASK])
  rm = packing.host_array(data[RESPONSE_MASK])
  plan, stats, tokens_DxM = token_budget.plan(pm, rm, budget, ctx.cfg.model.pack_len,
                                              lay.num_shards, group_size)
  metrics.add(f"{prefix}/micro_batches", float(tokens_DxM.shape[1]))
  metrics.add(f"{prefix}/micro_batch_fill_max", float(tokens_DxM.max()) / budget)
  metrics.add(f"{prefix}/micro_batch_fill_min", float(tokens_DxM.min()) / budget)
  return _placed(node, lay, plan, stats, metrics)


def _placed(node: Node, lay: dlayout.Layout, plan, stats: packing.PackStats, metrics: Metrics):
  """Records `pad_fraction/<node>` and `pad_fraction_padded/<node>`; `plan` on `lay`'s mesh,
  replicated."""
  metrics.add(f"pad_fraction/{node.id}", stats.pad_fraction)
  metrics.add(f"pad_fraction_padded/{node.id}", stats.padded_pad_fraction)
  return jax.device_put(plan, NamedSharding(lay.mesh, PartitionSpec()))


def pass_fn(ctx: RunContext, lay: dlayout.Layout, fn: Callable, unit_rows: int,
            params=None) -> Callable:
  """A sequence pass, jitted onto the layout (its activations' rows split over the
  parameters' data and fsdp axes); in deterministic mode unit by unit."""
  if ctx.cfg.trainer.deterministic:
    return deterministic.per_unit(fn, lay.mesh, unit_rows, lay.axes)
  mesh = None if params is None else placement.params_mesh(params)
  return jax.jit(placement.rows_sharded_on(fn, mesh), static_argnums=0,
                 out_shardings=lay.sharding)


def adapters_off(ctx: RunContext, role: Role) -> bool:
  """Whether ``role``'s pass runs the actor's base, adapters off: the REFERENCE of a LoRA
  run, which has no weights of its own (state/roles.build_roles)."""
  return role is Role.REFERENCE and Role.REFERENCE not in ctx.roles


def pass_state(ctx: RunContext, role: Role) -> ModelState:
  """The model state ``role``'s pass reads (a LoRA run's REFERENCE: the actor's)."""
  return ctx.roles[Role.ACTOR if adapters_off(ctx, role) else role]


def logprob_pass(ctx: RunContext, role: Role, lay: dlayout.Layout, gs: int,
                 stats: bool = False) -> Callable:
  """The jitted log-prob pass of ``role``'s model (``logprob`` / ``ref_logprob``); with
  ``stats`` (``logprob.stats``) ``[B, N, 2]``: the log-probs and sum pi^2 per token."""
  off = adapters_off(ctx, role)
  t = train_temperature(ctx)

  def response_logprobs(g, p, b):
    p = lora.base_only(p) if off else p
    if stats:
      return steps_lib.response_logprob_stats(g, p, b, group_size=gs, temperature=t)
    return steps_lib.response_logprobs(g, p, b, group_size=gs, temperature=t)[0]
  return ctx.jitted(("logprobs", role, lay, gs, t, stats), lambda: pass_fn(
      ctx, lay, response_logprobs, ctx.cfg.actor.micro_batch_size,
      pass_state(ctx, role).params))


def values_pass(ctx: RunContext, lay: dlayout.Layout) -> Callable:
  """The jitted critic pass (``values``)."""
  return ctx.jitted(("values", lay), lambda: pass_fn(
      ctx, lay, steps_lib.response_values, ctx.cfg.critic.micro_batch_size,
      ctx.roles[Role.CRITIC].params))


def _model_pass(field: str, role: Role, ctx: RunContext, node: Node, lay: dlayout.Layout,
                batch: Batch) -> NodeOut:
  metrics = Metrics()
  if field == OLD_LOGPROBS and on_policy(ctx):
    metrics.add("old_logprob_from_rollout", 1.0)
    return NodeOut(batch.replace(**{OLD_LOGPROBS: batch.data[ROLLOUT_LOGPROBS]}), metrics)
  state = pass_state(ctx, role)
  data = seq(batch)
  if role is Role.CRITIC:
    fn = values_pass(ctx, lay)
    plan = pack_plan(ctx, node, lay, data, metrics)
    out = fn(state.graphdef, state.params, data if plan is None else {**data, "pack": plan})
  else:
    out = _logprobs(ctx, node, lay, data, role, metrics)
  return NodeOut(batch.replace(**{field: out}), metrics)


def _logprobs(ctx: RunContext, node: Node, lay: dlayout.Layout, data, role: Role,
              metrics: Metrics, stats: bool = False):
  """``role``'s log-prob pass over ``data`` (prompts shared, rows packed as configured)."""
  state = pass_state(ctx, role)
  gs = prompt_group(ctx, node, data, pass_parts(ctx, lay, data[RESPONSE_MASK].shape[0]),
                    metrics)
  plan = pack_plan(ctx, node, lay, data, metrics, group_size=gs)
  return logprob_pass(ctx, role, lay, gs, stats)(
      state.graphdef, state.params, data if plan is None else {**data, "pack": plan})


def logprob_stats_node(ctx: RunContext, node: Node, lay: dlayout.Layout,
                       batch: Batch) -> NodeOut:
  """``logprob`` that always runs its pass and also records each response token's
  position's sum pi^2 (``sum_pi_squared``, the optimal token baseline's input)."""
  metrics = Metrics()
  out = _logprobs(ctx, node, lay, seq(batch), Role.ACTOR, metrics, stats=True)
  return NodeOut(batch.replace(**{OLD_LOGPROBS: out[..., 0], SUM_PI_SQUARED: out[..., 1]}),
                 metrics)


def pass_parts(ctx: RunContext, lay: dlayout.Layout, rows: int) -> int:
  """The pieces that must each hold whole prompt groups for a pass to share prompts: the
  layout's shards, or (deterministic mode) its units of actor.micro_batch_size rows."""
  if ctx.cfg.trainer.deterministic:
    return rows // ctx.cfg.actor.micro_batch_size
  return lay.num_shards


NODES: NodeTable = {
    "logprob": functools.partial(_model_pass, OLD_LOGPROBS, Role.ACTOR),
    "logprob.stats": logprob_stats_node,
    "ref_logprob": functools.partial(_model_pass, REF_LOGPROBS, Role.REFERENCE),
    "values": functools.partial(_model_pass, VALUES, Role.CRITIC),
}
