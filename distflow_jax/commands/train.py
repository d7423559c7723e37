"""``distflow-jax train``: the RL run of a config, resumable.

  distflow-jax train [--config=configs/grpo.py:tiny] [--resume|--noresume]
      [--distributed=env|auto|none] [--config.x=y ...]

Without ``--config`` it runs the built-in default (``grpo:tiny``).  A dead
peer or running out of memory ends the run with one line saying so (exit 1).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import flags

from distflow_jax.commands import with_default_config
from distflow_jax.config import loading

DEFAULT_CONFIG = "grpo:tiny"


def run(argv: Sequence[str]) -> int:
  fv = flags.FlagValues()
  flags.DEFINE_enum("distributed", "env", ["env", "auto", "none"],
                    "env: join the group our launcher describes (or run alone); auto: "
                    "jax.distributed.initialize() cluster auto-detection (Slurm, TPU pods)",
                    flag_values=fv)
  flags.DEFINE_boolean("resume", None, "continue from the latest complete checkpoint in the "
                       "run dir (default: when there is one); --noresume refuses to start "
                       "over a run dir that holds checkpoints", flag_values=fv)
  rest = loading.parse(fv, with_default_config(argv, DEFAULT_CONFIG))
  if rest:
    raise loading.ConfigError(f"train takes no positional arguments, got {rest}")
  cfg = fv.config
  from distflow_jax import distributed
  distributed.simulate_cpu_devices(cfg.cluster.devices_per_process)  # before jax is imported
  from distflow_jax.workflow import checkpoint, progress, trainer
  info = distributed.initialize(auto=fv.distributed == "auto")
  log = progress.Logger(info.process_index == 0)
  log(f"config {cfg.name}: {info.process_count} process(es) x {info.local_device_count} "
      f"device(s); run dir {cfg.run_dir}")
  try:
    ctx, loaders = trainer.setup(cfg, log)
    ckpt, start = checkpoint.open_run(cfg, ctx.roles, loaders.train, resume=fv.resume, log=log,
                                      ctx=ctx)
    for m in trainer.train(cfg, ctx, loaders, start, checkpointer=ckpt, log=log):
      log.step(m, cfg.trainer.total_steps)
    ckpt.close()
  except Exception as e:  # pylint: disable=broad-except
    from distflow_jax.workflow import health, hints, peers
    if isinstance(e, health.CollapseError):
      print(f"distflow-jax train: {e}", file=sys.stderr)
      return 1
    if peers.looks_like_peer_failure(e):
      # A dead peer, not a bug here: say which one instead of a collective's traceback.
      print(f"distflow-jax train: {peers.describe(e)}", file=sys.stderr)
      return 1
    hint = hints.oom_hint(e, cfg)
    if hint is None:
      raise
    print(f"distflow-jax train: {hint}", file=sys.stderr)
    return 1
  return 0
