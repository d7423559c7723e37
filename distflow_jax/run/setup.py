"""The one run set-up behind every command that runs a model (train, eval, generate, sft).

    run = prepare_run(cfg, roles="actor", log=log)      # eval / generate: weights only
    run = prepare_run(cfg, roles="all", warm_start=True, check_inputs=check_data, log=log)
    ctx = run.ctx                                       # RunContext for nodes and engines

The steps run cheapest first, so a mistake in the config or the inputs fails
in seconds instead of after weights were loaded or a warm start was trained:

1. the topology: the config's cluster block against the running jax (and
   against the other processes' configs), the plan, and -- with
   ``roles="all"``, when the plan will be executed -- that every node spans
   every host; the plan's node functions are bound then too;
2. the model folder, when ``model.path`` is set: config.json, safetensors
   and tokenizer files are checked before any weight is read;
3. the tokenizer, then the caller's own input checks (``check_inputs``);
4. the model: ``model.path``, else the built-in ``model.preset``, warm-started
   on the built-in task with ``warm_start=True`` (see warmstart.py) or fresh
   from ``seed``;
5. the roles, on their meshes from the plan: the actor alone
   (``roles="actor"``: no optimizer, reference, critic or reward model) or
   every role the plan places, with optimizers for the trained ones
   (``roles="all"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import ml_collections
from flax import nnx

from distflow_jax import nodes
from distflow_jax.config import async_checks, checks, loading, temperature
from distflow_jax.config.errors import ConfigError
from distflow_jax.dag import FUNCTIONS
from distflow_jax.dag.planner import Plan, Topology
from distflow_jax.dag.spec import Role
from distflow_jax.observe import hints
from distflow_jax.state import roles as roles_lib, vision
from distflow_jax.state.context import RunContext
from distflow_jax.warmstart import text as warmstart, vl as vl_warmstart

RoleSet = Literal["all", "actor"]
ROLE_SETS: tuple[str, ...] = ("all", "actor")


@dataclasses.dataclass
class PreparedRun:
  """What ``prepare_run`` built: the context, and where its weights came from."""
  ctx: RunContext
  # The Hugging Face directory the actor was loaded from ("" = the built-in preset, fresh).
  model_path: str
  # What ``check_inputs`` returned (None without one), e.g. the trainer's dataset paths.
  inputs: Any = None

  @property
  def plan(self) -> Plan:
    return self.ctx.plan

  @property
  def topo(self) -> Topology:
    return self.ctx.topo


def check_plan_spans_hosts(plan: Plan, topo: Topology) -> None:
  """Refuses a plan with a node on only some hosts: the executor runs every node on every
  process, so such a placement cannot be executed yet (it can be planned).  An
  asynchronous run's rollout on processes of its own is the exception (run/disjoint.py;
  config/async_checks.py checks it)."""
  if async_checks.process_split(plan) is not None:
    return
  for s in plan.steps:
    procs = {topo.process_of(d) for d in s.layout.devices}
    if len(procs) != topo.num_processes:
      raise ConfigError(f"node {s.node.id!r} runs on devices of processes {sorted(procs)} "
                        f"only; executing a placement that leaves out whole hosts is not "
                        f"implemented yet (plan it with `distflow-jax plan`)")


def _actor_only(cfg: ml_collections.ConfigDict, plan: Plan, model_cfg, model_path: str
                ) -> dict[Role, roles_lib.ModelState]:
  mesh = roles_lib.jax_mesh(next(m for m in plan.meshes if m.role is Role.ACTOR))
  actor = roles_lib.build_actor(model_cfg, mesh, model_path, cfg.seed)
  roles_lib.start_adapters(cfg, actor)
  graphdef, params = nnx.split(actor)
  return {Role.ACTOR: roles_lib.ModelState(Role.ACTOR, mesh, graphdef, params)}


def prepare_run(cfg: ml_collections.ConfigDict, *, roles: RoleSet = "all",
                warm_start: bool = False, check_inputs: Callable[[], Any] | None = None,
                log: Callable[[str], None] = print) -> PreparedRun:
  """Checks the config against this machine, loads or builds the model and returns the run's
  context (see the module doc for the steps and options).  Every process calls it with
  the same config; config and input mistakes raise ConfigError."""
  if roles not in ROLE_SETS:
    raise ValueError(f"prepare_run(roles={roles!r}): valid: {list(ROLE_SETS)}")
  checks.check_runtime_topology(cfg, jax.process_count(), jax.local_device_count())
  topo = checks.topology(cfg)
  plan = checks.plan_from_config(cfg, topo, FUNCTIONS)
  roles_lib.check_topology(topo)
  if roles == "all":
    temperature.check_training(cfg, plan, FUNCTIONS)
    check_plan_spans_hosts(plan, topo)
    nodes.bind_builtins()
  if cfg.model.path == vl_warmstart.BUILTIN:
    # The built-in tiny VL model: made and warm-started now (or cached); from here on the
    # run loads that folder as any Qwen2.5-VL checkpoint (the context's config says so; the
    # caller's is not changed).
    cfg = loading.with_values(cfg, {"model.path": vl_warmstart.ensure_model(cfg, log)})
  if cfg.model.path:
    # Tokenizer files included: a folder without one fails here, before weights are read.
    hints.check_model_dir(cfg.model.path)
  tokenizer = roles_lib.load_tokenizer(cfg.model)
  inputs = check_inputs() if check_inputs is not None else None
  model_path = (warmstart.ensure_model(cfg, plan, tokenizer, log) if warm_start
                else cfg.model.path)
  model_cfg = roles_lib.model_config(cfg, tokenizer, model_path)
  if roles == "all":
    states = roles_lib.build_roles(cfg, plan, model_cfg, model_path, tokenizer)
  else:
    states = _actor_only(cfg, plan, model_cfg, model_path)
  enc = vision.run_encoder(cfg, model_path)
  ctx = RunContext(cfg=cfg, plan=plan, topo=topo, process_index=jax.process_index(),
                   tokenizer=tokenizer, model_cfg=model_cfg, roles=states, vision=enc)
  return PreparedRun(ctx=ctx, model_path=model_path, inputs=inputs)
