"""The programs a run of a config compiles, as jitted functions with abstract arguments.

``programs(cfg, plan, ctx)`` walks the plan as the executor does and asks the same
builders the nodes call (nodes/passes.py, pass_plan.py, training.py, the rollout backend,
data/redistribute.py, persist/checksums.py, train/steps.py for the warm start) for each
program, at every prompt width a step can have (nodes/rollout.prompt_widths).  Shapes
that follow the samples' lengths (packed rows, token-budget micro-batches) take the
largest the config allows: every sample as long as its columns.

Not built here: a ``reward.model`` node's scorer (its shape is another folder's), the
advantage nodes' host-side ``jnp`` arithmetic (single operations, no model) and the tiny
vision-language model's warm start.  ``Catalogue.notes`` says so for the config.
"""

from __future__ import annotations

import dataclasses

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from distflow_jax.algos import advantages as adv
from distflow_jax.algos.off_policy import OffPolicyCorrection
from distflow_jax.dag.planner import LayoutKind, Move, Plan
from distflow_jax.dag.registry import FUNCTIONS
from distflow_jax.dag.spec import Role
from distflow_jax.data import plan as data_plan, redistribute as rd
from distflow_jax.data.fields import (ADVANTAGES, EPISODE, GROUP_ID, IMAGES, LOSS_MASK,
                                      OLD_LOGPROBS, PROMPT_MASK, REF_LOGPROBS, RESPONSE_MASK,
                                      RETURNS, ROLLOUT_LOGPROBS, SAMPLE_ID, SEQ, VALUES)
from distflow_jax.lowering import abstract as ab
from distflow_jax.lowering.program import Catalogue, Program
from distflow_jax.lowering.rollout_programs import rollout_programs, vision_programs
from distflow_jax.memory import compiled as cp
from distflow_jax.models import lora, sharding as msharding
from distflow_jax.models.heads import Critic
from distflow_jax.models.transformer import Transformer
from distflow_jax.nodes import pass_plan, passes, rollout as rollout_node, training
from distflow_jax.persist import checkpoint_contents, checksums
from distflow_jax.run import executor
from distflow_jax.state.context import RunContext, shared_prompt_group
from distflow_jax.train import packing, token_budget
from distflow_jax.warmstart import sft, text, vl as vl_warmstart


def _widths(cfg: ml_collections.ConfigDict) -> tuple[int, ...]:
  return rollout_node.prompt_widths(cfg.rollout.prefill_buckets, cfg.data.max_prompt_len)




def _seq(dims: ab.Dims, lay) -> dict:
  """What ``nodes.common.seq`` hands a pass: the token fields, and the image fields of a
  vision-language run."""
  names = SEQ + (IMAGES if dims.image_tokens else ())
  return ab.batch_fields(names, dims, lay.sharding)


def _dims(ctx: RunContext, rows: int, width: int) -> ab.Dims:
  """A batch's sizes at a prompt width (image tokens and width with a vision tower)."""
  i = d = 0
  if ctx.vision is not None:
    i, d, _ = ab.image_dims(ctx.cfg, ctx.vision.cfg)
  return ab.Dims(rows, width, ctx.cfg.rollout.response_width, i, d)


PASSES = ("logprob", "logprob.stats", "ref_logprob", "values")  # what pass_programs lowers


def pass_programs(ctx: RunContext, node, lay, rows: int,
                  widths: tuple[int, ...] | None = None) -> list[Program]:
  """``logprob`` / ``ref_logprob`` / ``values`` at every prompt width (or at ``widths``)."""
  cfg = ctx.cfg
  if node.fn == "logprob" and pass_plan.on_policy(ctx):
    return []
  role = {"ref_logprob": Role.REFERENCE, "values": Role.CRITIC}.get(node.fn, Role.ACTOR)
  state = passes.pass_state(ctx, role)  # a LoRA run's reference: the actor's, adapters off
  out = []
  for w in widths or _widths(cfg):
    data = _seq(_dims(ctx, rows, w), lay)
    if role is Role.CRITIC:
      gs, fn = 1, passes.values_pass(ctx, lay)
    else:
      gs = shared_prompt_group(cfg, rows, pass_plan.pass_parts(ctx, lay, rows))
      fn = passes.logprob_pass(ctx, role, lay, gs, stats=node.fn == "logprob.stats")
      if gs > 1:
        out.append(Program(node.id, f"prompts_grouped[w={w}]", pass_plan.grouped_check(ctx, gs),
                           (data,)))
    if cfg.model.pack_sequences:
      pm, rm = ab.full_masks(rows, w, cfg.rollout.response_width)
      shards = lay.num_shards if rows % lay.num_shards == 0 else 1
      plan, _ = packing.plan(pm, rm, cfg.model.pack_len, shards, gs)
      data = {**data, "pack": ab.replicated(plan, lay.mesh)}
    out.append(Program(node.id, f"{node.fn}_pass[w={w}]", fn,
                       (state.graphdef, state.params, data)))
  return out


