"""Checks a loaded config against the cluster before anything compiles.

``plan_from_config`` validates the DAG, the per-node overrides, the meshes
against the device count, batch sizes against every data-parallel size, the
group size and the lengths, and returns the plan.  Every failure is a
``ConfigError`` or ``DagError`` naming the key or node.
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_collections

from distflow_jax.config import (async_checks, consistency, env_checks, lora_checks, user_modules,
                                 validators, values, vision_checks)
from distflow_jax.config.errors import ConfigError
from distflow_jax.config.response import longest_sample, response_width_key
from distflow_jax.dag import planner as planner_lib, replicas
from distflow_jax.dag.registry import Placement, Registry, unknown_name_message
from distflow_jax.dag.rules import (check_baseline_rewards, check_kl_reference,
                                    check_off_policy_logprobs)
from distflow_jax.dag.spec import DagError, NodeType, Role
from distflow_jax.dag.validate import Dag, build_dag
from distflow_jax.rewards.registry import reward_names


def topology(cfg: ml_collections.ConfigDict, num_processes: int | None = None,
             devices_per_process: int | None = None) -> planner_lib.Topology:
  """The topology to plan for: explicit values win, then config, then jax."""
  for where, value in (("--num_processes", num_processes),
                       ("--devices_per_process", devices_per_process),
                       ("cluster.num_processes", cfg.cluster.num_processes),
                       ("cluster.devices_per_process", cfg.cluster.devices_per_process)):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 0):
      raise ConfigError(f"{where}={value!r} must be a whole number >= 1 (0 in the config "
                        f"= take it from the running jax)")
    if value == 0 and where.startswith("--"):
      raise ConfigError(f"{where}=0 must be >= 1")
  np_ = num_processes or cfg.cluster.num_processes
  dpp = devices_per_process or cfg.cluster.devices_per_process
  if not np_ or not dpp:
    import jax  # only when the config leaves it to the runtime
    np_ = np_ or jax.process_count()
    dpp = dpp or jax.local_device_count()
  return planner_lib.Topology(num_processes=int(np_), devices_per_process=int(dpp))


def check_runtime_topology(cfg: ml_collections.ConfigDict, process_count: int,
                           local_device_count: int) -> None:
  """Refuses a config whose cluster block disagrees with the running jax, or that differs
  from another process's (a collective when there are several processes)."""
  if process_count > 1:
    consistency.check_same_config(cfg)
  for key, want, got in (("num_processes", cfg.cluster.num_processes, process_count),
                         ("devices_per_process", cfg.cluster.devices_per_process,
                          local_device_count)):
    if want and want != got:
      raise ConfigError(f"cluster.{key}={want} but this run has {got}; set "
                        f"--config.cluster.{key}={got} or 0 to take it from the runtime")


def load_plugins(cfg: ml_collections.ConfigDict) -> None:
  for mod in cfg.plugins:
    try:
      user_modules.import_user_module(mod)
    except ImportError as e:
      raise ConfigError(f"plugins: cannot import {mod!r}: {e} (a module name, importable or a "
                        f".py file in the working directory, or a path to a .py file)") from None


def plan_from_config(cfg: ml_collections.ConfigDict, topo: planner_lib.Topology,
                     registry: Registry) -> planner_lib.Plan:
  load_plugins(cfg)
  if not isinstance(cfg.dag, (list, tuple)):
    raise ConfigError(f"dag must be a list of node dicts (id, fn, deps, ...), got "
                      f"{type(cfg.dag).__name__}; see configs/grpo.py")
  dag = build_dag(list(cfg.dag), registry, entry=cfg.entry or None)
  _check_overrides(dag, cfg, registry)
  plan = planner_lib.make_plan(dag, registry, topo, placement=_placement_dict(cfg),
                               rollout_tensor_parallel=cfg.rollout.tensor_parallel)
  check_kl_reference(plan.steps, registry, cfg.actor.kl.coef, cfg.actor.kl.in_reward)
  values.check_values(cfg)
  validators.one_of(cfg.trainer.eval_reward, reward_names(), "trainer.eval_reward")
  from distflow_jax.algos import policy_losses  # after the plugins: theirs count
  validators.one_of(cfg.actor.policy_loss, policy_losses.names(), "actor.policy_loss")
  try:
    policy_losses.check(cfg.actor.policy_loss, dict(cfg.actor.loss_args),
                        cfg.actor.ratio_level)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  async_checks.check(cfg, plan)
  env_checks.check(cfg)
  if cfg.critic.warmup_steps and not any(n.fn == "train.critic" for n in dag.nodes):
    raise ConfigError(f"critic.warmup_steps={cfg.critic.warmup_steps} but no train.critic node "
                      f"trains a critic; set it to 0 or add the critic to the DAG")
  _check_node_values(dag, cfg, registry)
  lora_checks.check_critic(cfg, any(n.fn == "train.critic" for n in dag.nodes))
  check_off_policy_logprobs(plan.steps, registry, cfg.actor.off_policy.correction)
  check_baseline_rewards(plan.steps, registry)
  _check_batches(cfg, plan, dag, registry)
  _check_spanning_replicas(cfg, plan, registry)
  return plan


