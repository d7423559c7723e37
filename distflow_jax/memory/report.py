"""``distflow-jax plan --memory``: per-device memory of each role and node, and traffic.

``estimate`` sizes every consumer on every device of the plan: resident state (each
role's parameters and optimizer state) plus the largest transient of one node phase (the
rollout's weight sync: the synced weights and the sync's buffers; its decode: the synced
weights and the KV cache; a log-prob pass; the train step).  Figures come from
``compiled`` (the real steps compiled on abstract shapes, on simulated devices of the
target topology) or, with ``source="analytic"``, from ``analytic``.

This module owns that estimate (the resident items, the log-prob passes, the critic's
and the actor's train steps, what to change for each consumer), the model's shape
(``model_shape``) and ``run``; the rollout node's items are ``rollout_items``', the
consumers ``consumers``'.  The fit is against what jax can use of a device (``budget``,
from the ``budget`` module: jax's allocator fraction and a reserve); ``render`` prints
the figures, the budget and its reasoning, the fit, the three biggest consumers and what
to change (never a value that is already set) and ``check_fits`` refuses a device that
is too small in one line (both from the ``render`` module).  ``budget``, ``render`` and
``check_fits`` still import from here.
"""
from __future__ import annotations

import time

import jax
import ml_collections
from jax.sharding import NamedSharding, PartitionSpec as P

from distflow_jax.algos.off_policy import OffPolicyCorrection
from distflow_jax.config.errors import ConfigError
from distflow_jax.config.response import response_width, response_width_key
from distflow_jax.dag.planner import Plan
from distflow_jax.dag.spec import Role
from distflow_jax.data.fields import ADVANTAGES, OLD_LOGPROBS, REF_LOGPROBS, ROLLOUT_LOGPROBS
from distflow_jax.memory import analytic as an, compiled as cp, traffic
from distflow_jax.memory.budget import budget
from distflow_jax.memory.consumers import RESIDENT, Estimate, Item
from distflow_jax.memory.render import check_fits, render
from distflow_jax.memory.rollout_items import generate_items
from distflow_jax.models import sharding
from distflow_jax.models.config import ModelConfig
from distflow_jax.state import roles as roles_lib
from distflow_jax.state.context import shared_prompt_group


def _prompt_len(cfg: ml_collections.ConfigDict) -> int:
  """The widest prompt columns a step can have (nodes.rollout.prompt_width)."""
  fits = [b for b in cfg.rollout.prefill_buckets if b >= cfg.data.max_prompt_len]
  return min(fits) if fits else cfg.data.max_prompt_len


def _advice(cfg: ml_collections.ConfigDict, fsdp: int, per_host: int,
            hosts: int = 1) -> dict[str, str]:
  """What to change for each consumer; never a value that is already set (each names
  the setting's current value as "now")."""
  r, a = cfg.rollout, cfg.actor
  remat = str(cfg.model.remat)
  more = (f"shard it over more devices (fsdp={fsdp} now: more hosts with --num_processes, "
          f"or placement.actor.mesh)")
  sgd = str(a.optimizer.name) == "sgd"
  tp = int(r.tensor_parallel)
  wider = [t for t in range(tp + 1, per_host + 1) if per_host % t == 0]
  if wider:
    rollout_w = (f"raise rollout.tensor_parallel to {' or '.join(map(str, wider))} (now {tp}; "
                 f"each device holds the model / tensor_parallel)")
  else:
    span = (f"span two hosts with rollout.tensor_parallel={2 * per_host} (each decode step "
            f"then crosses the hosts' network), or " if hosts % 2 == 0 and tp == per_host
            else "")
    now = (f"rollout.tensor_parallel is already every device of a host ({per_host})"
           if tp <= per_host else f"rollout.tensor_parallel={tp} already spans "
           f"{tp // per_host} hosts (dag/replicas.py)")
    rollout_w = (f"{now}: {span}make room beside it: fewer KV "
                 f"slots (rollout.max_concurrent_decodes, now {r.max_concurrent_decodes}), or "
                 f"more hosts (--num_processes) to thin the actor's resident state")
  act = (f"lower actor.micro_batch_size (now {a.micro_batch_size})" if a.micro_batch_size > 1
         else f"shorten {response_width_key(r)} (now {response_width(r)}) or data.max_prompt_len "
              f"(now {cfg.data.max_prompt_len})")
  if remat != "full":
    act += f" or set model.remat=full (now {remat})"
  return {
      "params": more, "opt": more + ("" if sgd else " or set actor.optimizer.name=sgd"),
      "grads": more,
      "act": act,
      "ref": "place the reference on other devices (placement.reference) or set "
             "actor.kl.coef=0 and drop the ref_logprob node",
      "rollout_w": rollout_w,
      "kv": f"lower rollout.max_concurrent_decodes (now {r.max_concurrent_decodes}) or "
            f"{response_width_key(r)} (now {response_width(r)})",
      "sync": ("its largest step is the embedding or one layer: "
               + (f"raise rollout.tensor_parallel to {wider[-1]} (now {tp})" if wider else
                  "it shrinks only with the model")),
      "fallback": "keep the rollout on the actor's devices of each host (the fallback "
                  "gathers whole parameters on every training device)",
      "lora_base": "set rollout.lora_sync=merged (the base is then synced merged each "
                   "step, not kept)",
      "unstack": "set model.scan_layers=False (the rollout's per-layer copy is then the "
                 "training parameters themselves; compiles take longer)",
      "pass": f"lower data.prompts_per_step (now {cfg.data.prompts_per_step}; the pass runs "
              f"the whole step's batch at once)",
  }