def train_programs(ctx: RunContext, node, lay, rows: int,
                   widths: tuple[int, ...] | None = None) -> list[Program]:
  """``train.actor`` / ``train.critic``: the train step (and the mini-batch split) at every
  prompt width (or at ``widths``)."""
  cfg = ctx.cfg
  role = Role.ACTOR if node.fn == "train.actor" else Role.CRITIC
  state = ctx.roles[role]
  section = ctx.section(node, role.value.lower())
  shape = training.step_shape(ctx, role, section, lay, rows)
  gs = shared_prompt_group(cfg, rows, shape.parts) if role is Role.ACTOR else 1
  loss_fn, agg = training.loss_for(ctx, role, section, gs)
  step = training.train_step(ctx, role, section, lay, shape, loss_fn, agg, gs)
  extra = (VALUES, RETURNS)
  if role is Role.ACTOR:
    lc = loss_fn.keywords["cfg"]
    extra = (ADVANTAGES, OLD_LOGPROBS) + ((REF_LOGPROBS,) if lc.kl_in_loss and
                                               lc.kl_coef else ())
    if lc.correction is not OffPolicyCorrection.NONE:  # the loss reads mu too
      extra += (ROLLOUT_LOGPROBS,)
    if cfg.rollout.env:  # episodes: observation tokens are not trained on
      extra += (LOSS_MASK,)
  mb_rows = rows // shape.minis
  out = []
  if role is Role.ACTOR and not pass_plan.on_policy(ctx) and {
      OLD_LOGPROBS, ROLLOUT_LOGPROBS} <= _made_before(ctx.plan, node):
    # The step's log-prob gap and importance weights (nodes/training.off_policy_metrics).
    fields = ab.batch_fields((OLD_LOGPROBS, ROLLOUT_LOGPROBS, RESPONSE_MASK),
                             _dims(ctx, rows, _widths(cfg)[0]), lay.sharding)
    out.append(Program(node.id, "off_policy_stats",
                       training.off_policy_stats(ctx, lay, lc), tuple(fields.values())))
  for w in widths or _widths(cfg):
    n = cfg.rollout.response_width
    dims = _dims(ctx, rows, w)
    data = {**_seq(dims, lay), **ab.batch_fields(extra, dims, lay.sharding)}
    if shape.det:  # the rows in sample-id order first (nodes/training.row_order)
      ids = jax.ShapeDtypeStruct((rows,), np.int32)
      out.append(Program(node.id, f"canonical_rows[w={w}]", training.row_order(ctx, lay),
                         (data, ids)))
    if shape.minis > 1:
      take = training.minibatch_take(ctx, shape.minis, gs, lay)
      out.append(Program(node.id, f"minibatch[w={w}]", take, (data, 0)))
    mb = {k: jax.ShapeDtypeStruct((mb_rows,) + v.shape[1:], v.dtype, sharding=v.sharding)
          for k, v in data.items()}
    pm, rm = ab.full_masks(mb_rows, w, n)
    shards = lay.num_shards
    if shape.budget:
      plan, _, _ = token_budget.plan(pm, rm, shape.budget, cfg.model.pack_len, shards, gs)
      mb["pack"] = ab.replicated(plan, lay.mesh)
    elif cfg.model.pack_sequences:
      plan, _ = packing.plan_parts(pm, rm, cfg.model.pack_len, shape.micro, gs, shards, gs)
      mb["pack"] = ab.replicated(plan, lay.mesh)
    out.append(Program(node.id, f"train_step[w={w}]", step.jitted_for(state.params,
                                                                     state.opt_state),
                       (state.params, state.opt_state, mb,
                        training.dropout_rng_spec(ctx, role, lay))))
  return out


def _made_before(plan: Plan, node) -> set[str]:
  """The batch fields the chain's nodes before ``node`` produce."""
  made: set[str] = set()
  for step in plan.steps:
    if step.node.id == node.id:
      break
    made |= FUNCTIONS.spec(step.node.fn).produces
  return made