def _check_spanning_replicas(cfg: ml_collections.ConfigDict, plan: planner_lib.Plan,
                             registry: Registry) -> None:
  """A rollout replica across hosts (dag/replicas.py) pools its processes' prompts; what
  cannot be pooled yet is refused, naming the key to change.  Each rollout node with its own overrides is checked as it
  will run, its ``tensor_parallel`` too (the plan checked the global one)."""
  actor = next((m.devices for m in plan.meshes if m.role is Role.ACTOR), None)
  for step in plan.steps:
    if registry.spec(step.node.fn).placement is not Placement.ROLLOUT:
      continue
    r = node_section(cfg, step.node, registry)  # the rollout section as the node runs it
    where = f"DAG node {step.node.id!r}: " if step.node.overrides else ""
    tp = r.tensor_parallel
    try:
      on = "actor" if step.layout.devices == actor else "placement.rollout"
      groups = replicas.replica_groups(step.layout.devices, tp, plan.topology.process_of, on)
    except DagError as e:
      raise DagError(where + str(e)) from None
    if not replicas.spans_hosts(groups):
      continue
    images = vision_checks.run_image_key(cfg)
    blocked = (("a vision-language run", bool(images),
                f"images ({images!r}) take the reference backend, which does not pool prompts"),
               ("rollout.backend", r.backend != "engine",
                f"{r.backend!r}: only the engine backend pools prompts; set it to engine"),
               ("rollout.env", bool(r.env),
                "multi-turn episodes are not pooled yet; unset it"))
    for key, hit, why in blocked:
      if hit:
        raise ConfigError(f"{where}rollout.tensor_parallel={tp} makes a replica span hosts, "
                          f"which {key} does not take: {why}, or keep tensor_parallel inside "
                          f"a host")


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
          isinstance(current, (int, float)) and not isinstance(value, (int, float))) or (
          isinstance(current, str) != isinstance(value, str)):
        raise DagError(f"{where}: {value!r} has the wrong type for config.{section}.{key} "
                       f"(currently {current!r})")


def node_section(cfg: ml_collections.ConfigDict, node, registry: Registry
                 ) -> ml_collections.ConfigDict:
  """The config section of the node's function with the node's overrides applied, as the
  run sees it (``RunContext.section``)."""
  section = registry.spec(node.fn).section
  base = cfg[section]
  if not node.overrides:
    return base
  merged = ml_collections.ConfigDict(base.to_dict())
  merged.lock()  # a nested key that does not exist (kl=dict(cof=...)) is refused too
  try:
    merged.update(dict(node.overrides))
  except (TypeError, ValueError, KeyError, AttributeError) as e:
    msg = str(e.args[0] if e.args else e).splitlines()[0]
    raise DagError(f"DAG node {node.id!r}: config overrides {dict(node.overrides)} do not "
                   f"apply to config.{section}: {msg}") from None
  return merged


