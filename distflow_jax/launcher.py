"""Local multi-process launcher: N ``jax.distributed`` processes on one machine.

Each child gets the coordinator address (a free loopback port), its process
index, and M simulated CPU devices.  Output lines are prefixed with the process
index.  If any child dies or exits non-zero, the others are stopped (SIGTERM,
then SIGKILL after a short grace, since JAX catches SIGTERM) and the launch
fails naming the process and its exit code.  A global deadline SIGKILLs
everything, so a hung collective cannot outlive it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Sequence

from distflow_jax import distributed
from distflow_jax.config.errors import ConfigError


@dataclasses.dataclass
class LaunchResult:
  returncodes: list[int | None]
  outputs: list[list[str]]
  # (process index, exit code) of the first child that failed, if any.
  first_failure: tuple[int, int] | None
  timed_out: bool
  elapsed_s: float

  @property
  def ok(self) -> bool:
    return self.first_failure is None and not self.timed_out

  def describe(self) -> str:
    if self.timed_out:
      return f"launch timed out after {self.elapsed_s:.1f}s; all processes killed"
    if self.first_failure is not None:
      i, rc = self.first_failure
      line = f"process {i} {_how(rc)}"
      aborted = [j for j in self.aborted_by_jax() if j != i]
      if aborted:
        line += (f"; then jax's coordination client aborted process(es) {aborted} (the C++ "
                 f"'Check failure' stack trace above is that abort, not a second fault)")
      return line + "; the other processes were stopped"
    return f"all {len(self.returncodes)} processes exited 0"

  def aborted_by_jax(self) -> list[int]:
    """The processes that ended in SIGABRT saying that the coordination service's host
    (process 0) died: jax's client ends every survivor so, before our watchdog's line."""
    return [j for j, (rc, lines) in enumerate(zip(self.returncodes, self.outputs))
            if rc == -signal.SIGABRT and any(_LEADER_DIED.search(l) for l in lines)]


# What jax's coordination client logs as it aborts a survivor of process 0 (the service's
# host): "... the leader task ... died", "Terminating process because the coordinator
# detected missing heartbeats", and the like.
_LEADER_DIED = re.compile(r"leader task|coordination service|missing heartbeats", re.I)


def _first_failure(codes: Sequence[int | None]) -> tuple[int, int] | None:
  """The failure to name among one poll's exit codes: where several ended at once, one
  aborted by jax's client (SIGABRT) is a survivor of another's death, not its cause."""
  failed = [(i, rc) for i, rc in enumerate(codes) if rc not in (None, 0)]
  failed.sort(key=lambda f: f[1] == -signal.SIGABRT)
  return failed[0] if failed else None


def _how(rc: int) -> str:
  if rc >= 0:
    return f"exited with code {rc}"
  try:
    name = f" ({signal.Signals(-rc).name})"
  except ValueError:
    name = ""
  return f"killed by signal {-rc}{name}"


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(base: dict[str, str], *, coordinator: str, num_processes: int,
              process_id: int, devices_per_process: int) -> dict[str, str]:
  env = dict(base)
  env[distributed.ENV_COORDINATOR] = coordinator
  env[distributed.ENV_NUM_PROCESSES] = str(num_processes)
  env[distributed.ENV_PROCESS_ID] = str(process_id)
  env[distributed.ENV_TRANSFER] = f"127.0.0.1:{free_port()}"
  env["XLA_FLAGS"] = distributed.with_device_count(env.get("XLA_FLAGS", ""),
                                                   devices_per_process)
  env.setdefault("JAX_PLATFORMS", "cpu")
  env["PYTHONUNBUFFERED"] = "1"
  return env


def _pump(i: int, stream: IO[str], sink: list[str], out: IO[str] | None,
          lock: threading.Lock) -> None:
  for line in stream:
    line = line.rstrip("\n")
    sink.append(line)
    if out is not None:
      with lock:
        out.write(f"[{i}] {line}\n")
        out.flush()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
  try:
    os.killpg(p.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass


def launch(num_processes: int, devices_per_process: int, command: Sequence[str],
           *, timeout_s: float = 600.0, grace_s: float = 5.0,
           env: dict[str, str] | None = None, out: IO[str] | None | str = "stdout",
           poll_s: float = 0.05) -> LaunchResult:
  """Runs ``command`` as ``num_processes`` cooperating JAX processes; their output goes to
  ``out`` ("stdout": the current ``sys.stdout``; None: nowhere)."""
  if num_processes < 1:
    raise ConfigError(f"-n/--num-processes must be >= 1, got {num_processes}")
  if devices_per_process < 1:
    raise ConfigError(f"--devices-per-process must be >= 1, got {devices_per_process}")
  if timeout_s <= 0 or grace_s < 0:
    raise ConfigError(f"--timeout must be > 0 and --grace >= 0, got {timeout_s} and {grace_s}")
  if not command:
    raise ConfigError("launch needs a command to run, e.g. -- python train.py")
  if out == "stdout":
    out = sys.stdout
  coordinator = f"127.0.0.1:{free_port()}"
  base = dict(os.environ if env is None else env)
  lock = threading.Lock()
  procs: list[subprocess.Popen] = []
  outputs: list[list[str]] = [[] for _ in range(num_processes)]
  pumps = []
  start = time.monotonic()
  for i in range(num_processes):
    p = subprocess.Popen(
        list(command), env=child_env(base, coordinator=coordinator,
                                     num_processes=num_processes, process_id=i,
                                     devices_per_process=devices_per_process),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        text=True, errors="replace", start_new_session=True)
    procs.append(p)
    t = threading.Thread(target=_pump, args=(i, p.stdout, outputs[i], out, lock),
                         daemon=True)
    t.start()
    pumps.append(t)

  first_failure = None
  timed_out = False
  try:
    while True:
      codes = [p.poll() for p in procs]
      if first_failure is None:
        first_failure = _first_failure(codes)
      if first_failure is not None or all(rc is not None for rc in codes):
        break
      if time.monotonic() - start > timeout_s:
        timed_out = True
        break
      time.sleep(poll_s)
  finally:
    _stop_all(procs, grace_s=0.0 if timed_out else grace_s)
  for t in pumps:
    t.join(timeout=2.0)
  result = LaunchResult(returncodes=[p.returncode for p in procs], outputs=outputs,
                        first_failure=first_failure, timed_out=timed_out,
                        elapsed_s=time.monotonic() - start)
  if out is not None and not result.ok:
    with lock:
      out.write(f"[launch] {result.describe()}\n")
      out.flush()
  return result


def _stop_all(procs: list[subprocess.Popen], grace_s: float) -> None:
  alive = [p for p in procs if p.poll() is None]
  for p in alive:
    _signal_group(p, signal.SIGTERM)
  deadline = time.monotonic() + grace_s
  while alive and time.monotonic() < deadline:
    alive = [p for p in alive if p.poll() is None]
    time.sleep(0.05)
  for p in alive:
    _signal_group(p, signal.SIGKILL)
  for p in procs:
    try:
      p.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
      pass
