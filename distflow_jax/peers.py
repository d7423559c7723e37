"""Naming a lost peer: when a collective fails because another process died.

What a survivor sees when a peer is SIGKILLed (measured, 2 processes on CPU,
gloo): its next (or current) cross-process collective fails at once with
``Gloo ... Connection closed by peer``; the coordination service marks the
peer dead after ``heartbeat_timeout_seconds`` (30 s, see ``distributed``).
When the dead peer is process 0, which hosts the coordination service, JAX's
client terminates the survivors itself within seconds ("the leader task ...
died"), and the launcher names process 0.

The coordination service only marks a peer dead after the heartbeat timeout, and at
that moment JAX's client also aborts the survivor (SIGABRT from C++), so asking it
races with that abort.  So each process records ``host:pid`` in the coordination
service's key-value store at start-up (``distributed.initialize``); a survivor first checks the
peers on its own host by pid, which answers at once, and asks the service about the
others only after that (``lost_peers``, bounded by a timeout: the query waits for every
live process to ask too).
"""

from __future__ import annotations

import os
import re
import select
import socket
import sys
import threading

import jax
from jax._src import distributed as jdist

# Errors a collective raises when its peer went away (not a bug of this process); the last
# two: a cross-process array copy's socket (run/transfer.py) whose other end died.
_PEER_ERROR = re.compile(r"Gloo|Connection (closed|reset)|coordination service|UNAVAILABLE|"
                         r"DEADLINE_EXCEEDED|heartbeat|SocketServer|"
                         r"Transport endpoint is not connected", re.IGNORECASE)


class PeerLostError(RuntimeError):
  """Another process of the run died; names it when the coordination service can."""


def looks_like_peer_failure(error: BaseException) -> bool:
  return jax.process_count() > 1 and bool(_PEER_ERROR.search(f"{type(error).__name__}: {error}"))


# Where each process publishes ``host:pid`` at start-up (``distributed.initialize``).
HOST_PID_KEY = "distflow/host_pid/{}"
_KEY = HOST_PID_KEY


def coordination_client():
  """JAX's coordination-service client (None before initialize)."""
  return jdist.global_state.client


_client = coordination_client


def lost_local_peers(timeout_s: float = 2.0) -> list[int]:
  """Peers on this host whose recorded process no longer exists (answers at once)."""
  client = _client()
  if client is None:
    return []
  lost, me = [], socket.gethostname()
  for i in range(jax.process_count()):
    try:
      host, _, pid = client.blocking_key_value_get(_KEY.format(i), int(timeout_s * 1000)
                                                   ).rpartition(":")
    except Exception:  # noqa: BLE001 - not recorded, or the service is gone
      continue
    if host != me or i == jax.process_index():
      continue
    try:
      if _gone(int(pid)):
        lost.append(i)
    except ValueError:
      pass
  return lost


def lost_peers(timeout_s: float) -> list[int] | None:
  """Processes the coordination service no longer sees alive; None if it cannot tell in time."""
  client = _client()
  if client is None:
    return None
  result: dict[str, object] = {}

  def ask():
    try:
      result["alive"] = client.get_live_nodes(list(range(jax.process_count())))
    except Exception as e:  # noqa: BLE001 - the service itself may be gone
      result["error"] = e

  t = threading.Thread(target=ask, daemon=True)
  t.start()
  t.join(timeout_s)
  if "alive" not in result:
    return None
  alive = set(result["alive"])  # type: ignore[arg-type]
  return [i for i in range(jax.process_count()) if i not in alive]


def describe(error: BaseException, timeout_s: float = 45.0) -> str:
  """A one-line account of a failure caused by a lost peer."""
  me = jax.process_index()
  lost = lost_local_peers() or lost_peers(timeout_s)
  first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
  if lost:
    names = ", ".join(f"process {i}" for i in lost)
    return (f"lost {names} of {jax.process_count()}: the coordination service no longer "
            f"sees it alive; process {me} stops (collective error: {first})")
  return (f"a collective failed on process {me}, most likely because another process of "
          f"the run died (the coordination service could not say which within "
          f"{timeout_s:.0f}s): {first}")


# A process that leaves normally marks itself here first, so its exit is not a loss.
EXITED_KEY = "distflow/exited/{}"
_stop = threading.Event()


