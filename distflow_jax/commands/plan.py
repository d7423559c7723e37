"""``distflow-jax plan``: print the execution plan of a config.

  distflow-jax plan --config=configs/grpo.py:tiny [--process=N] [--num_processes=P]
      [--devices_per_process=D] [--memory [--device_memory=80GB [--target=h100]]
      [--memory_source=analytic]]
      [--lower=h100|a100|tpu|...] [--programs]

Without ``--config`` it plans ``grpo:tiny``, as ``train`` runs it.  Plans for the flags,
else the config's cluster block, else the running jax (``--memory``, ``--lower`` and
``--programs``: else 1 process x 1 device, said on the first line);
``--process`` prints only that process's portion.  ``--memory`` adds each role's and
node's bytes per device and the traffic per step, compiled on
simulated CPU devices of the target topology; it needs only the model's config.json.
``--device_memory`` refuses a plan that does not fit what jax can use of a device of
that size on ``--target`` (default a GPU): on a GPU the share its allocator takes
(``XLA_CLIENT_MEM_FRACTION``, or the deprecated ``XLA_PYTHON_CLIENT_MEM_FRACTION``, as set
in this environment, else 0.75) less a 1 GiB reserve for cuBLAS/cuDNN workspaces and
NCCL buffers; on a TPU all of it less 0.5 GiB for the runtime; on a CPU all of it.
``--lower=<target>`` builds every program a run of the config compiles (passes, train
steps, rollout engine, weight sync, re-partitions, checksums, warm start) on abstract
shapes of the same simulated topology and lowers each for the target device (h100, a100,
tpu, ...), a row per program with the attention kernel it got; a
program that cannot be built for the target is refused in one line.  ``--programs``
counts the programs a run compiles before step 2 (the same catalogue), by node; a run
logs the number it built as ``compile/programs``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from absl import flags

from distflow_jax import distributed
from distflow_jax.commands import with_default_config
from distflow_jax.config import async_checks, checks, loading, temperature
from distflow_jax.dag import FUNCTIONS, render


def run(argv: Sequence[str]) -> int:

  fv = flags.FlagValues()
  flags.DEFINE_integer("process", None, "print only this process's portion", flag_values=fv)
  flags.DEFINE_integer("num_processes", None, "plan for this many processes "
                       "(default: config.cluster, else the running jax)", flag_values=fv)
  flags.DEFINE_integer("devices_per_process", None, "plan for this many devices per process",
                       flag_values=fv)
  flags.DEFINE_boolean("memory", False, "add per-device memory and traffic per step",
                       flag_values=fv)
  flags.DEFINE_string("device_memory", None, "with --memory: refuse a plan that does not "
                      "fit this much per device (80GB, 96GiB, ...)", flag_values=fv)
  flags.DEFINE_string("target", None, "with --device_memory: the device kind (h100, a100, "
                      "h200, tpu, cpu, ...; default a GPU), which sets how much of it jax "
                      "can use", flag_values=fv)
  flags.DEFINE_enum("memory_source", "compiled", ["compiled", "analytic"], "with --memory: "
                    "compile the real steps abstractly, or the analytic model (fast, big "
                    "models)", flag_values=fv)
  flags.DEFINE_boolean("programs", False, "count the programs a run compiles before step 2, "
                       "by node (on abstract shapes)", flag_values=fv)
  flags.DEFINE_string("lower", None, "lower every program of a run for this device "
                      "(h100, a100, tpu, ...) on abstract shapes", flag_values=fv)
  rest = loading.parse(fv, with_default_config(argv, "grpo:tiny"))  # as train: grpo:tiny
  if rest:
    raise loading.ConfigError(f"plan takes no positional arguments, got {rest}")
  cfg = fv.config
  if not fv.memory and (fv.device_memory is not None or fv["memory_source"].present
                        or fv.target is not None):
    raise loading.ConfigError("--device_memory, --target and --memory_source go with "
                              "--memory; add --memory")
  num_processes, devices_per_process = fv.num_processes, fv.devices_per_process
  if fv.memory or fv.lower is not None or fv.programs:  # before jax is imported
    num_processes, devices_per_process = _simulate_devices(cfg, num_processes,
                                                           devices_per_process)
  target = None
  if fv.lower is not None:
    from distflow_jax.models import target as target_lib
    try:
      target = target_lib.parse(fv.lower)
    except ValueError as e:
      raise loading.ConfigError(f"--lower: {e}") from None
  topo = checks.topology(cfg, num_processes, devices_per_process)
  plan = checks.plan_from_config(cfg, topo, FUNCTIONS)
  temperature.check_training(cfg, plan, FUNCTIONS)
  from distflow_jax.state import roles
  roles.model_config_before_weights(cfg)  # the model's checks, as train makes them
  if fv.process is not None and not 0 <= fv.process < topo.num_processes:
    raise loading.ConfigError(f"--process={fv.process} is out of range: the plan has "
                              f"{topo.num_processes} process(es)")
  print(f"config: {cfg.name}")
  print(render(plan, fv.process))
  _print_process_split(cfg, plan)
  lo = cfg.model.lora
  if lo.enabled:
    print(f"lora: rank {lo.rank} adapters on {list(lo.targets)} train (the base is frozen); "
          f"reference parameters: none (its pass runs the actor's base, adapters off)")
  if fv.memory:
    from distflow_jax.memory import report
    report.run(cfg, plan, fv.device_memory, fv.memory_source, fv.target)
  if fv.programs:
    _count(cfg, plan)
  if target is not None:
    _lower(cfg, plan, target)
  return 0


def _print_process_split(cfg, plan) -> None:
  """An asynchronous run on disjoint processes: the two groups and a weight sync's bytes."""
  from distflow_jax.memory import analytic, report
  split = async_checks.process_split(plan)
  if split is None:
    return
  whole = analytic.param_bytes(report.model_shape(cfg))
  replicas = len(plan.steps[0].layout.devices) // plan.rollout_tensor_parallel
  r = len(plan.steps[0].layout.devices)
  a = len(next(m for m in plan.meshes if m.role.value.lower() == "actor").devices)
  if r > a:  # run/links.py: one copy onto each block of a rollout devices
    how = (f"{r // a} times ({analytic.fmt(whole * (r // a))}), once onto each block of {a} "
           f"of the {r} rollout devices")
  elif a > r:
    how = (f"once, from {r} of the actor's {a} devices (the actor gathered into blocks of {r} "
           f"devices on the training side first)")
  else:
    how = ("once (each training device's shards to its rollout device; a parameter the "
           "actor replicates, once per copy)")
  print(f"async on disjoint processes: rollout on processes {list(split.rollout)}, training "
        f"on processes {list(split.training)}; each weight sync copies the actor's "
        f"{analytic.fmt(whole)} across {how}, then each of the {replicas} rollout replica(s) "
        f"gathers its whole copy ({analytic.fmt(whole)} per replica) inside the rollout "
        f"processes")