def move_programs(ctx: RunContext, step, src, lay, fields: list[str], rows: int
                  ) -> list[Program]:
  """A REPARTITION into ``lay``: the token-length sum and the all-to-all of the batch's
  fields at that point (every prompt width)."""
  cfg = ctx.cfg
  group = executor.move_group(ctx, step.layout.kind is LayoutKind.ROLLOUT, rows, lay)
  lengths = np.full((rows,), 1, np.int64)
  try:
    plan = data_plan.make_repartition_plan(lengths, src, lay, group_size=group)
  except ValueError:
    plan = data_plan.make_repartition_plan(lengths, src, lay)
  out = lengths_programs(ctx, step.node.id, src, fields, rows)
  for w in _widths(cfg):
    tree = ab.batch_fields(fields, _dims(ctx, rows, w), src.sharding)
    fn, args = rd.abstract_call(tree, plan, cfg.data.redistribute)
    out.append(Program(step.node.id, f"move[w={w}]", fn, args))
  return out


def checksum_programs(ctx: RunContext) -> list[Program]:
  """A save's checksums (checkpoint_contents.save_sums): one program per mesh over the
  trained state, the reference model's parameters and a LoRA actor's frozen base."""
  trees = checkpoint_contents.save_trees(ctx.roles)
  arrays = {n: x for n, x in checksums.flatten(trees).items()
            if isinstance(getattr(x, "sharding", None), NamedSharding)}
  what = "".join(f"{k.replace('_', ' ')}," for k in trees if k != checkpoint_contents.STATE)
  return [Program("save", f"checksum[{what}arrays={len(names)},"
                          f"mesh={dict(xs[0].sharding.mesh.shape)}]", fn, xs)
          for names, fn, xs in checksums.mesh_programs(arrays)]


def warmstart_programs(ctx: RunContext) -> list[Program]:
  """The built-in model's supervised warm start (warmstart/text.run), when the config
  has one: its train step on the actor's mesh, on the whole base (a LoRA run warm-starts
  its base before the adapters go on: warmstart/text.ensure_model)."""
  cfg = ctx.cfg
  ws = cfg.model.warmstart
  if cfg.model.path or ws.steps <= 0:
    return []

  state = ctx.roles[Role.ACTOR]
  if lora.has_adapters(state.params):
    base_cfg = ctx.model_cfg.replace(lora=None)
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(base_cfg, rngs=nnx.Rngs(0))))[0]
    state = dataclasses.replace(state, graphdef=graphdef,
                                params=lora.split_trainable(state.params)[1])
  tx = text.optimizer(ws.lr, ws.steps)
  opt = cp.abstract_opt_state(tx, state.params, state.mesh)
  sharding, _ = sft.data_parallel(state.mesh)
  dims = ab.Dims(ws.batch_size, cfg.data.max_prompt_len, cfg.rollout.max_new_tokens)
  batch = ab.batch_fields(SEQ, dims, sharding)
  step = sft.make_step(state.graphdef, tx)
  return [Program("warm start", "sft_step", step.jitted_for(state.params, opt),
                  (state.params, opt, batch))]


def advantage_programs(ctx: RunContext, node, rows: int) -> list[Program]:
  """The jitted scans of the per-token estimators (GAE, REINFORCE++), over this host's
  rows on its default device (nodes/advantages.py; the rest of an advantage node is
  single host-side operations)."""
  algo = ctx.section(node, "algo")
  local = rows // ctx.topo.num_processes
  x = np.zeros((local, ctx.cfg.rollout.response_width), np.float32)
  if node.fn == "advantage.gae":
    return [Program(node.id, f"gae_scan[rows={local}]", adv._gae_scan, (x, x, x),
                    dict(gamma=algo.gamma, lam=algo.lam))]
  if node.fn == "advantage.reinforce_pp":
    return [Program(node.id, f"discounted_returns[rows={local}]", adv.discounted_returns,
                    (x, x), dict(gamma=algo.gamma))]
  return []


def init_programs(ctx: RunContext) -> list[Program]:
  """Fresh initialisers: the built-in model's (no model.path: the warm start starts from
  it) and the critic's (its value head is always fresh)."""

  cfg, out = ctx.cfg, []
  rules = msharding.fsdp_tp_rules()
  if not cfg.model.path:
    mesh = ctx.roles[Role.ACTOR].mesh
    _, init = msharding.init_program(lambda: Transformer(ctx.model_cfg, rngs=nnx.Rngs(0)),
                                     mesh, rules)
    out.append(Program("setup", "init_params[actor]", init, ()))
  if ctx.model_cfg.lora is not None:  # the fresh adapters, one program (models/lora.attach)
    _, init = lora.adapter_init(ctx.model_cfg, ctx.roles[Role.ACTOR].mesh, rules)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    out.append(Program("setup", "init_adapters[actor]", init, (key,)))
  if Role.CRITIC in ctx.roles:
    mesh = ctx.roles[Role.CRITIC].mesh
    _, init = msharding.init_program(lambda: Critic(ctx.model_cfg, rngs=nnx.Rngs(0)), mesh,
                                     rules)
    out.append(Program("setup", "init_params[critic]", init, ()))
  return out


