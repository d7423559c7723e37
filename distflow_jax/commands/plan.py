"""``distflow-jax plan``: print the execution plan of a config.

  distflow-jax plan --config=configs/grpo.py:tiny [--process=N] [--num_processes=P]
      [--devices_per_process=D]

Plans for the config's cluster block, else the flags, else the running jax;
``--process`` prints only that process's portion.
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import flags

from distflow_jax.config import loading


def run(argv: Sequence[str]) -> int:
  from distflow_jax.config import checks
  from distflow_jax.dag import FUNCTIONS, render

  fv = flags.FlagValues()
  flags.DEFINE_integer("process", None, "print only this process's portion", flag_values=fv)
  flags.DEFINE_integer("num_processes", None, "plan for this many processes "
                       "(default: config.cluster, else the running jax)", flag_values=fv)
  flags.DEFINE_integer("devices_per_process", None, "plan for this many devices per process",
                       flag_values=fv)
  rest = loading.parse(fv, argv)
  if rest:
    raise loading.ConfigError(f"plan takes no positional arguments, got {rest}")
  cfg = fv.config
  topo = checks.topology(cfg, fv.num_processes, fv.devices_per_process)
  plan = checks.plan_from_config(cfg, topo, FUNCTIONS)
  if fv.process is not None and not 0 <= fv.process < topo.num_processes:
    raise loading.ConfigError(f"--process={fv.process} is out of range: the plan has "
                              f"{topo.num_processes} process(es)")
  print(f"config: {cfg.name}")
  print(render(plan, fv.process))
  return 0