def estimate(cfg: ml_collections.ConfigDict, plan: Plan, model_cfg: ModelConfig,
             source: str = "compiled", platform: str = "gpu") -> Estimate:
  """Every consumer of every device of ``plan`` (jax must see the plan's device count), on
  devices of ``platform`` (``gpu``, ``tpu`` or ``cpu``, as ``budget`` names them: what the
  rollout engine holds a 16-bit model's weights in depends on it)."""


  comp = source == "compiled"
  master = bool(cfg.model.master_weights)
  remat = str(cfg.model.remat)
  impl = str(cfg.model.attention_impl)
  src = "compiled" if comp else "analytic"
  topo = plan.topology
  meshes = {m.role: m for m in plan.meshes}
  actor = meshes[Role.ACTOR]
  fsdp, tp = actor.shape.get("fsdp", 1), actor.shape.get("tensor", 1)
  shards = fsdp * tp
  adv = _advice(cfg, fsdp, len(actor.devices) // topo.num_processes, topo.num_processes)
  items: list[Item] = []
  notes = [f"figures: {src}" + (" (memory_analysis of the real jitted steps on "
                                f"{topo.num_devices} simulated devices)" if comp else
                                " model (memory/analytic.py)")]
  if comp and impl not in ("cudnn", "blockwise"):
    notes.append(f"attention as compiled for CPU (model.attention_impl={impl}); on GPU "
                 f"'auto' takes cuDNN's fused kernel in 16 bits, which keeps no [T, T] "
                 f"scores: the activations are an upper bound there")
  trained = {s.node.role for s in plan.steps if s.node.fn.startswith("train.")}
  total = max(cfg.trainer.total_steps * cfg.actor.ppo_epochs * cfg.actor.mini_batches, 1)
  tx = roles_lib.optimizer(cfg, cfg.actor.optimizer, total)
  opt_name = str(cfg.actor.optimizer.name)
  samples = cfg.data.prompts_per_step * cfg.rollout.n
  plen, nlen = _prompt_len(cfg), response_width(cfg.rollout)
  params_by_role, passes = {}, {}

  lora_on = model_cfg.lora is not None
  critic_cfg = model_cfg.replace(lora=None)  # a LoRA actor's critic is fully trained

  def role_params(role):
    if role is Role.REFERENCE and lora_on:  # the actor's base, adapters off: no copy
      role = Role.ACTOR
    if role not in params_by_role:
      params_by_role[role] = cp.abstract_model(model_cfg, roles_lib.jax_mesh(meshes[role]))
    return params_by_role[role]

  for role in (Role.ACTOR, Role.REFERENCE):
    if role not in meshes:
      continue
    rm = meshes[role]
    n_sh = rm.shape.get("fsdp", 1) * rm.shape.get("tensor", 1)
    if role is Role.REFERENCE and lora_on:
      items.append(Item("reference", "parameters (LoRA: actor base)", 0.0,
                        rm.devices, RESIDENT, src, adv["ref"]))
      continue
    pb = cp.device_bytes(role_params(role)[1]) if comp else an.param_bytes(model_cfg, n_sh)
    items.append(Item(role.value.lower(), "parameters", pb, rm.devices, RESIDENT, src,
                      adv["params" if role is Role.ACTOR else "ref"]))
    if role is Role.ACTOR and role in trained:
      if comp:
        opt_abs = cp.abstract_opt_state(tx, role_params(role)[1], roles_lib.jax_mesh(rm))
        ob = cp.device_bytes(opt_abs)
      else:
        ob = an.opt_bytes(model_cfg, n_sh, opt_name, master)
      items.append(Item("actor", "optimizer state", ob, rm.devices, RESIDENT, src, adv["opt"]))
  if Role.CRITIC in meshes:
    cm = meshes[Role.CRITIC]
    n_sh = cm.shape.get("fsdp", 1) * cm.shape.get("tensor", 1)
    items.append(Item("critic", "parameters + optimizer state",
                      an.param_bytes(critic_cfg, n_sh) + an.opt_bytes(critic_cfg, n_sh, "adam",
                                                                      master),
                      cm.devices, RESIDENT, "analytic", "place the critic on other devices "
                      "(placement.critic) or shard it over more"))

  for step in plan.steps:
    node, lay = step.node, step.layout
    devs = lay.devices
    dp = lay.dp_size
    if node.fn in ("generate", "generate.greedy"):
      items.extend(generate_items(cfg, plan, model_cfg, node.id, devs, comp, adv, notes,
                                  shards, platform))
      if node.fn == "generate.greedy":
        notes.append(f"node {node.id!r} (generate.greedy): its own replica's sync and "
                     f"decode, as generate's; the weights generate synced count only while "
                     f"generate runs")
    elif node.fn in ("values", "train.critic"):  # the critic's steps: analytic only
      train = node.fn == "train.critic"
      mbs = cfg.critic.micro_batch_size
      rows = mbs if train else samples // dp
      act = an.activation_bytes(model_cfg, rows, plen, nlen, 1, tp, train=train, remat=remat,
                                attention_impl=impl)
      cm = meshes.get(Role.CRITIC, actor)
      gb = an.grad_bytes(critic_cfg, cm.shape.get("fsdp", 1) * cm.shape.get("tensor", 1)
                         ) if train else 0.0
      items.append(Item(node.id, "gradients + activations" if train else "activations "
                        "(forward pass)", gb + act, devs, node.id, "analytic",
                        f"lower critic.micro_batch_size={mbs}" if train else adv["pass"]))
    elif node.fn in ("logprob", "logprob.stats", "ref_logprob", "train.actor"):
      role = Role.REFERENCE if node.fn == "ref_logprob" else Role.ACTOR
      jdevs = roles_lib.ordered_devices()
      lmesh = sharding.make_mesh({"data": dp, "tensor": len(devs) // dp},
                                 [jdevs[i] for i in devs]) if comp else None
      layout = NamedSharding(lmesh, P("data")) if comp else None
      if node.fn != "train.actor":
        gs = shared_prompt_group(cfg, samples, dp)
        if comp:
          key = (meshes[role].devices, meshes[role].axes, dp, gs)
          if key not in passes:  # the reference's pass on the actor's mesh is the same
            g, params = role_params(role)
            batch = cp.abstract_batch(samples, plen, nlen, layout, ())
            m = cp.logprob_memory(g, params, batch, gs, layout)
            passes[key] = m.temp + m.output + cp.device_bytes(batch)
          tb = passes[key]
        else:
          tb = an.activation_bytes(model_cfg, samples // dp, plen, nlen, gs, tp, train=False,
                                   attention_impl=impl)
        items.append(Item(node.id, "activations (forward pass)", tb, devs, node.id, src,
                          adv["pass"]))
        continue
      minis = cfg.actor.mini_batches
      micro = max(samples // dp // minis // cfg.actor.micro_batch_size, 1)
      gs = shared_prompt_group(cfg, samples, dp * minis * micro)
      gb = an.grad_bytes(model_cfg, shards)
      if cfg.model.pack_sequences:
        items.extend(_packed_train_items(cfg, model_cfg, node.id, devs, dp, minis, micro, plen,
                                         nlen, tp, remat, impl, gb, adv, notes))
        continue
      if comp:
        g, params = role_params(Role.ACTOR)
        opt_abs = cp.abstract_opt_state(tx, params, roles_lib.jax_mesh(actor))
        kl = cfg.actor.kl.coef > 0 and not cfg.actor.kl.in_reward
        extra = (OLD_LOGPROBS, ADVANTAGES) + ((REF_LOGPROBS,) if kl else ()) + (
            (ROLLOUT_LOGPROBS,) if OffPolicyCorrection.parse(cfg.actor.off_policy.correction)
            is not OffPolicyCorrection.NONE else ())
        batch = cp.abstract_batch(samples // minis, plen, nlen, layout, extra)
        t0 = time.time()
        m = cp.train_step_memory(cfg, g, params, opt_abs, tx, batch, micro, gs)
        notes.append(f"train step compiled in {time.time() - t0:.0f} s: argument "
                     f"{an.fmt(m.argument)}, output {an.fmt(m.output)}, temp {an.fmt(m.temp)}, "
                     f"alias {an.fmt(m.alias)} per device")
        gb = cp.grad_bytes(params)
        act = m.temp - gb
        expect = an.activation_bytes(model_cfg, samples // dp // minis // micro, plen, nlen, gs,
                                     tp, remat=remat, attention_impl=impl)
        if act > 3 * expect:  # what XLA chose, not what the mesh promises: worth a look
          notes.append(f"the compiled train step keeps {act / expect:.0f}x the activations the "
                       f"analytic model expects for its rows per device on this mesh "
                       f"({dict(actor.shape)}): the rest is XLA's own buffers (gathered "
                       f"weights, fused temporaries), which the analytic model does not count")
        batch_b = m.argument - cp.device_bytes(params) - cp.device_bytes(opt_abs)
      else:
        rows = samples // dp // minis // micro
        act = an.activation_bytes(model_cfg, rows, plen, nlen, gs, tp, remat=remat,
                                  attention_impl=impl)
        batch_b = samples // minis // dp * (plen + nlen) * 9
      items.append(Item(node.id, "gradients (accumulator + micro-batch)", gb, devs, node.id,
                        src, adv["grads"]))
      items.append(Item(node.id, f"activations ({micro} micro-batch(es), "
                        f"{cfg.actor.micro_batch_size} rows/device)", act, devs, node.id, src,
                        adv["act"]))
      items.append(Item(node.id, "batch", batch_b, devs, node.id, src, "-"))
  direct = not any(i.what.startswith("weight sync fallback") for i in items)
  return Estimate(items, traffic.per_step(cfg, plan, model_cfg, shards, samples, plen, nlen,
                                          direct=direct), notes)


def _packed_train_items(cfg, model_cfg, node_id, devs, dp, minis, micro, plen, nlen, tp, remat,
                        impl, gb, adv, notes) -> list[Item]:
  """The actor's train step under model.pack_sequences, analytic: a micro-batch is
  ceil(actor.micro_batch_tokens / pack_len) packed rows per device, or (no token budget)
  at most its micro_batch_size samples, each in at most one row."""
  pack_len = cfg.model.pack_len or plen + nlen - 1
  budget = cfg.actor.micro_batch_tokens
  rows = -(-budget // pack_len) if budget else cfg.actor.micro_batch_size
  what = (f"{rows} packed row(s) of {pack_len} per device (micro_batch_tokens={budget})"
          if budget else f"at most {rows} packed row(s) of {pack_len} per device")
  notes.append("train step under model.pack_sequences: analytic (the compiled figure covers "
               "padded rows only); the micro-batch count follows the samples' lengths")
  act = an.packed_train_activation_bytes(model_cfg, rows, pack_len, tp, remat, impl)
  batch_b = cfg.data.prompts_per_step * cfg.rollout.n // minis // dp * (plen + nlen) * 9
  return [Item(node_id, "gradients (accumulator + micro-batch)", gb, devs, node_id,
               "analytic", adv["grads"]),
          Item(node_id, f"activations ({what})", act, devs, node_id, "analytic",
               "lower actor.micro_batch_tokens" if budget else adv["act"]),
          Item(node_id, "batch", batch_b, devs, node_id, "analytic", "-")]


def model_shape(cfg: ml_collections.ConfigDict) -> ModelConfig:
  """The model's shape from ``model.path``'s config.json alone (no weights, no tokenizer),
  else the preset sized to the built-in tokenizer."""
  if cfg.model.path:
    try:
      return roles_lib.model_config(cfg, tokenizer=None)
    except ValueError as e:
      raise ConfigError(f"model.path={cfg.model.path!r}: config.json: {e}") from None
  return roles_lib.model_config(cfg, roles_lib.load_tokenizer(cfg.model))


def run(cfg: ml_collections.ConfigDict, plan: Plan, device_memory: str | None,
        source: str, target: str | None = None) -> None:
  """Prints the memory plan; raises ConfigError when it does not fit what jax can use of
  ``device_memory`` on ``target`` (``budget``; default a GPU)."""
  if target is not None and device_memory is None:
    raise ConfigError(f"--target={target} sizes what jax can use of --device_memory; add "
                      f"--device_memory (e.g. 80GB)")
  try:
    limit = an.parse_bytes(device_memory) if device_memory is not None else None
  except ValueError as e:
    raise ConfigError(str(e)) from None
  dev = budget(limit, target) if limit is not None else None
  topo = plan.topology
  if jax.device_count() != topo.num_devices:
    raise ConfigError(f"plan --memory simulates {topo.num_devices} devices but jax has "
                      f"{jax.device_count()}: run it on CPU (JAX_PLATFORMS=cpu), where the "
                      f"device count is simulated")
  est = estimate(cfg, plan, model_shape(cfg), source, "gpu" if dev is None else dev.platform)
  print(render(est, topo.num_devices, topo.num_processes, dev), flush=True)
  if dev is not None:
    check_fits(est, topo.num_devices, dev, device_memory)