def lengths_programs(ctx: RunContext, node_id: str, lay, fields, rows: int) -> list[Program]:
  """The executor's token-length sum of the batch at ``lay`` (before a re-partition and at
  the end of every step), at every prompt width."""
  fn = executor.lengths_fn(ctx)
  out = []
  for w in _widths(ctx.cfg):
    tree = ab.batch_fields((PROMPT_MASK, RESPONSE_MASK), _dims(ctx, rows, w),
                           lay.sharding)
    out.append(Program(node_id, f"token_lengths[w={w}]", fn, (tree,)))
  return out


def programs(cfg: ml_collections.ConfigDict, plan: Plan, ctx: RunContext) -> Catalogue:
  """Every program of a run of ``cfg`` (see the module docstring), in run order."""
  rows = cfg.data.prompts_per_step * cfg.rollout.n
  out: list[Program] = init_programs(ctx) + warmstart_programs(ctx)
  notes: list[str] = []
  fields: list[str] = [SAMPLE_ID, GROUP_ID]
  current = None
  for step in plan.steps:
    node = step.node
    lay = ctx.layout(step.layout)
    if current is not None and step.move_in is Move.REPARTITION:
      out += move_programs(ctx, step, current, lay, fields, rows)
    if node.fn == "generate":
      if ctx.vision is not None:
        out += vision_programs(ctx, node.id)
        fields += [f for f in IMAGES if f not in fields]
      if cfg.rollout.env:  # multi-turn episodes: their masks and rewards
        fields += [f for f in EPISODE if f not in fields]
      out += rollout_programs(ctx, node, step.layout.devices)
      if cfg.trainer.eval_every and cfg.data.eval:
        out += rollout_programs(ctx, node, step.layout.devices, greedy=True)
    elif node.fn == "generate.greedy" and not (cfg.trainer.eval_every and cfg.data.eval):
      out += rollout_programs(ctx, node, step.layout.devices, greedy=True)  # else eval's
    elif node.fn in PASSES:
      out += pass_programs(ctx, node, lay, rows)
    elif node.fn.startswith("train."):
      out += train_programs(ctx, node, lay, rows)
    elif node.fn.startswith("advantage."):
      out += advantage_programs(ctx, node, rows)
    elif node.fn == "reward.model":
      notes.append(f"node {node.id!r}: the reward model's scorer is not lowered (its shape "
                   f"is reward.model_path's)")
    for name in FUNCTIONS.spec(node.fn).produces:
      for f in ab.PRODUCED.get(name, (name,)):
        if f in ab.FIELDS and f not in fields:
          fields.append(f)
    current = lay
  if current is not None:
    out += lengths_programs(ctx, "step end", current, fields, rows)
  out += checksum_programs(ctx)
  if cfg.model.path == vl_warmstart.BUILTIN:
    notes.append("the built-in tiny VL model's warm start (warmstart/vl.py) is not "
                 "lowered: it runs once on a CPU-sized model and is cached")
  return Catalogue(out, notes)


def late_programs(ctx: RunContext, width: int) -> list[Program]:
  """The sequence passes and train steps of the nodes after the rollout stage, at prompt
  ``width``: what a first step compiles once its rollout is done, built without the
  rollout's output (run/compile_overlap.py compiles them during the rollout).  Only those
  nodes' programs are built, on the layouts this process runs them on: no rollout replica
  (a multi-process run's replicas live on other processes' devices), no initialisation."""
  rows = ctx.cfg.data.prompts_per_step * ctx.cfg.rollout.n
  out: list[Program] = []
  after_rollout = False
  for step in ctx.plan.steps:
    if step.layout.kind is LayoutKind.ROLLOUT:
      after_rollout = True
      continue
    if not after_rollout:
      continue
    node = step.node
    if node.fn in PASSES:
      out += pass_programs(ctx, node, ctx.layout(step.layout), rows, (width,))
    elif node.fn.startswith("train."):
      out += train_programs(ctx, node, ctx.layout(step.layout), rows, (width,))
  return out
