"""``distflow-jax plan --memory``: per-device memory of each role and node, and traffic.

``estimate`` sizes every consumer on every device of the plan: resident state (each
role's parameters and optimizer state) plus the largest transient of one node phase (the
rollout's weight sync: the synced weights and the sync's buffers; its decode: the synced
weights and the KV cache; a log-prob pass; the train step).  Figures come from
``compiled`` (the real steps compiled on abstract shapes, on simulated devices of the
target topology) or, with ``source="analytic"``, from ``analytic``.

The fit is against what jax can use of a device (``budget``): on a GPU jax's allocator
takes a fraction of the memory (``XLA_CLIENT_MEM_FRACTION`` or the deprecated
``XLA_PYTHON_CLIENT_MEM_FRACTION``, else 0.75) and a reserve comes off it for what the
CPU-compiled figures do not hold (``GPU_RESERVE``); a TPU keeps ``TPU_RESERVE`` for its
runtime; a CPU counts all of it.  ``render`` prints the figures, the budget and its
reasoning, the fit, the three biggest consumers and what to change (never a value that
is already set); ``check_fits`` refuses a device that is too small in one line.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping

import ml_collections

from distflow_jax.config.loading import ConfigError
from distflow_jax.dag.planner import Plan
from distflow_jax.dag.spec import Role
from distflow_jax.memory import analytic as an, traffic
from distflow_jax.models.config import ModelConfig

RESIDENT = "resident"


@dataclasses.dataclass(frozen=True)
class Item:
  """One consumer: ``where`` is a role (resident) or a node (transient, only while it runs)."""
  where: str
  what: str
  nbytes: float
  devices: tuple[int, ...]
  phase: str        # RESIDENT, or the node phase whose run it lives through
  source: str       # "compiled" or "analytic"
  advice: str
  also: tuple[str, ...] = ()   # further phases it lives through (the synced weights)

  @property
  def phases(self) -> tuple[str, ...]:
    return (self.phase,) + self.also


@dataclasses.dataclass
class Estimate:
  items: list[Item]
  traffic: list[str]
  notes: list[str]

  def per_device(self, d: int) -> tuple[float, str]:
    """``(peak bytes, node of the peak)`` of device ``d``: resident + its largest node."""
    mine = [i for i in self.items if d in i.devices]
    resident = sum(i.nbytes for i in mine if i.phase == RESIDENT)
    phases: dict[str, float] = {}
    for i in mine:
      for ph in i.phases:
        if ph != RESIDENT:
          phases[ph] = phases.get(ph, 0.0) + i.nbytes
    node = max(phases, key=phases.get) if phases else "-"
    return resident + phases.get(node, 0.0), node

  def worst(self, num_devices: int) -> tuple[int, float, str]:
    d = max(range(num_devices), key=lambda k: self.per_device(k)[0])
    return (d, *self.per_device(d))

  def biggest(self, d: int, node: str, k: int = 3) -> list[Item]:
    live = [i for i in self.items if d in i.devices and (i.phase == RESIDENT or
                                                          node in i.phases)]
    return sorted(live, key=lambda i: -i.nbytes)[:k]


# What comes off jax's share of a device beside the compiled figures (stated allowances,
# not measured here).  GPU: XLA:GPU allocates cuBLAS/cuBLASLt workspaces (up to 32 MiB
# per GEMM on Hopper) and cuDNN's fused-attention workspaces as buffers of its own pool,
# which a CPU compile does not have, and the BFC pool fragments; NCCL's communicator
# buffers (NCCL_BUFFSIZE 4 MiB x channels x peers) and the CUDA context (~0.5 GB) live
# outside the pool, in the (1 - fraction) jax leaves.  TPU: the runtime keeps part of HBM
# (memory_stats()['bytes_limit'] is below the HBM size; check it on the device).
GPU_RESERVE = 1 << 30
TPU_RESERVE = 1 << 29
GPU_DEFAULT_FRACTION = 0.75  # jax's preallocated share when no fraction is set
# Outside jax's pool a GPU still needs the CUDA context, library handles and NCCL's
# buffers: a fraction that leaves less than this is flagged.
GPU_OUTSIDE_POOL = 2 * 10**9


@dataclasses.dataclass(frozen=True)
class Budget:
  """What jax can use of one device: ``device_memory x fraction - reserve``, and why."""
  target: str
  platform: str      # "gpu", "tpu" or "cpu"
  device_memory: int
  fraction: float
  reserve: int
  why: tuple[str, ...]

  @property
  def usable(self) -> int:
    return int(self.device_memory * self.fraction) - self.reserve

  def lines(self) -> list[str]:
    head = (f"device: {self.platform} {self.target}, {an.fmt(self.device_memory)}; usable by "
            f"jax {an.fmt(self.usable)}")
    if self.fraction != 1.0 or self.reserve:
      head += (f" = {an.fmt(self.device_memory)} x {self.fraction:g} - "
               f"{an.fmt(self.reserve)} reserve")
    return [head] + [f"  budget: {w}" for w in self.why]


def budget(device_memory: int, target: str | None = None,
           env: Mapping[str, str] | None = None) -> Budget:
  """The usable memory of ``device_memory`` on ``target`` (models/target.py's names:
  h100, a100, tpu, cpu, ...; default a GPU), read with this process's environment
  (``env``) as jax would read it on the device.  ConfigError (one line) on a bad name or
  setting."""
  from distflow_jax.models import target as target_lib
  env = os.environ if env is None else env
  name = target or "gpu"
  try:
    tgt = target_lib.parse(name)
  except ValueError as e:
    raise ConfigError(f"--target: {e}") from None
  shown = tgt.name + ("" if target else " (the default; --target=tpu|cpu|... names another)")
  if tgt.platform is target_lib.Platform.CPU:
    return Budget(shown, "cpu", device_memory, 1.0, 0, (
        "a CPU host: all of it (no allocator pool, no reserve)",))
  if tgt.platform is target_lib.Platform.TPU:
    return Budget(shown, "tpu", device_memory, 1.0, TPU_RESERVE, (
        f"{an.fmt(TPU_RESERVE)} (0.5 GiB) reserve for the TPU runtime and program code (no "
        f"preallocated fraction on TPU; memory_stats()['bytes_limit'] on the device is "
        f"the exact figure)",))
  new, old = env.get("XLA_CLIENT_MEM_FRACTION", ""), env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
  if new and old:
    raise ConfigError("XLA_CLIENT_MEM_FRACTION and XLA_PYTHON_CLIENT_MEM_FRACTION are both "
                      "set (jax refuses that too); keep XLA_CLIENT_MEM_FRACTION")
  var = "XLA_CLIENT_MEM_FRACTION" if new else "XLA_PYTHON_CLIENT_MEM_FRACTION"
  allocator = env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default").lower()
  why = []
  if allocator == "platform":
    fraction = 1.0
    why.append("XLA_PYTHON_CLIENT_ALLOCATOR=platform: no pool, jax allocates and frees on "
               "demand (slow); the whole device less the reserve")
  elif new or old:
    try:
      fraction = float(new or old)
    except ValueError:
      fraction = -1.0
    if not 0 < fraction <= 1:
      raise ConfigError(f"{var}={new or old!r} is not a fraction in (0, 1]; jax's default "
                        f"is {GPU_DEFAULT_FRACTION}")
    why.append(f"{var}={new or old}: jax's allocator pool is that share of the device")
  else:
    fraction = GPU_DEFAULT_FRACTION
    why.append(f"jax preallocates {GPU_DEFAULT_FRACTION:g} of a GPU for its allocator pool "
               f"(XLA_CLIENT_MEM_FRACTION unset; set it, e.g. =.9, to give jax more; newer "
               f"jax may grow the pool past {GPU_DEFAULT_FRACTION:g} when the memory is free, "
               f"{GPU_DEFAULT_FRACTION:g} is what it takes for sure)")
  if allocator != "platform":
    if env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() in ("false", "0"):
      why.append("XLA_PYTHON_CLIENT_PREALLOCATE=false: the pool grows on demand, still "
                 "capped at that share")
    outside = device_memory * (1 - fraction)
    if outside < GPU_OUTSIDE_POOL:
      why.append(f"only {an.fmt(outside)} is left outside jax's pool for the CUDA context, "
                 f"libraries and NCCL's buffers (about {an.fmt(GPU_OUTSIDE_POOL)}): expect "
                 f"out-of-memory at start-up; lower {var}")
  why.append(f"{an.fmt(GPU_RESERVE)} (1 GiB) reserve for cuBLAS/cuDNN workspaces XLA:GPU "
             f"allocates in its pool (not in figures compiled for CPU), allocator "
             f"fragmentation and NCCL buffers: a stated allowance (memory/report.py "
             f"GPU_RESERVE)")
  return Budget(shown, "gpu", device_memory, fraction, GPU_RESERVE, tuple(why))


def _prompt_len(cfg: ml_collections.ConfigDict) -> int:
  """The widest prompt columns a step can have (nodes.rollout.prompt_width)."""
  fits = [b for b in cfg.rollout.prefill_buckets if b >= cfg.data.max_prompt_len]
  return min(fits) if fits else cfg.data.max_prompt_len


def _advice(cfg: ml_collections.ConfigDict, fsdp: int, per_host: int) -> dict[str, str]:
  """What to change for each consumer; never a value that is already set (each names
  the setting's current value as "now")."""
  r, a = cfg.rollout, cfg.actor
  remat = str(cfg.model.get("remat", "none"))
  more = (f"shard it over more devices (fsdp={fsdp} now: more hosts with --num_processes, "
          f"or placement.actor.mesh)")
  sgd = str(a.optimizer.name) == "sgd"
  tp = int(r.tensor_parallel)
  wider = [t for t in range(tp + 1, per_host + 1) if per_host % t == 0]
  if wider:
    rollout_w = (f"raise rollout.tensor_parallel to {' or '.join(map(str, wider))} (now {tp}; "
                 f"each device holds the model / tensor_parallel)")
  else:
    rollout_w = (f"rollout.tensor_parallel is already every device of a host ({per_host}; a "
                 f"replica stays inside one host): make room beside it instead: fewer KV "
                 f"slots (rollout.max_concurrent_decodes, now {r.max_concurrent_decodes}), or "
                 f"more hosts (--num_processes) to thin the actor's resident state")
  act = (f"lower actor.micro_batch_size (now {a.micro_batch_size})" if a.micro_batch_size > 1
         else f"shorten rollout.max_new_tokens (now {r.max_new_tokens}) or data.max_prompt_len "
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
            f"rollout.max_new_tokens (now {r.max_new_tokens})",
      "sync": ("its largest step is the embedding or one layer: "
               + (f"raise rollout.tensor_parallel to {wider[-1]} (now {tp})" if wider else
                  "it shrinks only with the model")),
      "fallback": "keep the rollout on the actor's devices of each host (the fallback "
                  "gathers whole parameters on every training device)",
      "unstack": "set model.scan_layers=False (the rollout's per-layer copy is then the "
                 "training parameters themselves; compiles take longer)",
      "pass": f"lower data.prompts_per_step (now {cfg.data.prompts_per_step}; the pass runs "
              f"the whole step's batch at once)",
  }


def estimate(cfg: ml_collections.ConfigDict, plan: Plan, model_cfg: ModelConfig,
             source: str = "compiled") -> Estimate:
  """Every consumer of every device of ``plan`` (jax must see the plan's device count)."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from distflow_jax.memory import compiled as cp
  from distflow_jax.models import sharding
  from distflow_jax.state import roles as roles_lib
  from distflow_jax.state.context import shared_prompt_group

  comp = source == "compiled"
  master = bool(cfg.model.get("master_weights", False))
  remat = str(cfg.model.get("remat", "none"))
  impl = str(cfg.model.get("attention_impl", "auto"))
  src = "compiled" if comp else "analytic"
  topo = plan.topology
  meshes = {m.role: m for m in plan.meshes}
  actor = meshes[Role.ACTOR]
  fsdp, tp = actor.shape.get("fsdp", 1), actor.shape.get("tensor", 1)
  shards = fsdp * tp
  adv = _advice(cfg, fsdp, len(actor.devices) // topo.num_processes)
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
  plen, nlen = _prompt_len(cfg), cfg.rollout.max_new_tokens
  params_by_role, passes = {}, {}

  def role_params(role):
    if role not in params_by_role:
      params_by_role[role] = cp.abstract_model(model_cfg, roles_lib.jax_mesh(meshes[role]))
    return params_by_role[role]

  for role in (Role.ACTOR, Role.REFERENCE):
    if role not in meshes:
      continue
    rm = meshes[role]
    n_sh = rm.shape.get("fsdp", 1) * rm.shape.get("tensor", 1)
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
                      an.param_bytes(model_cfg, n_sh) + an.opt_bytes(model_cfg, n_sh, "adam",
                                                                     master),
                      cm.devices, RESIDENT, "analytic", "place the critic on other devices "
                      "(placement.critic) or shard it over more"))

  for step in plan.steps:
    node, lay = step.node, step.layout
    devs = lay.devices
    dp = lay.dp_size
    if node.fn == "generate":
      items.extend(_generate_items(cfg, plan, model_cfg, node.id, devs, comp, adv, notes,
                                   shards))
    elif node.fn in ("values", "train.critic"):  # the critic's steps: analytic only
      train = node.fn == "train.critic"
      mbs = cfg.critic.micro_batch_size
      rows = mbs if train else samples // dp
      act = an.activation_bytes(model_cfg, rows, plen, nlen, 1, tp, train=train, remat=remat,
                                attention_impl=impl)
      cm = meshes.get(Role.CRITIC, actor)
      gb = an.grad_bytes(model_cfg, cm.shape.get("fsdp", 1) * cm.shape.get("tensor", 1)
                         ) if train else 0.0
      items.append(Item(node.id, "gradients + activations" if train else "activations "
                        "(forward pass)", gb + act, devs, node.id, "analytic",
                        f"lower critic.micro_batch_size={mbs}" if train else adv["pass"]))
    elif node.fn in ("logprob", "ref_logprob", "train.actor"):
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
      if cfg.model.get("pack_sequences", False):
        items.extend(_packed_train_items(cfg, model_cfg, node.id, devs, dp, minis, micro, plen,
                                         nlen, tp, remat, impl, gb, adv, notes))
        continue
      if comp:
        g, params = role_params(Role.ACTOR)
        opt_abs = cp.abstract_opt_state(tx, params, roles_lib.jax_mesh(actor))
        kl = cfg.actor.kl.coef > 0 and not cfg.actor.kl.in_reward
        extra = ("old_logprobs", "advantages") + (("ref_logprobs",) if kl else ())
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


def _generate_items(cfg, plan, model_cfg, node_id, devs, comp, adv, notes, shards
                    ) -> list[Item]:
  """The rollout node's two phases on each training device.  Weight sync
  (``<node>/weight_sync``): the synced weights, the sync's largest step's buffers, with
  ``model.scan_layers`` the per-layer copy the engine makes first, and on the fallback
  route the whole parameters gathered.  Decode (``<node>``): the synced weights, the KV
  cache, and while it grows one old layer beside the new cache.  The previous step's
  rollout weights are released before the sync (rollout/weight_sync.py): counted once."""
  from distflow_jax.memory import compiled as cp
  from distflow_jax.models import sharding
  from distflow_jax.rollout import cache_growth
  from distflow_jax.rollout.engine_config import EngineConfig
  from distflow_jax.state import roles as roles_lib
  topo = plan.topology
  src = "compiled" if comp else "analytic"
  sync = f"{node_id}/weight_sync"  # one word: the peak line reads "while <phase> runs"
  tp = cfg.rollout.tensor_parallel
  per_host = len(devs) // topo.num_processes
  data = max(per_host // tp, 1)
  slots = cfg.rollout.max_concurrent_decodes
  cache_len = max(cfg.rollout.prefill_buckets) + cfg.rollout.max_new_tokens
  if comp:
    rdevs = roles_lib.ordered_devices()
    host0 = [rdevs[i] for i in devs[:per_host]]
    rmesh = sharding.make_mesh({"data": data, "tensor": tp}, host0)
    wb, kvb = cp.rollout_state_bytes(model_cfg, rmesh, slots, cache_len)
    actor = next(m for m in plan.meshes if m.role is Role.ACTOR)
    t0 = time.time()
    sm = cp.sync_memory(model_cfg, roles_lib.jax_mesh(actor), rmesh,
                        lambda d: topo.process_of(rdevs.index(d)))
    notes.append(f"weight sync compiled in {time.time() - t0:.0f} s: {sm.steps} steps, "
                 f"output {an.fmt(sm.output)}, largest step's temp {an.fmt(sm.temp)} per "
                 f"device (XLA:CPU's buffers; a GPU's collectives may differ)")
    temp, direct, steps = sm.temp, sm.direct, sm.steps
    gathered = max(sm.output - wb, 0.0)
  else:
    wb = an.param_bytes(model_cfg, tp)
    kvb = an.kv_cache_bytes(model_cfg, slots, cache_len) / per_host
    temp, direct, steps, gathered = an.sync_step_bytes(model_cfg, tp), True, None, 0.0
  out = [Item(node_id, "rollout weights (synced copy)", wb, devs, node_id, src,
              adv["rollout_w"], also=(sync,)),
         Item(node_id, f"KV cache ({slots} slots x {cache_len})", kvb, devs, node_id, src,
              adv["kv"])]
  econf = EngineConfig(max_concurrent_decodes=slots,
                       prefill_buckets=tuple(cfg.rollout.prefill_buckets),
                       max_new_tokens=cfg.rollout.max_new_tokens)
  caps = cache_growth.capacities(cache_len, econf.prefill_buckets[-1] + econf.decode_steps,
                                 not cfg.trainer.deterministic)
  if len(caps) > 1:  # the last growth: the new cache whole, one old layer's keys or values
    out.append(Item(node_id, "KV cache growth (one old layer while it grows)",
                    kvb * caps[-2] / caps[-1] / (2 * model_cfg.num_layers), devs, node_id,
                    src, adv["kv"]))
  what = f"weight sync buffers (largest of {steps} steps)" if steps else \
      "weight sync buffers (largest step)"
  out.append(Item(node_id, what, temp, devs, sync, src, adv["sync"]))
  if model_cfg.scan_layers:
    out.append(Item(node_id, "weight sync input: per-layer copy (scan_layers)",
                    an.param_bytes(model_cfg, shards), devs, sync, "analytic",
                    adv["unstack"]))
  if not direct:
    out.append(Item(node_id, "weight sync fallback: whole parameters gathered", gathered,
                    devs, sync, src, adv["fallback"]))
  notes.append("weight sync " + ("straight into the rollout layout: each device receives "
                                 "only its rollout shard" if direct else
                                 "on the fallback route: whole parameters on every training "
                                 "device while it runs")
               + "; the previous step's rollout weights are released first (counted once)")
  return out


def _packed_train_items(cfg, model_cfg, node_id, devs, dp, minis, micro, plen, nlen, tp, remat,
                        impl, gb, adv, notes) -> list[Item]:
  """The actor's train step under model.pack_sequences, analytic: a micro-batch is
  ceil(actor.micro_batch_tokens / pack_len) packed rows per device, or (no token budget)
  at most its micro_batch_size samples, each in at most one row."""
  pack_len = cfg.model.get("pack_len", 0) or plen + nlen - 1
  budget = cfg.actor.get("micro_batch_tokens", 0)
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


def _as_budget(device_memory: "Budget | int | None") -> "Budget | None":
  if device_memory is None or isinstance(device_memory, Budget):
    return device_memory
  return Budget("as given", "any", int(device_memory), 1.0, 0, ())


def render(est: Estimate, num_devices: int, num_processes: int,
           device_memory: "Budget | int | None") -> str:
  """The table, the worst device's peak and its fit against what jax can use of the
  device (``budget``; a plain byte count is taken whole), its three biggest consumers."""
  lines = [f"memory per device ({est.notes[0]}):"]
  for i in est.items:
    span = f"[{i.devices[0]}..{i.devices[-1]}]" if len(i.devices) > 1 else f"[{i.devices[0]}]"
    when = "resident" if i.phase == RESIDENT else f"while {' / '.join(i.phases)} runs"
    lines.append(f"  {i.where:<14} {i.what:<46} {an.fmt(i.nbytes):>11}  on {span:<9} {when}")
  lines += [f"  note: {n}" for n in est.notes[1:]]
  d, peak, node = est.worst(num_devices)
  per = num_devices // num_processes
  lines.append(f"peak: {an.fmt(peak)} on device {d} (process {d // per}), while {node} runs")
  b = _as_budget(device_memory)
  if b is not None:
    lines += b.lines()
    gap = b.usable - peak
    lines.append(f"fits {an.fmt(b.device_memory)} ({an.fmt(b.usable)} usable): "
                 + (f"yes, {an.fmt(gap)} to spare" if gap >= 0 else
                    f"NO, over by {an.fmt(-gap)}"))
  lines.append("biggest consumers:")
  for i in est.biggest(d, node):
    lines.append(f"  {an.fmt(i.nbytes):>11}  {i.where} {i.what}: to shrink, {i.advice}")
  lines.append("traffic per step:")
  lines += [f"  {t}" for t in est.traffic]
  return "\n".join(lines)


def check_fits(est: Estimate, num_devices: int, device_memory: "Budget | int", text: str
               ) -> None:
  """Refuses (ConfigError, one line) a device whose usable memory is below the plan's
  peak."""
  b = _as_budget(device_memory)
  d, peak, node = est.worst(num_devices)
  if peak <= b.usable:
    return
  top = est.biggest(d, node, 1)[0]
  usable = ("" if b.platform == "any" else
            f" ({b.target.split(' ')[0]}: {an.fmt(b.usable)} usable)")
  raise ConfigError(f"--device_memory={text}{usable}: the plan needs {an.fmt(peak)} on device "
                    f"{d} while {node} runs, {an.fmt(peak - b.usable)} too much; the biggest "
                    f"consumer is {top.where} {top.what} ({an.fmt(top.nbytes)}): {top.advice}")


def model_shape(cfg: ml_collections.ConfigDict) -> ModelConfig:
  """The model's shape from ``model.path``'s config.json alone (no weights, no tokenizer),
  else the preset sized to the built-in tokenizer."""
  from distflow_jax.state import roles as roles_lib
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
  import jax
  topo = plan.topology
  if jax.device_count() != topo.num_devices:
    raise ConfigError(f"plan --memory simulates {topo.num_devices} devices but jax has "
                      f"{jax.device_count()}: run it on CPU (JAX_PLATFORMS=cpu), where the "
                      f"device count is simulated")
  est = estimate(cfg, plan, model_shape(cfg), source)
  print(render(est, topo.num_devices, topo.num_processes, dev), flush=True)
  if dev is not None:
    check_fits(est, topo.num_devices, dev, device_memory)
