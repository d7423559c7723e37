"""The ``distflow-jax`` command: thin wrappers over the library.

  distflow-jax plan   --config=configs/grpo.py:tiny [--process=N] [--num_processes=P]
  distflow-jax launch -n 2 --devices-per-process 2 -- python prog.py
  distflow-jax train  --config=configs/grpo.py:tiny [--resume] [--distributed=auto]
  distflow-jax generate --config=... --prompts=FILE.jsonl --out=OUT.jsonl
  distflow-jax export --checkpoint RUN_DIR --out HF_DIR [--step N]  (actor -> safetensors)
  distflow-jax report RUN_DIR [--out DIR]        (PNG plots + report.md of metrics.jsonl)
  distflow-jax eval   --model=HF_DIR --data=FILE.jsonl [--k=8] [--config=...]

Errors are one line on stderr: a mistake in the command, config or files
(a bad flag, a missing or unreadable path, a broken model folder) exits 2, a
failure while running exits 1.  `--debug` (anywhere before a bare `--`) or
DISTFLOW_DEBUG=1 prints the traceback as well.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from absl import flags

from distflow_jax.config import loading
from distflow_jax.dag.spec import DagError


def _plan(argv: Sequence[str]) -> int:
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


def _launch(argv: Sequence[str]) -> int:
  from distflow_jax import launcher

  parser = argparse.ArgumentParser(
      prog="distflow-jax launch",
      description="Start N local jax.distributed processes running the same command.")
  parser.add_argument("-n", "--num-processes", type=int, required=True)
  parser.add_argument("--devices-per-process", type=int, default=1)
  parser.add_argument("--timeout", type=float, default=24 * 3600.0,
                      help="SIGKILL everything after this many seconds")
  parser.add_argument("--grace", type=float, default=5.0,
                      help="seconds between SIGTERM and SIGKILL when stopping peers")
  parser.add_argument("command", nargs=argparse.REMAINDER)
  args = parser.parse_args(list(argv))
  command = list(args.command)
  if command and command[0] == "--":
    command = command[1:]
  if not command:
    parser.error("give the command after --, e.g. -- python -m distflow_jax.cli plan ...")
  result = launcher.launch(args.num_processes, args.devices_per_process, command,
                           timeout_s=args.timeout, grace_s=args.grace)
  if not result.ok:
    print(f"distflow-jax launch: {result.describe()}", file=sys.stderr)
    if result.first_failure is not None:
      rc = result.first_failure[1]
      return rc if 0 < rc < 256 else 1
    return 124
  return 0


DEFAULT_TRAIN_CONFIG = "grpo:tiny"


def _train(argv: Sequence[str]) -> int:
  fv = flags.FlagValues()
  flags.DEFINE_enum("distributed", "env", ["env", "auto", "none"],
                    "env: join the group our launcher describes (or run alone); auto: "
                    "jax.distributed.initialize() cluster auto-detection (Slurm, TPU pods)",
                    flag_values=fv)
  flags.DEFINE_boolean("resume", None, "continue from the latest complete checkpoint in the "
                       "run dir (default: when there is one); --noresume refuses to start "
                       "over a run dir that holds checkpoints", flag_values=fv)
  if not any(a == "--config" or a.startswith("--config=") for a in argv):
    argv = [f"--config={DEFAULT_TRAIN_CONFIG}", *argv]  # the built-in default run
  rest = loading.parse(fv, argv)
  if rest:
    raise loading.ConfigError(f"train takes no positional arguments, got {rest}")
  cfg = fv.config
  from distflow_jax import distributed
  distributed.simulate_cpu_devices(cfg.cluster.devices_per_process)
  from distflow_jax.workflow import checkpoint, progress, trainer
  info = distributed.initialize(auto=fv.distributed == "auto")
  log = progress.Logger(info.process_index == 0)
  log(f"config {cfg.name}: {info.process_count} process(es) x {info.local_device_count} "
      f"device(s); run dir {cfg.run_dir}")
  try:
    ctx, loaders = trainer.setup(cfg, log)
    ckpt, start = checkpoint.open_run(cfg, ctx.roles, loaders.train, resume=fv.resume, log=log)
    for m in trainer.train(cfg, ctx, loaders, start, checkpointer=ckpt):
      log.step(m, cfg.trainer.total_steps)
    ckpt.close()
  except Exception as e:  # pylint: disable=broad-except
    from distflow_jax.workflow import hints, peers
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


def _report(argv: Sequence[str]) -> int:
  from distflow_jax.workflow import report
  return report.run(argv)


def _eval(argv: Sequence[str]) -> int:
  from distflow_jax.workflow import eval_cmd
  return eval_cmd.run(argv)


def _generate(argv: Sequence[str]) -> int:
  from distflow_jax.rollout import generate_cmd
  return generate_cmd.run(argv)


def _export(argv: Sequence[str]) -> int:
  from distflow_jax.workflow import export_cmd
  return export_cmd.run(argv)


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "plan": _plan,
    "launch": _launch,
    "train": _train,
    "generate": _generate,
    "export": _export,
    "report": _report,
    "eval": _eval,
}


DEBUG_FLAG = "--debug"
DEBUG_ENV = "DISTFLOW_DEBUG"
# An OSError with one of these is about a path the user gave (exit 2); others
# (a full disk, an I/O error) are failures of the run (exit 1).
_USER_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM,
                          errno.EROFS, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP,
                          errno.ENOTEMPTY, errno.EXDEV})


def _take_debug(argv: list[str]) -> tuple[list[str], bool]:
  """argv without `--debug` (only before a bare `--`: what follows belongs to a child
  command), and whether it or DISTFLOW_DEBUG asks for tracebacks."""
  end = argv.index("--") if "--" in argv else len(argv)
  head = [a for a in argv[:end] if a != DEBUG_FLAG]
  env = os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")
  return head + argv[end:], env or len(head) < end


def _one_line(text: str) -> str:
  lines = [l.strip() for l in str(text).splitlines() if l.strip()]
  return lines[0] if lines else ""


def _describe_os_error(e: OSError) -> str:
  """`<what went wrong>: <path>` (plus the second path of a rename or link)."""
  if e.filename is None:
    return _one_line(str(e)) or type(e).__name__
  def path(p):
    return os.fsdecode(p) if isinstance(p, (str, bytes)) else str(p)
  where = path(e.filename) + ("" if e.filename2 is None else f" -> {path(e.filename2)}")
  return f"{e.strerror or type(e).__name__}: {where}"


def _fail(cmd: str, message: str, code: int, debug: bool) -> int:
  if debug:
    traceback.print_exc()
  print(f"distflow-jax {cmd}: {message}", file=sys.stderr)
  return code


def main(argv: Sequence[str] | None = None) -> int:
  """Runs one command; returns its exit code.  Never raises (but SystemExit and
  KeyboardInterrupt): errors become one line on stderr (see the module doc)."""
  argv, debug = _take_debug(list(sys.argv[1:] if argv is None else argv))
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(__doc__.strip())
    print(f"\ncommands: {', '.join(COMMANDS)}")
    return 0 if argv else 2
  cmd, rest = argv[0], argv[1:]
  if cmd not in COMMANDS:
    from distflow_jax.dag.registry import unknown_name_message
    print(f"distflow-jax: {unknown_name_message('command', cmd, COMMANDS)}", file=sys.stderr)
    return 2
  try:
    return COMMANDS[cmd](rest)
  except (loading.ConfigError, DagError) as e:
    return _fail(cmd, f"error: {e}", 2, debug)
  except OSError as e:
    code = 2 if e.errno in _USER_ERRNOS else 1
    return _fail(cmd, f"error: {_describe_os_error(e)}", code, debug)
  except Exception as e:  # pylint: disable=broad-except  - a bug or a failed run: one line, exit 1
    hint = "" if debug else f" (run with {DEBUG_FLAG} or {DEBUG_ENV}=1 for the traceback)"
    detail = _one_line(str(e))
    return _fail(cmd, f"failed: {type(e).__name__}{': ' + detail if detail else ''}{hint}", 1,
                 debug)


def entry() -> None:
  from distflow_jax import distributed
  distributed.run_main(main)


if __name__ == "__main__":
  entry()
