"""Checks a loaded config against the cluster before anything compiles.

``plan_from_config`` validates the DAG, the per-node overrides, the meshes
against the device count, batch sizes against every data-parallel size, the
group size and the lengths, and returns the plan.  Every failure is a
``ConfigError`` or ``DagError`` naming the key or node.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

import ml_collections

from distflow_jax.config.loading import ConfigError
from distflow_jax.dag import planner as planner_lib
from distflow_jax.dag.registry import Placement, Registry, unknown_name_message
from distflow_jax.dag.spec import DagError
from distflow_jax.dag.validate import Dag, build_dag

LOSS_AGG = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
            "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
RATIO_LEVELS = ("token", "sequence")
ON_BAD_ROW = ("skip", "error")


def topology(cfg: ml_collections.ConfigDict, num_processes: int | None = None,
             devices_per_process: int | None = None) -> planner_lib.Topology:
  """The topology to plan for: explicit values win, then config, then jax."""
  np_ = num_processes or cfg.cluster.num_processes
  dpp = devices_per_process or cfg.cluster.devices_per_process
  if not np_ or not dpp:
    import jax  # only when the config leaves it to the runtime
    np_ = np_ or jax.process_count()
    dpp = dpp or jax.local_device_count()
  return planner_lib.Topology(num_processes=int(np_), devices_per_process=int(dpp))


def check_runtime_topology(cfg: ml_collections.ConfigDict, process_count: int,
                           local_device_count: int) -> None:
  """Refuses a config whose cluster block disagrees with the running jax."""
  for key, want, got in (("num_processes", cfg.cluster.num_processes, process_count),
                         ("devices_per_process", cfg.cluster.devices_per_process,
                          local_device_count)):
    if want and want != got:
      raise ConfigError(f"cluster.{key}={want} but this run has {got}; set "
                        f"--config.cluster.{key}={got} or 0 to take it from the runtime")


def load_plugins(cfg: ml_collections.ConfigDict) -> None:
  for mod in cfg.plugins:
    try:
      importlib.import_module(mod)
    except ImportError as e:
      raise ConfigError(f"plugins: cannot import {mod!r}: {e}") from None


def plan_from_config(cfg: ml_collections.ConfigDict, topo: planner_lib.Topology,
                     registry: Registry) -> planner_lib.Plan:
  load_plugins(cfg)
  dag = build_dag(list(cfg.dag), registry, entry=cfg.entry or None)
  _check_overrides(dag, cfg, registry)
  plan = planner_lib.make_plan(dag, registry, topo, placement=_placement_dict(cfg),
                               rollout_tensor_parallel=cfg.rollout.tensor_parallel)
  _check_values(cfg)
  _check_batches(cfg, plan, dag, registry)
  return plan


def _placement_dict(cfg) -> dict:
  return {k: v.to_dict() if isinstance(v, ml_collections.ConfigDict) else dict(v)
          for k, v in cfg.placement.items()}


def _check_overrides(dag: Dag, cfg: ml_collections.ConfigDict, registry: Registry) -> None:
  for node in dag.nodes:
    section = registry.spec(node.fn).section
    base = cfg.get(section)
    for key, value in node.overrides.items():
      where = f"DAG node {node.id!r}: config override {key!r}"
      if base is None or key not in base:
        valid = list(base.keys()) if base is not None else []
        raise DagError(f"{where} is not a key of config.{section}; "
                       + unknown_name_message("key", key, valid).split(". ", 1)[-1])
      current = base[key]
      if isinstance(current, (Mapping, ml_collections.ConfigDict)) != isinstance(value, Mapping):
        raise DagError(f"{where}: {value!r} does not match the shape of config.{section}.{key}")
      if isinstance(current, bool) != isinstance(value, bool) or (
          isinstance(current, (int, float)) and not isinstance(value, (int, float))):
        raise DagError(f"{where}: {value!r} has the wrong type for config.{section}.{key} "
                       f"(currently {current!r})")


def _one_of(value, valid, key: str) -> None:
  if value not in valid:
    raise ConfigError(f"{key}={value!r} is not valid; choose one of {list(valid)}")


def _positive(value, key: str, allow_zero: bool = False) -> None:
  ok = value >= 0 if allow_zero else value > 0
  if not ok:
    raise ConfigError(f"{key}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


def _check_values(cfg) -> None:
  r, a, d = cfg.rollout, cfg.actor, cfg.data
  _positive(r.n, "rollout.n")
  _positive(r.max_new_tokens, "rollout.max_new_tokens")
  _positive(r.max_concurrent_decodes, "rollout.max_concurrent_decodes")
  _positive(r.temperature, "rollout.temperature", allow_zero=True)
  if not 0.0 < r.top_p <= 1.0:
    raise ConfigError(f"rollout.top_p={r.top_p!r} must be in (0, 1]")
  _positive(r.top_k, "rollout.top_k", allow_zero=True)
  _positive(d.max_prompt_len, "data.max_prompt_len")
  _positive(d.prompts_per_step, "data.prompts_per_step")
  _one_of(d.on_bad_row, ON_BAD_ROW, "data.on_bad_row")
  _one_of(d.redistribute, ("distributed", "centralized"), "data.redistribute")
  buckets = list(r.prefill_buckets)
  if not buckets or buckets != sorted(set(buckets)) or buckets[0] <= 0:
    raise ConfigError(f"rollout.prefill_buckets={buckets} must be positive and strictly "
                      f"increasing")
  if buckets[-1] < d.max_prompt_len:
    raise ConfigError(f"rollout.prefill_buckets={buckets}: the largest bucket is smaller "
                      f"than data.max_prompt_len={d.max_prompt_len}")
  total = d.max_prompt_len + r.max_new_tokens
  if total > cfg.model.max_seq_len:
    raise ConfigError(f"data.max_prompt_len + rollout.max_new_tokens = {total} exceeds "
                      f"model.max_seq_len={cfg.model.max_seq_len}")
  _one_of(a.loss_agg, LOSS_AGG, "actor.loss_agg")
  _one_of(a.ratio_level, RATIO_LEVELS, "actor.ratio_level")
  _one_of(a.kl.estimator, KL_ESTIMATORS, "actor.kl.estimator")
  if a.clip_ratio_low < 0 or a.clip_ratio_high < 0:
    raise ConfigError("actor.clip_ratio_low/high must be >= 0")
  if a.kl.target > 0 and not a.kl.in_reward:
    raise ConfigError("actor.kl.target > 0 (adaptive KL) needs actor.kl.in_reward=True: the "
                      "coefficient of a KL loss term is fixed at compile time")
  if a.dual_clip and a.dual_clip <= 1.0:
    raise ConfigError(f"actor.dual_clip={a.dual_clip} must be 0 (off) or > 1")
  for role in ("actor", "critic"):
    _positive(cfg[role].optimizer.lr, f"{role}.optimizer.lr", allow_zero=True)
    _positive(cfg[role].micro_batch_size, f"{role}.micro_batch_size")
    _positive(cfg[role].ppo_epochs, f"{role}.ppo_epochs")
  _positive(a.mini_batches, "actor.mini_batches")


def _check_batches(cfg, plan: planner_lib.Plan, dag: Dag, registry: Registry) -> None:
  n = cfg.rollout.n
  prompts = cfg.data.prompts_per_step
  samples = prompts * n
  for node in dag.nodes:
    if registry.spec(node.fn).needs_groups and n < 2:
      raise ConfigError(f"DAG node {node.id!r} (fn {node.fn!r}) needs prompt groups, but "
                        f"rollout.n={n}; set rollout.n >= 2")
  for step in plan.steps:
    lay = step.layout
    spec = registry.spec(step.node.fn)
    if spec.placement is Placement.ROLLOUT and prompts % lay.dp_size:
      raise ConfigError(
          f"data.prompts_per_step={prompts} does not divide over the {lay.dp_size} rollout "
          f"replicas of node {step.node.id!r}: each replica must get whole prompt groups, "
          f"or a group would be split across hosts")
    if samples % lay.dp_size:
      raise ConfigError(
          f"the step's {samples} samples (data.prompts_per_step={prompts} x rollout.n={n}) "
          f"do not divide by the data-parallel size {lay.dp_size} of node "
          f"{step.node.id!r} ({lay.name})")
    if step.node.role is not None and step.node.type.value == "MODEL_TRAIN":
      section = cfg[spec.section]
      per_shard = samples // lay.dp_size
      mini = section.get("mini_batches", 1)
      if per_shard % mini:
        raise ConfigError(f"{spec.section}.mini_batches={mini} does not divide the "
                          f"{per_shard} samples per data-parallel shard of node "
                          f"{step.node.id!r}")
      if (per_shard // mini) % section.micro_batch_size:
        raise ConfigError(
            f"{spec.section}.micro_batch_size={section.micro_batch_size} does not divide "
            f"the {per_shard // mini} samples per shard and mini-batch of node "
            f"{step.node.id!r} ({samples} samples / dp {lay.dp_size} / {mini} mini-batches)")