def _check_node_values(dag: Dag, cfg: ml_collections.ConfigDict, registry: Registry) -> None:
  """Each node's effective config (the global one with the node's overrides) passes the
  checks of the global one."""
  for node in dag.nodes:
    if not node.overrides:
      continue
    section = registry.spec(node.fn).section
    effective = cfg.copy_and_resolve_references()
    with effective.unlocked():
      effective[section] = node_section(cfg, node, registry)
    where = f"DAG node {node.id!r} (config={dict(node.overrides)})"
    try:
      values.check_values(effective)
    except ConfigError as e:
      raise ConfigError(f"{where}: {e}") from None
    if section == "rollout" and effective.rollout.n != cfg.rollout.n:
      raise ConfigError(f"{where}: rollout.n={effective.rollout.n} differs from the global "
                        f"rollout.n={cfg.rollout.n} that the rest of the DAG groups and sizes "
                        f"batches by; set --config.rollout.n={effective.rollout.n} instead")


def check_group_sampling(cfg, plan: planner_lib.Plan, registry: Registry) -> None:
  """For training (not eval / generate, which may decode greedily): a group estimator
  compares the samples of one prompt, and greedy decoding (temperature 0, or top_k 1) makes
  them one answer n times, every advantage 0 and every step a no-op.  An environment
  (rollout.env) may still make them differ, so it is let through."""
  nodes = [s.node for s in plan.steps]
  group = next((nd for nd in nodes if registry.spec(nd.fn).needs_groups), None)
  if group is None:
    return
  for node in nodes:
    if registry.spec(node.fn).section != "rollout":
      continue
    r = node_section(cfg, node, registry)
    if r.env:
      continue
    greedy = ("rollout.temperature=0" if float(r.temperature) == 0
              else "rollout.top_k=1" if int(r.top_k) == 1 else None)
    if greedy is not None:
      raise ConfigError(
          f"{greedy} (greedy) on rollout node {node.id!r} gives every one of a prompt's "
          f"rollout.n={cfg.rollout.n} samples the same answer, so {group.fn!r} (node "
          f"{group.id!r}) compares equal rewards: every advantage is 0 and nothing trains; "
          f"sample (e.g. rollout.temperature=1.0, rollout.top_k=0)")


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
    if step.node.role is not None and step.node.type is NodeType.MODEL_TRAIN:
      section = node_section(cfg, step.node, registry)
      per_shard = samples // lay.dp_size
      mini = section.mini_batches if "mini_batches" in section else 1  # the critic: none
      if per_shard % mini:
        raise ConfigError(f"{spec.section}.mini_batches={mini} does not divide the "
                          f"{per_shard} samples per data-parallel shard of node "
                          f"{step.node.id!r}")
      budget = section.micro_batch_tokens
      by_rows = not budget  # else micro-batches by tokens
      if budget:
        _check_token_budget(cfg, f"{spec.section}.micro_batch_tokens", budget, step.node.id,
                            per_shard // mini)
      if by_rows and (per_shard // mini) % section.micro_batch_size:
        raise ConfigError(
            f"{spec.section}.micro_batch_size={section.micro_batch_size} does not divide "
            f"the {per_shard // mini} samples per shard and mini-batch of node "
            f"{step.node.id!r} ({samples} samples / dp {lay.dp_size} / {mini} mini-batches)")


def _check_token_budget(cfg, key: str, budget: int, node_id: str, per_mini: int) -> None:
  """A token budget between the longest sample (a sample is never split across
  micro-batches) and everything one shard's mini-batch can hold: below it every long sample
  sits alone in its own micro-batch (a step of one micro-batch per sample), above it each
  micro-batch allocates ``ceil(budget / pack_len)`` packed rows that no data could fill."""
  longest = longest_sample(cfg)
  most = per_mini * longest
  where = f"node {node_id!r}"
  if budget < longest:
    raise ConfigError(
        f"{key}={budget} is below the longest sample, data.max_prompt_len + "
        f"{response_width_key(cfg.rollout)} - 1 = {longest} tokens ({where}); a sample is not "
        f"split "
        f"across micro-batches, so raise it to at least {longest}")
  if budget > most:
    raise ConfigError(
        f"{key}={budget} is more than one micro-batch could ever hold at {where}: its "
        f"{per_mini} samples per shard and mini-batch x {longest} tokens = {most}; each "
        f"micro-batch would allocate rows for {budget} tokens, so set it to at most {most}")
