"""What a node decides before a compiled pass over its rows, shared by the pass nodes
(nodes/passes.py), the train steps (nodes/training.py) and the reward model
(nodes/rewards.py): the policy the passes read (``train_temperature``, ``on_policy``), how
rows share a prompt (``prompt_group``, ``pass_parts``), the packing plan
(``model.pack_sequences``: padding-free passes, train/packing.py) and the token-budget plan
(train/token_budget.py), and the pass function jitted onto a layout (``pass_fn``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from distflow_jax.algos.off_policy import OffPolicyCorrection
from distflow_jax.config.response import pass_temperature
from distflow_jax.dag import FUNCTIONS
from distflow_jax.dag.spec import Node
from distflow_jax.data import layout as dlayout
from distflow_jax.data.fields import PROMPT_MASK, RESPONSE_MASK
from distflow_jax.state.context import RunContext, shared_prompt_group
from distflow_jax.state.metrics import Metrics
from distflow_jax.train import deterministic, hidden, packing, placement, token_budget


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
  return placed_plan(node, lay, plan, stats, metrics)


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
  return placed_plan(node, lay, plan, stats, metrics)


def placed_plan(node: Node, lay: dlayout.Layout, plan, stats: packing.PackStats, metrics: Metrics):
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


def pass_parts(ctx: RunContext, lay: dlayout.Layout, rows: int) -> int:
  """The pieces that must each hold whole prompt groups for a pass to share prompts: the
  layout's shards, or (deterministic mode) its units of actor.micro_batch_size rows."""
  if ctx.cfg.trainer.deterministic:
    return rows // ctx.cfg.actor.micro_batch_size
  return lay.num_shards
