"""What ``trainer.max_staleness = K > 0`` (asynchronous RL, run/async_rollout.py) needs.

* the chain starts with its rollout stage: the steps on the rollout layout before the
  first re-partition (``generate`` and host-side nodes such as rewards and GRPO's group
  advantages); the rollout thread runs them, the trainer the rest;
* the rollout's devices (``placement.rollout.devices``) are none of the rest's: on shared
  devices nothing overlaps;
* one process: the rollout thread's collectives (the weight sync) would otherwise race
  the trainer's across processes, in no fixed order (a deadlock);
* no dynamic sampling (its refills run the rollout stage again inside a step);
* no multi-turn episodes (``rollout.env``): not built with it yet.

Each refusal is one line naming the setting to change.
"""

from __future__ import annotations

import ml_collections

from distflow_jax.config.loading import ConfigError
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


def check(cfg: ml_collections.ConfigDict, plan: Plan) -> None:
  """Refuses, in one line, a config that ``trainer.max_staleness`` cannot run."""
  k = cfg.trainer.get("max_staleness", 0)
  if not k:
    return
  name = f"trainer.max_staleness={k}"
  if plan.topology.num_processes > 1:
    raise ConfigError(f"{name} runs in one process only (the rollout thread's weight sync "
                      f"would race the trainer's collectives across processes); use "
                      f"--num_processes=1 or trainer.max_staleness=0")
  if cfg.rollout.get("env", ""):
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
