"""The programs a run of a config compiles, as jitted functions with abstract arguments.

``programs(cfg, plan, ctx)`` walks the plan as the executor does and asks the same
builders the nodes call (nodes/passes.py, nodes/training.py, the rollout backend,
data/redistribute.py, workflow/checksums.py, train/steps.py for the warm start) for each
program, at every prompt width a step can have (nodes/rollout.prompt_widths).  Shapes
that follow the samples' lengths (packed rows, token-budget micro-batches) take the
largest the config allows: every sample as long as its columns.

Not built here: a ``reward.model`` node's scorer (its shape is another folder's), the
advantage nodes' host-side ``jnp`` arithmetic (single operations, no model) and the
vision tower of a vision-language run.  ``Catalogue.notes`` says so for the config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from distflow_jax.dag.planner import Move, Plan
from distflow_jax.dag.registry import FUNCTIONS
from distflow_jax.dag.spec import Role
from distflow_jax.data import plan as data_plan, redistribute as rd
from distflow_jax.lowering import abstract as ab
from distflow_jax.nodes import passes, rollout as rollout_node, training
from distflow_jax.rollout.backend import EngineBackend
from distflow_jax.rollout.reference import ReferenceSampler
from distflow_jax.train import packing, steps as steps_lib, token_budget
from distflow_jax.workflow import checksums, executor
from distflow_jax.workflow.context import RunContext, shared_prompt_group


@dataclasses.dataclass(frozen=True)
class Program:
  """One program: the plan node (or phase) it belongs to, a name with its shape, the
  jitted function and its abstract arguments."""
  node: str
  name: str
  fn: Any
  args: tuple
  kwargs: dict = dataclasses.field(default_factory=dict)  # static keyword arguments

  def trace(self) -> Any:
    return self.fn.trace(*self.args, **self.kwargs)


class _Refused:
  """A program that failed while the catalogue was built: lowering it re-raises."""

  def __init__(self, error: Exception):
    self.error = error

  def trace(self, *args):
    raise self.error


@dataclasses.dataclass
class Catalogue:
  programs: list[Program]
  notes: list[str]


def _widths(cfg: ml_collections.ConfigDict) -> tuple[int, ...]:
  return rollout_node.prompt_widths(cfg.rollout.prefill_buckets, cfg.data.max_prompt_len)


def _host0(ctx: RunContext, devices: tuple[int, ...]) -> list[jax.Device]:
  per_host = ctx.topo.devices_per_process
  ordered = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  return [ordered[i] for i in devices if i < per_host]


def rollout_programs(ctx: RunContext, node, devices, greedy: bool = False) -> list[Program]:
  """Process 0's rollout replica: its weight sync and every generate program."""
  rollout = ctx.section(node, "rollout")
  backend = ctx.backend(rollout, greedy=greedy, devices=_host0(ctx, devices))
  tag = node.id + ("/eval" if greedy else "")
  actor = ctx.roles[Role.ACTOR].params
  ordered = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  process = {d: ctx.topo.process_of(i) for i, d in enumerate(ordered)}
  out = [Program(tag, name, fn, args) for name, fn, args in
         getattr(backend, "sync_programs", lambda p, q: [])(actor, process.get)]
  if isinstance(backend, EngineBackend):
    eng = backend.engine
    sig = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                       eng._abstract_params, eng.param_shardings)
    try:
      out += [Program(tag, name, fn, args) for name, fn, args in eng.programs(sig)]
    except Exception as e:  # noqa: BLE001 - shapes come from tracing a prefill: its row says why
      out.append(Program(tag, "prefill", _Refused(e), ()))
  elif isinstance(backend, ReferenceSampler):
    out += _reference_programs(ctx, backend, tag)
  return out


def _reference_programs(ctx: RunContext, sampler: ReferenceSampler, tag: str) -> list[Program]:
  """The reference sampler's one program at its widest call: every local prompt's n rows,
  the longest prompt bucket plus the response budget."""
  cfg, conf = ctx.cfg, sampler.config
  rows = cfg.data.prompts_per_step // ctx.topo.num_processes * cfg.rollout.n
  width = -(-(max(conf.prefill_buckets) + conf.max_new_tokens) // 8) * 8
  sig = _placed_params(sampler)
  images = None
  if ctx.vision is not None:  # rollout/images.PromptImages.rows
    i, d, _ = ab.image_dims(cfg, ctx.vision.cfg)
    images = (np.zeros((rows, i, d), np.float32), np.zeros((rows, width), bool),
              np.zeros((rows, 3, width), np.int32))
  args = (sig, np.zeros((rows, width), np.int32), np.ones((rows,), np.int32),
          np.zeros((rows, 2), np.uint32), np.int32(0), images)
  return [Program(tag, f"next_token[rows={rows},len={width}]", sampler._next, args)]


def _placed_params(backend) -> Any:
  from flax import nnx
  from distflow_jax.models.transformer import Transformer
  abstract = nnx.eval_shape(lambda: Transformer(backend.model_cfg, rngs=nnx.Rngs(0)))
  _, state = nnx.split(abstract)
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      state, backend.param_shardings)


