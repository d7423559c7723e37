"""The ``distflow-jax`` command: runs one of the commands below.

  distflow-jax plan   --config=configs/grpo.py:tiny [--process=N] [--num_processes=P]
  distflow-jax launch -n 2 --devices-per-process 2 -- python prog.py
  distflow-jax train  --config=configs/grpo.py:tiny [--resume] [--distributed=auto]
  distflow-jax sft    --config.data.train=FILE.jsonl [--eval_data=FILE] [--resume]
  distflow-jax generate --model=RUN_DIR|HF_DIR --prompts=FILE.jsonl --out=OUT.jsonl
  distflow-jax export --checkpoint RUN_DIR --out HF_DIR [--step N]  (actor -> safetensors)
  distflow-jax convert FILE.gguf --out HF_DIR     (a llama.cpp file -> an HF folder)
  distflow-jax report RUN_DIR [--out DIR]        (PNG plots + report.md of metrics.jsonl)
  distflow-jax eval   --model=RUN_DIR|HF_DIR --data=FILE.jsonl [--k=8] [--config=...]
  distflow-jax config --config=... [--config.x=y] [--diff]  (the resolved config)

`distflow-jax <command> --help` (or `distflow-jax help <command>`) shows a
command's usage and flags.

Errors are one line on stderr: a mistake in the command, config or files
(a bad flag, a missing or unreadable path, a broken model folder) exits 2, a
failure while running exits 1.  `--debug` (anywhere before a bare `--`) or
DISTFLOW_DEBUG=1 prints the traceback as well.
"""

from __future__ import annotations

import errno
import importlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from distflow_jax import distributed, io_errors
from distflow_jax.commands import NAMES, usage
from distflow_jax.config import loading
from distflow_jax.dag.registry import unknown_name_message
from distflow_jax.dag.spec import DagError
from distflow_jax.envs.guard import EnvFailure
from distflow_jax.persist import run_lock
from distflow_jax.rewards.registry import RewardFunctionError


def _command(name: str) -> Callable[[Sequence[str]], int]:
  """``distflow_jax.commands.<name>.run``, imported when the command runs: most commands
  import jax, and train and eval must set the simulated device count before that."""
  def run(argv: Sequence[str]) -> int:
    return importlib.import_module(f"distflow_jax.commands.{name}").run(argv)
  run.__name__ = run.__qualname__ = f"{name}.run"
  return run


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {name: _command(name) for name in NAMES}


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


# The exit code of a command whose reader closed stdout (`distflow-jax help train | head -1`):
# what a process killed by SIGPIPE reports to a shell (128 + 13).
EXIT_BROKEN_PIPE = 141


def _stdout_to_devnull() -> None:
  """Points stdout's file descriptor at /dev/null, so the interpreter's last flush of what
  is still buffered for the closed pipe does not fail again at exit."""
  try:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
  except (OSError, ValueError):  # no real stdout (captured): nothing to silence
    pass


def main(argv: Sequence[str] | None = None) -> int:
  """Runs one command; returns its exit code.  Never raises (but SystemExit and
  KeyboardInterrupt): errors become one line on stderr (see the module doc).  A reader
  that closes stdout early ends the command quietly with exit code 141."""
  try:
    code = _main(argv)
    sys.stdout.flush()  # inside: a closed pipe fails here, not at exit
    return code
  except BrokenPipeError:
    _stdout_to_devnull()
    return EXIT_BROKEN_PIPE


def _main(argv: Sequence[str] | None) -> int:
  argv, debug = _take_debug(list(sys.argv[1:] if argv is None else argv))
  if argv[:1] == ["help"] and len(argv) > 1 and argv[1] in COMMANDS:
    argv = [argv[1], "--help"]  # `distflow-jax help train` = `distflow-jax train --help`
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(usage.readable(f"{__doc__.strip()}\n\ncommands: {', '.join(COMMANDS)}"))
    return 0 if argv else 2
  cmd, rest = argv[0], argv[1:]
  if cmd not in COMMANDS:
    print(f"distflow-jax: {unknown_name_message('command', cmd, COMMANDS)}", file=sys.stderr)
    return 2
  if usage.wants_help(rest):
    return usage.show(cmd, COMMANDS[cmd])
  try:
    return COMMANDS[cmd](rest)
  except BrokenPipeError:
    raise  # the reader closed stdout: main ends quietly
  except (loading.ConfigError, DagError) as e:
    return _fail(cmd, f"error: {e}", 2, debug)
  except (RewardFunctionError, EnvFailure) as e:  # the user's reward / environment code failed
    return _fail(cmd, f"error: {_one_line(str(e))}", 2, debug)
  except OSError as e:
    disk = io_errors.find(e)
    if disk is not None:  # a full disk: the path, however the error came (exit 1)
      return _fail(cmd, f"error: {disk.line()}", 1, debug)
    code = 2 if e.errno in _USER_ERRNOS else 1
    return _fail(cmd, f"error: {_describe_os_error(e)}", code, debug)
  except Exception as e:  # pylint: disable=broad-except  - a bug or a failed run: one line, exit 1
    disk = io_errors.find(e)  # orbax / TensorStore report a full disk as a ValueError
    if disk is not None:
      return _fail(cmd, f"error: {disk.line()}", 1, debug)
    hint = "" if debug else f" (run with {DEBUG_FLAG} or {DEBUG_ENV}=1 for the traceback)"
    detail = _one_line(str(e))
    return _fail(cmd, f"failed: {type(e).__name__}{': ' + detail if detail else ''}{hint}", 1,
                 debug)
  finally:
    run_lock.release_all()  # the run dir is free again, however the command ended


def entry() -> None:
  distributed.run_main(main)


if __name__ == "__main__":
  entry()
