"""Bytes a step moves: the weight sync and each re-partition of the batch.

Re-partitions are sized with the data plane's own plan (``data.plan``) on the simulated
devices, every row at full length (the most a step can move); the weight sync moves the
actor's parameters straight into the rollout layout (``rollout.weight_sync``: each device
receives its rollout shard), or on its fallback route gathers them whole.  A LoRA actor
syncs its merged weights (``rollout.lora_sync=merged``) or, after a first sync of its base,
its adapters alone (``adapters``; rollout/lora_sync.py).
"""

from __future__ import annotations

import ml_collections
import numpy as np

from distflow_jax.dag.planner import Move, Plan
from distflow_jax.data import layout as dlayout
from distflow_jax.data.plan import make_repartition_plan
from distflow_jax.memory import analytic as an
from distflow_jax.models import sharding
from distflow_jax.models.config import ModelConfig
from distflow_jax.rollout.engine.config import LoraSync
from distflow_jax.state import roles as roles_lib


def per_step(cfg: ml_collections.ConfigDict, plan: Plan, model_cfg: ModelConfig, shards: int,
             samples: int, plen: int, nlen: int, direct: bool = True) -> list[str]:
  """Lines on the weight sync's and each re-partition's bytes per step (``direct``: the
  sync goes straight into the rollout layout, else its fallback's all-gather)."""
  topo = plan.topology
  full = an.param_bytes(model_cfg.replace(lora=None))  # LoRA: the merged base is synced
  out = []
  gen = next((s for s in plan.steps if s.node.fn == "generate"), None)
  who = "weight sync: the actor's"
  if gen is not None and model_cfg.lora is not None:
    line, once = _lora_line(cfg, model_cfg, full)
    out.append(line)
    who = "the base's first sync: its" if once else who
  if gen is not None and direct:
    tp = cfg.rollout.tensor_parallel
    data = max(len(gen.layout.devices) // topo.num_processes // tp, 1)
    far = data * full * (1 - 1 / topo.num_processes)
    out.append(f"{who} {an.fmt(full)} straight into the rollout layout "
               f"(rollout.tensor_parallel={tp}): each device receives at most its "
               f"{an.fmt(full / tp)} shard; across hosts each process receives about "
               f"{an.fmt(far)}")
  elif gen is not None:
    out.append(f"weight sync (fallback route): all-gather of the actor's {an.fmt(full)}: "
               f"each device receives {an.fmt(full * (1 - 1 / shards))}; across hosts each "
               f"process receives {an.fmt(full * (1 - 1 / topo.num_processes))}")
  row = (plen + nlen) * 5 + nlen * 4 * 4  # tokens + masks, ~4 float32 fields per token
  reps = plan.repartitions()
  out.append(f"re-partitions per step: {len(reps)}" + (
      f" ({cfg.data.redistribute}; all {samples} rows of ~{row} bytes, full length)"
      if reps else ""))
  # The executor moves the batch from the layout of the step before into each step's own.
  for prev, step in zip(plan.steps, plan.steps[1:]):
    if step.move_in is not Move.REPARTITION:
      continue
    where = f"  into {step.node.id} (from {prev.node.id}'s layout): "
    try:
      moved = _repartition_bytes(plan, prev.layout, step.layout, samples, plen + nlen, row,
                                 cfg.rollout.n, cfg.data.redistribute == "centralized")
    except ValueError as e:  # the data plane refuses it as well
      out.append(where + "not sized: " + str(e).split(";")[0])
      continue
    out.append(where + ", ".join(f"process {p} sends {an.fmt(s)} / receives {an.fmt(r)}"
                                 for p, (s, r) in moved.items()))
  return out


def _lora_line(cfg: ml_collections.ConfigDict, model_cfg: ModelConfig, full: float
               ) -> tuple[str, bool]:
  """What a LoRA actor's sync moves a step under its ``rollout.lora_sync`` (whole arrays),
  and whether the base moves once only (``adapters``)."""
  adapters = 4 * an.adapter_params(model_cfg)
  if LoraSync(cfg.rollout.lora_sync) is LoraSync.ADAPTERS:
    return (f"weight sync (rollout.lora_sync=adapters): the adapters' {an.fmt(adapters)} a "
            f"step, merged on the rollout devices; the base's {an.fmt(full)} once, on the "
            f"first sync (none where the rollout layout is the training one)"), True
  return (f"weight sync (rollout.lora_sync=merged): the merged model's {an.fmt(full)} a step "
          f"(rollout.lora_sync=adapters would move the adapters' {an.fmt(adapters)} a step "
          f"after a first sync of the base)"), False


def _repartition_bytes(plan: Plan, src, dst, rows: int, length: int, row_bytes: int,
                       group: int, centralized: bool) -> dict[int, tuple[int, int]]:
  """``process -> (bytes sent, received)`` across hosts of one re-partition: the data
  plane's own plan (data.plan) on the simulated devices, with each device's process taken
  from the plan's topology (the simulation runs in one process)."""

  devs = roles_lib.ordered_devices()

  def layout(lay):
    mesh = sharding.make_mesh({"data": lay.dp_size, "tensor": len(lay.devices) // lay.dp_size},
                              [devs[i] for i in lay.devices])
    return dlayout.Layout(mesh, ("data",))
  rp = make_repartition_plan(np.full(rows, length), layout(src), layout(dst),
                             group_size=group if rows % group == 0 else 1)
  procs = np.array([plan.topology.process_of(devs.index(d)) for d in rp.senders])
  out = {int(p): [0, 0] for p in np.unique(procs)}
  if centralized:  # every sender's rows to the hub's process, every shard's rows back
    hub = int(procs[0])
    for p in procs[procs != hub]:
      out[int(p)][0] += rp.rows_per_sender * row_bytes
      out[int(p)][1] += rp.rows_per_receiver * row_bytes
      out[hub][1] += rp.rows_per_sender * row_bytes
      out[hub][0] += rp.rows_per_receiver * row_bytes
  else:  # one all_to_all: blocks of C rows between devices of different processes
    cross = procs[:, None] != procs[None, :]
    for k, p in enumerate(procs):
      out[int(p)][0] += int(cross[k].sum()) * rp.block * row_bytes
      out[int(p)][1] += int(cross[:, k].sum()) * rp.block * row_bytes
  return {p: (sent, recv) for p, (sent, recv) in out.items()}