SEQ = ("prompt_tokens", "prompt_mask", "response_tokens", "response_mask")
IMAGES = ("image_embeds", "image_slots", "rope_positions")


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
  return ab.Dims(rows, width, ctx.cfg.rollout.max_new_tokens, i, d)


def pass_programs(ctx: RunContext, node, lay, rows: int) -> list[Program]:
  """``logprob`` / ``ref_logprob`` / ``values`` at every prompt width."""
  cfg = ctx.cfg
  if node.fn == "logprob" and passes.on_policy(ctx):
    return []
  role = {"logprob": Role.ACTOR, "ref_logprob": Role.REFERENCE, "values": Role.CRITIC}[node.fn]
  state = ctx.roles[role]
  out = []
  for w in _widths(cfg):
    data = _seq(_dims(ctx, rows, w), lay)
    if role is Role.CRITIC:
      gs, fn = 1, passes.values_pass(ctx, lay)
    else:
      gs = shared_prompt_group(cfg, rows, passes.pass_parts(ctx, lay, rows))
      fn = passes.logprob_pass(ctx, role, lay, gs)
      if gs > 1:
        out.append(Program(node.id, f"prompts_grouped[w={w}]", passes.grouped_check(ctx, gs),
                           (data,)))
    if cfg.model.get("pack_sequences", False):
      pm, rm = ab.full_masks(rows, w, cfg.rollout.max_new_tokens)
      shards = lay.num_shards if rows % lay.num_shards == 0 else 1
      plan, _ = packing.plan(pm, rm, cfg.model.pack_len, shards, gs)
      data = {**data, "pack": ab.replicated(plan, lay.mesh)}
    out.append(Program(node.id, f"{node.fn}_pass[w={w}]", fn,
                       (state.graphdef, state.params, data)))
  return out


def train_programs(ctx: RunContext, node, lay, rows: int) -> list[Program]:
  """``train.actor`` / ``train.critic``: the train step (and the mini-batch split) at every
  prompt width."""
  cfg = ctx.cfg
  role = Role.ACTOR if node.fn == "train.actor" else Role.CRITIC
  state = ctx.roles[role]
  section = ctx.section(node, role.value.lower())
  shape = training.step_shape(ctx, role, section, lay, rows)
  gs = shared_prompt_group(cfg, rows, shape.parts) if role is Role.ACTOR else 1
  loss_fn, agg = training.loss_for(ctx, role, section, gs)
  step = training.train_step(ctx, role, section, lay, shape, loss_fn, agg, gs)
  extra = ("values", "returns")
  if role is Role.ACTOR:
    lc = loss_fn.keywords["cfg"]
    extra = ("advantages", "old_logprobs") + (("ref_logprobs",) if lc.kl_in_loss and
                                               lc.kl_coef else ())
  mb_rows = rows // shape.minis
  out = []
  for w in _widths(cfg):
    n = cfg.rollout.max_new_tokens
    dims = _dims(ctx, rows, w)
    data = {**_seq(dims, lay), **ab.batch_fields(extra, dims, lay.sharding)}
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
    elif cfg.model.get("pack_sequences", False):
      plan, _ = packing.plan_parts(pm, rm, cfg.model.pack_len, shape.micro, gs, shards, gs)
      mb["pack"] = ab.replicated(plan, lay.mesh)
    fn = step.jitted_for(state.params, state.opt_state) if hasattr(step, "jitted_for") else step
    out.append(Program(node.id, f"train_step[w={w}]", fn, (state.params, state.opt_state, mb)))
  return out


def move_programs(ctx: RunContext, step, src, lay, fields: list[str], rows: int
                  ) -> list[Program]:
  """A REPARTITION into ``lay``: the token-length sum and the all-to-all of the batch's
  fields at that point (every prompt width)."""
  cfg = ctx.cfg
  group = (cfg.rollout.n if step.layout.kind.name == "ROLLOUT"
           else shared_prompt_group(cfg, rows, lay.num_shards))
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
  """A save's checksums: one program per distinct (mesh, spec, shape) of the trained
  roles' parameters and optimizer state."""
  out, seen = [], set()
  for role, state in ctx.roles.items():
    if not state.trainable:
      continue
    for x in jax.tree.leaves((state.params, state.opt_state)):
      if not isinstance(x.sharding, NamedSharding):
        continue
      sh = x.sharding
      key = (sh.mesh, sh.spec, x.shape, str(x.dtype))
      if key in seen:
        continue
      seen.add(key)
      out.append(Program("save", f"checksum[{role.value.lower()} {x.dtype}{list(x.shape)}]",
                         checksums._sharded(sh.mesh, sh.spec, x.shape), (x,)))
  return out