def _gone(pid: int) -> bool:
  """Whether process ``pid`` has died (a zombie not yet reaped by its parent counts)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  except (PermissionError, ValueError):
    return False
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
  except (OSError, IndexError):
    return False


def _exit_mark(client, i: int) -> bool | None:
  """Whether process ``i`` marked its exit as normal; None when the service cannot say
  (only "not found" means it has not)."""
  try:
    client.key_value_try_get(EXITED_KEY.format(i))
    return True
  except Exception as e:  # noqa: BLE001
    return False if "NOT_FOUND" in str(e).upper().replace(" ", "_") else None


def _pid_waker(pids):
  """``wait(timeout_s)``: returns when one of ``pids`` ends (once per process), or after
  ``timeout_s`` (a plain sleep where pidfds are not available)."""
  fds = []
  if hasattr(os, "pidfd_open") and hasattr(select, "poll"):
    for pid in pids:
      try:
        fds.append(os.pidfd_open(pid))
      except OSError:  # gone already, or not allowed: the poll still sees it
        pass
  if not fds:
    return _stop.wait
  poller = select.poll()
  for fd in fds:
    poller.register(fd, select.POLLIN)

  def wait(timeout_s: float) -> None:
    for fd, _ in poller.poll(int(timeout_s * 1000)):
      poller.unregister(fd)  # it ended: woken once, then checked by pid like the rest
      os.close(fd)
  return wait


def start_watchdog(interval_s: float = 0.5, timeout_s: float = 10.0) -> bool:
  """Stops this process with one line as soon as a peer on this host dies.

  A survivor blocked in a barrier (an orbax save, a key-value wait) gets no collective
  error, and JAX's client aborts it with a C++ stack trace once the heartbeat times out,
  or at once when the dead peer is process 0, which hosts the coordination service.
  This thread checks the recorded pids of the peers on this host twice a second, and
  leaves first, naming the lost process (process 0's exit mark is read while it lives:
  the service goes with it).  Peers on other hosts are still noticed only
  through the heartbeat.  Returns whether a watchdog runs (several processes only).
  """
  client = _client()
  if client is None or jax.process_count() < 2:
    return False
  me, host, local = jax.process_index(), socket.gethostname(), {}
  for i in range(jax.process_count()):
    if i == me:
      continue
    try:
      h, _, pid = client.blocking_key_value_get(_KEY.format(i), int(timeout_s * 1000)
                                                ).rpartition(":")
      if h == host:
        local[i] = int(pid)
    except Exception:  # noqa: BLE001 - not recorded: cannot watch it
      continue
  if not local:
    return False
  _stop.clear()
  # Process 0 hosts the coordination service, which goes with it: once its pid is gone
  # nobody can say whether it had marked its exit, so its mark is read while it lives.
  marked: set[int] = set()
  # A pidfd per peer wakes this thread the moment that peer ends (Linux): jax's client
  # aborts this process within milliseconds of process 0's death, faster than a poll.
  waker = _pid_waker(local.values())

  def watch():
    while not _stop.is_set():
      waker(interval_s)
      if _stop.is_set():
        break
      for i, pid in local.items():
        gone = _gone(pid)
        if i == 0 and not gone and 0 not in marked and _exit_mark(client, 0):
          marked.add(0)
        if not gone or _stop.is_set() or i in marked:
          continue
        if i != 0 and _exit_mark(client, i) is not False:  # marked, or cannot tell
          continue
        hosted = "; it hosted the coordination service" if i == 0 else ""
        print(f"distflow-jax: lost process {i} of {jax.process_count()}: it died "
              f"(pid {pid} is gone{hosted}); process {me} stops", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)

  threading.Thread(target=watch, name="distflow-peer-watchdog", daemon=True).start()
  return True


def mark_exiting(ok: bool) -> None:
  """Called on the way out: stops the watchdog and, when ``ok``, tells the peers this exit
  is no loss (a failed process stays unmarked, so its peers stop too)."""
  _stop.set()
  client = _client()
  if not ok or client is None or jax.process_count() < 2:
    return
  try:
    client.key_value_set(EXITED_KEY.format(jax.process_index()), "1")
  except Exception:  # noqa: BLE001 - the service may already be gone
    pass
