"""The bodies of the ``distflow-jax`` commands, one module per command.

Each module has ``run(argv) -> int`` (the exit code) and parses its own
flags; ``distflow_jax.cli`` dispatches to it and turns errors into one line.
A module is imported only when its command runs: train and eval must set the
simulated device count before anything imports jax, and report needs no jax.

    plan      the plan (placements, re-partitions) of a config
    launch    N local jax.distributed processes running one command
    train     the RL run of a config
    sft       supervised fine-tuning on prompt/answer or chat rows
    eval      accuracy / pass@k of a local model on a dataset
    generate  completions for a JSONL file of prompts
    export    a run checkpoint's actor as a Hugging Face directory
    convert   a GGUF file (llama.cpp) as a Hugging Face directory
    report    PNG plots + report.md of a run's metrics
    config    the resolved config (file + overrides), or what differs from the defaults
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_collections
from absl import flags

from distflow_jax import distributed
from distflow_jax.config import loading
from distflow_jax.observe import progress
from distflow_jax.persist import run_lock
from distflow_jax.run import compile_cache

NAMES = ("plan", "launch", "train", "sft", "generate", "export", "convert", "report", "eval",
         "config")


def define_run_flags(fv, what: str) -> None:
  """The flags every command that runs a job shares: ``--distributed`` and ``--resume``
  (``what``: the checkpoints it resumes from, for the help text)."""
  flags.DEFINE_enum("distributed", "env", ["env", "auto", "none"],
                    "env: join the group our launcher describes (or run alone); auto: "
                    "jax.distributed.initialize() cluster auto-detection (Slurm, TPU pods)",
                    flag_values=fv)
  flags.DEFINE_boolean("resume", None, f"continue from the latest complete {what} "
                       "(default: when there is one); --noresume refuses to start over a run "
                       "dir that holds them", flag_values=fv)


def start_job(fv, command: str, run_dir: str, job: str | None = None):
  """Joins the process group (simulated CPU devices first, before jax is imported), takes
  the run dir's lock on process 0 (``persist/run_lock.py``; ``job`` names the command in
  it, default ``command``; cli.main releases it), turns on the persistent compilation
  cache (``trainer.compile_cache_dir``) and returns ``(process info, process-0 logger)``,
  having logged where the job runs."""
  cfg = fv.config
  distributed.simulate_cpu_devices(cfg.cluster.devices_per_process)
  info = distributed.initialize(auto=fv.distributed == "auto")
  from distflow_jax import peers
  peers.start_watchdog()  # a local peer's death stops this process with one line
  log = progress.Logger(info.process_index == 0)
  if info.process_index == 0:  # before anything is written into the run dir
    run_lock.take(run_dir, job or command, log)
  log(f"{command} {cfg.name}: {info.process_count} process(es) x {info.local_device_count} "
      f"device(s); run dir {run_dir}")
  compile_cache.enable(cfg, log)  # before anything compiles (trainer.compile_cache_dir)
  compile_cache.CompileCounter()  # counts the job's programs from here (compile/programs)
  return info, log


def with_default_config(argv: Sequence[str], default: str) -> list[str]:
  """``argv`` with ``--config=<default>`` first unless it names a config itself."""
  argv = list(argv)
  if not any(a == "--config" or a.startswith("--config=") for a in argv):
    argv.insert(0, f"--config={default}")
  return argv


def use_local_devices(cfg: ml_collections.ConfigDict, argv: Sequence[str]
                      ) -> ml_collections.ConfigDict:
  """For commands that run a model without the training topology (eval, generate): ``cfg``
  with the devices this machine has, unless ``--config.cluster.*`` asks for a layout.  Call
  it before anything imports jax: a simulated CPU device count only takes effect then."""
  if not any(a.startswith("--config.cluster.") for a in argv):
    cfg = loading.with_values(cfg, {"cluster.num_processes": 0,
                                    "cluster.devices_per_process": 0})
  distributed.simulate_cpu_devices(cfg.cluster.devices_per_process)
  return cfg