def _count(cfg, plan) -> None:
  """Prints how many programs a run compiles before step 2 (lowering/count.py)."""
  from distflow_jax.lowering import abstract, catalogue, count
  ctx = abstract.abstract_context(cfg, plan, abstract.model_shape(cfg))
  print(count.render(count.count(catalogue.programs(cfg, plan, ctx))), flush=True)


def _lower(cfg, plan, target) -> None:
  """Lowers every program of a run for ``target`` (see the module docstring)."""

  from distflow_jax.lowering import abstract, catalogue, gate
  t0 = time.perf_counter()
  print(f"programs of a run, lowered for {target.name} ({target.platform.value}"
        + (f", compute capability {target.compute_capability[0]}."
           f"{target.compute_capability[1]}, cuDNN {target.cudnn_version}"
           if target.is_cuda else "") + "):", flush=True)
  print(gate.HEADER, flush=True)
  def build():  # for the target: the model's checks and the engine's shapes depend on it
    ctx = abstract.abstract_context(cfg, plan, abstract.model_shape(cfg))
    return catalogue.programs(cfg, plan, ctx)
  cat, rows = gate.lower_all(build, target,
                             on_row=lambda r: print(gate.render_row(r), flush=True))
  for note in cat.notes:
    print(f"  note: {note}")
  print(gate.summary(rows, target, time.perf_counter() - t0), flush=True)
  gate.check(rows, target)


def _simulate_devices(cfg, num_processes: int | None, devices_per_process: int | None
                      ) -> tuple[int, int]:
  """The target topology (the flags, else the config's cluster block, else 1 x 1, said in one
  line) as simulated CPU devices, before jax is imported."""
  np_ = num_processes or cfg.cluster.num_processes
  dpp = devices_per_process or cfg.cluster.devices_per_process
  where = ("the flags" if num_processes or devices_per_process else
           "the config's cluster block" if np_ or dpp else "the default")
  np_, dpp = int(np_ or 1), int(dpp or 1)
  print(f"topology: {np_} process(es) x {dpp} device(s) ({where}; --num_processes and "
        f"--devices_per_process set another)", flush=True)
  distributed.simulate_cpu_devices(np_ * dpp)
  return np_, dpp
