"""The rollout (``generate``) node's consumers in the memory plan.

Its two phases on each training device: the weight sync (``<node>/weight_sync``: the
synced weights, the sync's largest step's buffers, the per-layer copy under
``model.scan_layers``, the gathered parameters on the fallback route) and decode
(``<node>``: the synced weights, the KV cache, one old layer while the cache grows); from
the compiled sync and rollout state (:mod:`distflow_jax.memory.compiled`) or the analytic
model.  :mod:`distflow_jax.memory.report` adds them to the estimate.
"""

from __future__ import annotations

import time

import ml_collections

from distflow_jax.config.response import response_width
from distflow_jax.dag import replicas
from distflow_jax.dag.planner import Plan
from distflow_jax.dag.spec import Role
from distflow_jax.memory import analytic as an, compiled as cp
from distflow_jax.memory.consumers import RESIDENT, Item
from distflow_jax.models import sharding
from distflow_jax.models.config import ModelConfig
from distflow_jax.rollout.engine import cache_growth
from distflow_jax.rollout.engine.config import CpuCompute, EngineConfig, LoraSync, compute_dtype
from distflow_jax.state import roles as roles_lib

def generate_items(cfg: ml_collections.ConfigDict, plan: Plan, model_cfg: ModelConfig,
                   node_id: str, devs: tuple[int, ...], comp: bool, adv: dict[str, str],
                   notes: list[str], shards: int, platform: str = "gpu") -> list[Item]:
  """The rollout node's two phases on each training device.  Weight sync
  (``<node>/weight_sync``): the synced weights, the sync's largest step's buffers, with
  ``model.scan_layers`` the per-layer copy the engine makes first, and on the fallback
  route the whole parameters gathered.  Decode (``<node>``): the synced weights, the KV
  cache, and while it grows one old layer beside the new cache.  The previous step's
  rollout weights are released before the sync (rollout/weight_sync.py): counted once.
  With LoRA every figure is the merged base's; under ``rollout.lora_sync=adapters`` the
  engine also keeps its own base copy for the run (rollout/lora_sync.py), unless the
  rollout layout is the training one (one device, loop layers: aliased).  On a CPU
  ``platform`` the engine of a 16-bit model holds its weights and cache in float32 under
  ``rollout.cpu_compute=float32`` (rollout/engine/config.compute_dtype): counted so."""
  topo = plan.topology
  # LoRA: the engine holds the merged base, no adapters (rollout/engine)
  adapters = (model_cfg.lora is not None and LoraSync(cfg.rollout.lora_sync)
              is LoraSync.ADAPTERS)
  aliased = shards == 1 and cfg.rollout.tensor_parallel == 1 and not model_cfg.scan_layers
  engine_dtype = compute_dtype(model_cfg, EngineConfig(
      cpu_compute=CpuCompute(cfg.rollout.cpu_compute),
      lora_sync=LoraSync(cfg.rollout.lora_sync)), platform)
  if engine_dtype != model_cfg.dtype:
    notes.append(f"rollout on a CPU: the engine holds the {model_cfg.dtype} model's weights and "
                 f"KV cache in {engine_dtype} (rollout.cpu_compute={cfg.rollout.cpu_compute})")
  model_cfg = model_cfg.replace(lora=None, dtype=engine_dtype)
  src = "compiled" if comp else "analytic"
  sync = f"{node_id}/weight_sync"  # one word: the peak line reads "while <phase> runs"
  tp = cfg.rollout.tensor_parallel
  # The first replica's devices: a host's, or its processes' where it spans hosts.
  first = replicas.replica_groups(devs, tp, topo.process_of)[0]
  replica = [d for d in devs if topo.process_of(d) in first]
  data = max(len(replica) // tp, 1)
  slots = cfg.rollout.max_concurrent_decodes
  cache_len = max(cfg.rollout.prefill_buckets) + response_width(cfg.rollout)
  if comp:
    rdevs = roles_lib.ordered_devices()
    rmesh = sharding.make_mesh({"data": data, "tensor": tp}, [rdevs[i] for i in replica])
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
    kvb = an.kv_cache_bytes(model_cfg, slots, cache_len) / len(replica)
    temp, direct, steps, gathered = an.sync_step_bytes(model_cfg, tp), True, None, 0.0
  out = [Item(node_id, "rollout weights (synced copy)", wb, devs, node_id, src,
              adv["rollout_w"], also=(sync,)),
         Item(node_id, f"KV cache ({slots} slots x {cache_len})", kvb, devs, node_id, src,
              adv["kv"])]
  econf = EngineConfig(max_concurrent_decodes=slots,
                       prefill_buckets=tuple(cfg.rollout.prefill_buckets),
                       max_new_tokens=cfg.rollout.max_new_tokens,
                       decode_steps=cfg.rollout.decode_chunk)
  caps = cache_growth.capacities(cache_len, econf.prefill_buckets[-1] + econf.decode_steps,
                                 econf.grow_cache and not cfg.trainer.deterministic)
  if len(caps) > 1:  # the last growth: the new cache whole, one old layer's keys or values
    out.append(Item(node_id, "KV cache growth (one old layer while it grows)",
                    kvb * caps[-2] / caps[-1] / (2 * model_cfg.num_layers), devs, node_id,
                    src, adv["kv"]))
  if adapters and not aliased:
    out.append(Item(node_id, "rollout base copy (rollout.lora_sync=adapters)", wb, devs,
                    RESIDENT, src, adv["lora_base"]))
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
