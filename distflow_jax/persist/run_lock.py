"""One job at a time in a run directory: the lock file ``run_dir/run.lock``.

    take(run_dir, "train", log)   # refuses (RunLockError) while another live job holds it
    ...
    release_all()                 # cli.main does this when the command ends, however it ends

The file records the holder (host, pid, start time, command) and is created in one step
(written beside, then hard-linked into place), so it is never seen half-written.  A lock
whose holder is gone (same host, pid no longer alive: a SIGKILL, a crash) is taken over
with a line saying so; a lock from another host cannot be checked and is refused, naming
the file to remove.

In a multi-process run only process 0 takes the lock: the processes of one job share the
run dir (process 0 writes metrics.jsonl and config.json and commits each checkpoint), and a
second job's process 0 is refused, which makes the launcher stop that job's other processes.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import os
import socket
import time
from collections.abc import Callable

from distflow_jax.config.errors import ConfigError

LOCK_FILE = "run.lock"


class RunLockError(ConfigError):
  """The run dir is in use by another live job (or its lock cannot be read)."""


@dataclasses.dataclass(frozen=True)
class Holder:
  host: str
  pid: int
  started: float  # time.time()
  command: str

  def describe(self) -> str:
    since = datetime.datetime.fromtimestamp(self.started).strftime("%Y-%m-%d %H:%M:%S")
    return f"`{self.command}` (pid {self.pid} on host {self.host}, since {since})"


def lock_path(run_dir: str) -> str:
  return os.path.join(os.path.abspath(run_dir), LOCK_FILE)


def read_holder(path: str) -> Holder | None:
  """The holder recorded in ``path``; None when it is missing or does not read as one."""
  try:
    with open(path) as f:
      d = json.load(f)
    return Holder(str(d["host"]), int(d["pid"]), float(d["started"]), str(d["command"]))
  except (OSError, ValueError, KeyError, TypeError):
    return None


def pid_alive(pid: int, since: float | None = None) -> bool:
  """Whether ``pid`` runs (and, given ``since``, was started by then: a process that began
  after the lock was written is another process that reuses a dead holder's pid)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # someone else's process: alive
    pass
  started = _process_start(pid)
  return since is None or started is None or started <= since + 1.0


def _process_start(pid: int) -> float | None:
  """When ``pid`` started (seconds since the epoch), from /proc; None where there is none."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
    with open("/proc/stat") as f:
      boot = next(int(l.split()[1]) for l in f if l.startswith("btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError, StopIteration):
    return None


_HELD: dict[str, Holder] = {}  # lock path -> this process's holder record


def _create(path: str, me: Holder) -> None:
  """Creates ``path`` holding ``me``, or raises FileExistsError; never half-written."""
  tmp = f"{path}.{me.host}.{me.pid}.tmp"
  with open(tmp, "w") as f:
    json.dump(dataclasses.asdict(me), f)
  try:
    os.link(tmp, path)
  except FileExistsError:
    raise
  except OSError:  # a filesystem without hard links: exclusive create, then write
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    with os.fdopen(fd, "w") as f:
      json.dump(dataclasses.asdict(me), f)
  finally:
    os.unlink(tmp)


def take(run_dir: str, command: str, log: Callable[[str], None] | None = None) -> str:
  """Takes ``run_dir``'s lock for ``command``; returns the lock file's path.  Raises
  ``RunLockError`` (one line: the holder and the run dir) when another live job holds it."""
  os.makedirs(run_dir, exist_ok=True)
  path = lock_path(run_dir)
  me = Holder(socket.gethostname(), os.getpid(), time.time(), command)
  for _ in range(5):  # a race with another taker over a stale lock: look again
    try:
      _create(path, me)
    except FileExistsError:
      holder = read_holder(path)
      if holder is None:
        if not os.path.exists(path):
          continue  # released meanwhile
        raise RunLockError(
            f"run dir {run_dir} has a lock file that does not read as one ({path}); if no "
            f"job runs in this run dir, remove it") from None
      if holder.host != me.host or pid_alive(holder.pid, holder.started):
        where = ("" if holder.host == me.host else
                 f"; another host's process cannot be checked from here: if it is gone, "
                 f"remove {path}")
        raise RunLockError(
            f"run dir {run_dir} is in use by {holder.describe()}; wait for it to end or give "
            f"another --config.run_dir{where}") from None
      if read_holder(path) == holder:  # still the dead one's: take it over
        os.unlink(path)
      if log is not None:
        log(f"run dir {run_dir}: taking over the stale lock of {holder.describe()}, which "
            f"is no longer running")
      continue
    _HELD[path] = me
    return path
  raise RunLockError(f"run dir {run_dir}: could not take its lock {path} (other jobs keep "
                     f"taking it)")


def release(path: str) -> None:
  """Removes ``path`` if this process holds it (a lock another job took over stays)."""
  me = _HELD.pop(path, None)
  if me is not None and read_holder(path) == me:
    try:
      os.unlink(path)
    except FileNotFoundError:
      pass


def release_all() -> None:
  for path in list(_HELD):
    release(path)


atexit.register(release_all)