def warmstart_programs(ctx: RunContext) -> list[Program]:
  """The built-in model's supervised warm start (workflow/warmstart.run), when the config
  has one: its train step on the actor's mesh."""
  cfg = ctx.cfg
  ws = cfg.model.warmstart
  if cfg.model.path or ws.steps <= 0:
    return []
  from distflow_jax.workflow import sft
  state = ctx.roles[Role.ACTOR]
  tx = sft.optimizer(lr=ws.lr, steps=ws.steps, warmup_steps=max(ws.steps // 10, 1))
  opt = _abstract_opt(tx, state)
  sharding, _ = sft.data_parallel(state.mesh)
  dims = ab.Dims(ws.batch_size, cfg.data.max_prompt_len, cfg.rollout.max_new_tokens)
  batch = ab.batch_fields(("prompt_tokens", "prompt_mask", "response_tokens",
                           "response_mask"), dims, sharding)
  step = steps_lib.make_train_step(sft.sft_loss, state.graphdef, tx, 1, "token-mean")
  return [Program("warm start", "sft_step", step.jitted_for(state.params, opt),
                  (state.params, opt, batch))]


def vision_programs(ctx: RunContext, node_id: str) -> list[Program]:
  """The frozen vision tower's forward over one prompt's image (workflow/vision.py: once
  per prompt, on this process's default device)."""
  from distflow_jax.data.image_processor import ImageProcessor
  from distflow_jax.models.vision import vision_layout
  enc = ctx.vision
  vc = enc.cfg.vision
  _, _, grid = ab.image_dims(ctx.cfg, enc.cfg)
  proc = ImageProcessor(patch_size=vc.patch_size, merge_size=vc.spatial_merge_size,
                        temporal_patch_size=vc.temporal_patch_size)
  patches = int(np.prod(grid))
  pixels = np.zeros((patches, proc.patch_dim), np.float32)
  layout = vision_layout(vc, np.asarray(grid).reshape(1, 3))
  return [Program(node_id, f"vision_tower[patches={patches}]", enc._fwd,
                  (enc.graphdef, enc.params, pixels, layout))]


def advantage_programs(ctx: RunContext, node, rows: int) -> list[Program]:
  """The jitted scans of the per-token estimators (GAE, REINFORCE++), over this host's
  rows on its default device (nodes/advantages.py; the rest of an advantage node is
  single host-side operations)."""
  from distflow_jax.algos import advantages as adv
  algo = ctx.section(node, "algo")
  local = rows // ctx.topo.num_processes
  x = np.zeros((local, ctx.cfg.rollout.max_new_tokens), np.float32)
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
  from flax import nnx

  from distflow_jax.models import sharding as msharding
  from distflow_jax.models.heads import Critic
  from distflow_jax.models.transformer import Transformer
  cfg, out = ctx.cfg, []
  rules = msharding.fsdp_tp_rules()
  if not cfg.model.path:
    mesh = ctx.roles[Role.ACTOR].mesh
    _, init = msharding.init_program(lambda: Transformer(ctx.model_cfg, rngs=nnx.Rngs(0)),
                                     mesh, rules)
    out.append(Program("setup", "init_params[actor]", init, ()))
  if Role.CRITIC in ctx.roles:
    mesh = ctx.roles[Role.CRITIC].mesh
    _, init = msharding.init_program(lambda: Critic(ctx.model_cfg, rngs=nnx.Rngs(0)), mesh,
                                     rules)
    out.append(Program("setup", "init_params[critic]", init, ()))
  return out


def lengths_programs(ctx: RunContext, node_id: str, lay, fields, rows: int) -> list[Program]:
  """The executor's token-length sum of the batch at ``lay`` (before a re-partition and at
  the end of every step), at every prompt width."""
  fn = ctx.jitted("token_lengths", lambda: jax.jit(executor._lengths))
  out = []
  for w in _widths(ctx.cfg):
    tree = ab.batch_fields(("prompt_mask", "response_mask"), _dims(ctx, rows, w),
                           lay.sharding)
    out.append(Program(node_id, f"token_lengths[w={w}]", fn, (tree,)))
  return out


def _abstract_opt(tx, state) -> Any:
  from distflow_jax.memory import compiled as cp
  return cp.abstract_opt_state(tx, state.params, state.mesh)


def programs(cfg: ml_collections.ConfigDict, plan: Plan, ctx: RunContext) -> Catalogue:
  """Every program of a run of ``cfg`` (see the module docstring), in run order."""
  rows = cfg.data.prompts_per_step * cfg.rollout.n
  out: list[Program] = init_programs(ctx) + warmstart_programs(ctx)
  notes: list[str] = []
  fields: list[str] = ["sample_id", "group_id"]
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
      out += rollout_programs(ctx, node, step.layout.devices)
      if cfg.trainer.eval_every and cfg.data.eval:
        out += rollout_programs(ctx, node, step.layout.devices, greedy=True)
    elif node.fn in ("logprob", "ref_logprob", "values"):
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
  from distflow_jax.workflow import vl_warmstart
  if cfg.model.path == vl_warmstart.BUILTIN:
    notes.append("the built-in tiny VL model's warm start (workflow/vl_warmstart.py) is not "
                 "lowered: it runs once on a CPU-sized model and is cached")
  return Catalogue(out, notes)
