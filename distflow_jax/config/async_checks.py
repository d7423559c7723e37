"""What ``trainer.max_staleness = K > 0`` (asynchronous RL, run/async_rollout.py) needs.

* the chain starts with its rollout stage: the steps on the rollout layout before the
  first re-partition (``generate`` and host-side nodes such as rewards and GRPO's group
  advantages); the rollout thread runs them, the trainer the rest;
* the rollout's devices (``placement.rollout.devices``) are none of the rest's: on shared
  devices nothing overlaps;
* one process, or processes split between the two stages (``process_split``: the
  rollout's devices are whole processes' own, the training runs on the others; the
  stages then talk through transfers in a fixed order, run/disjoint.py).  A process that
  does both would run the rollout thread's collectives (the weight sync) beside the
  trainer's across processes, in no fixed order (a deadlock).  On disjoint processes each
  transfer is a device-to-device copy in blocks of the smaller group's size, so of the
  rollout's, the actor's and the first training node's device counts, each pair is a
  multiple one of the other (run/links.py); the rollout processes evaluate
  (run/disjoint.py).
  K = 0 there is the synchronous loop through the same transfers (version j makes batch j);
* no dynamic sampling (its refills run the rollout stage again inside a step);
* no multi-turn episodes (``rollout.env``): not built with it yet.

Each refusal is one line naming the setting to change.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections

from distflow_jax.config.errors import ConfigError
from distflow_jax.dag.planner import LayoutKind, Move, Plan


def rollout_stage(plan: Plan) -> int:
  """How many leading steps of the chain form the rollout stage (0: it has none)."""
  steps = plan.steps
  if not steps or steps[0].layout.kind is not LayoutKind.ROLLOUT:
    return 0
  n = 1
  while n < len(steps) and steps[n].move_in is Move.FAST and steps[n].layout == steps[0].layout:
    n += 1
  return n


@dataclasses.dataclass(frozen=True)
class ProcessSplit:
  """An asynchronous run on disjoint processes: who runs the rollout stage, who trains."""
  rollout: tuple[int, ...]
  training: tuple[int, ...]


def process_split(plan: Plan) -> ProcessSplit | None:
  """The rollout stage's processes and the rest's when no process takes part in both,
  else None (every process runs every stage, or the chain has no rollout stage)."""
  n = rollout_stage(plan)
  if n == 0 or n == len(plan.steps) or plan.topology.num_processes == 1:
    return None
  topo = plan.topology
  rollout = {topo.process_of(d) for d in plan.steps[0].layout.devices}
  training = {topo.process_of(d) for s in plan.steps[n:] for d in s.layout.devices}
  if rollout & training:
    return None
  return ProcessSplit(tuple(sorted(rollout)), tuple(sorted(training)))


def ratio(a: int, b: int) -> int | None:
  """``max / min`` of two device counts when one is a multiple of the other, else None."""
  big, small = max(a, b), min(a, b)
  return big // small if small and big % small == 0 else None


def _check_split(cfg: ml_collections.ConfigDict, plan: Plan, split: ProcessSplit,
                 name: str) -> None:
  topo = plan.topology
  idle = sorted(set(range(topo.num_processes)) - set(split.rollout) - set(split.training))
  if idle:
    raise ConfigError(f"{name}: processes {idle} run neither the rollout nor the training; "
                      f"give their devices to placement.rollout.devices or a role")
  n = rollout_stage(plan)
  rollout = len(plan.steps[0].layout.devices)
  actor = next(m for m in plan.meshes if m.role.value.lower() == "actor")
  first = plan.steps[n]
  # Batches and weights move in blocks of the smaller group's size (run/links.py).
  for what, count in (("the actor (placement.actor.devices)", len(actor.devices)),
                      (f"node {first.node.id!r}", len(first.layout.devices))):
    if ratio(rollout, count) is None:
      raise ConfigError(
          f"{name} on disjoint processes: placement.rollout.devices holds {rollout} devices "
          f"but {what} {count}; weights and batches move in blocks of the smaller count, so "
          f"one must be a multiple of the other (e.g. {rollout} and {rollout * 2})")
  t = len(first.layout.devices)
  rows = cfg.data.prompts_per_step * cfg.rollout.n
  step = max(rollout, t) // math.gcd(max(rollout, t), cfg.rollout.n)
  if t != rollout and rows % max(rollout, t):
    raise ConfigError(
        f"{name} on disjoint processes: a batch's {rows} rows (data.prompts_per_step x "
        f"rollout.n) do not split over {max(rollout, t)} devices, which the move from the "
        f"rollout's {rollout} devices to node {first.node.id!r}'s {t} needs; make "
        f"data.prompts_per_step a multiple of {step}")


def check(cfg: ml_collections.ConfigDict, plan: Plan) -> None:
  """Refuses, in one line, a config that ``trainer.max_staleness`` cannot run."""
  k = cfg.trainer.max_staleness
  split = process_split(plan)
  if not k and split is None:
    return
  # K = 0 on disjoint processes: the synchronous loop through the same transfers.
  name = (f"trainer.max_staleness={k}" if k else
          "a rollout on processes of its own (placement.rollout.devices)")
  if plan.topology.num_processes > 1 and split is None:
    raise ConfigError(f"{name} on {plan.topology.num_processes} processes needs the rollout "
                      f"on processes of its own (the rollout thread's weight sync would race "
                      f"the trainer's collectives on a process that does both): set "
                      f"placement.rollout.devices to whole processes' devices and every "
                      f"role's devices to the others, or use --num_processes=1")
  if split is not None:
    _check_split(cfg, plan, split, name)
  if cfg.rollout.env:
    raise ConfigError(f"{name} with multi-turn episodes (rollout.env={cfg.rollout.env!r}) is "
                      f"not built yet (in-flight episodes are not saved with checkpoints); "
                      f"set trainer.max_staleness=0 or rollout.env=''")
  if cfg.algo.dynamic_sampling_tries:
    raise ConfigError(f"{name} does not work with algo.dynamic_sampling_tries="
                      f"{cfg.algo.dynamic_sampling_tries}; set one of them to 0")
  n = rollout_stage(plan)
  if n == 0 or n == len(plan.steps):
    raise ConfigError(f"{name}: the DAG must start with a rollout node (generate) followed "
                      f"by training on other devices; this chain is "
                      f"{[s.node.id for s in plan.steps]}")
  rollout = set(plan.steps[0].layout.devices)
  for s in plan.steps[n:]:
    shared = sorted(rollout & set(s.layout.devices))
    if shared:
      raise ConfigError(
          f"{name}: node {s.node.id!r} runs on devices {shared} that the rollout "
          f"(placement.rollout.devices) also uses, so nothing can overlap; give them "
          f"disjoint devices, e.g. --config.placement.rollout.devices=0:4 and "
          f"--config.placement.<role>.devices=4:8 for every role")
