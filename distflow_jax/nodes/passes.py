"""Sequence-pass nodes: one forward pass of a model over prompt + response.

``logprob`` (the actor's log-probs before the update, i.e. the old policy),
``logprob.stats`` (the same with each token's sum of squared probabilities, for OTB),
``ref_logprob`` (the frozen reference's) and ``values`` (the critic's per-token values).
How their rows are laid out (prompt groups, packing, the jitted pass) is
nodes/pass_plan.py's, shared with the train steps and the reward model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from distflow_jax.dag.spec import Node, Role
from distflow_jax.data import layout as dlayout
from distflow_jax.data.batch import Batch
from distflow_jax.data.fields import (OLD_LOGPROBS, REF_LOGPROBS, RESPONSE_MASK, ROLLOUT_LOGPROBS,
                                      SUM_PI_SQUARED, VALUES)
from distflow_jax.models import lora
from distflow_jax.nodes.common import NodeOut, NodeTable, seq
from distflow_jax.nodes.pass_plan import (on_policy, pack_plan, pass_fn, pass_parts,
                                          prompt_group, train_temperature)
from distflow_jax.state.context import RunContext
from distflow_jax.state.metrics import Metrics
from distflow_jax.state.roles import ModelState
from distflow_jax.train import steps as steps_lib


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


NODES: NodeTable = {
    "logprob": functools.partial(_model_pass, OLD_LOGPROBS, Role.ACTOR),
    "logprob.stats": logprob_stats_node,
    "ref_logprob": functools.partial(_model_pass, REF_LOGPROBS, Role.REFERENCE),
    "values": functools.partial(_model_pass, VALUES, Role.CRITIC),
}
