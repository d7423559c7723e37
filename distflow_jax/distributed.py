"""Process-group set-up: one JAX process per host, multi-controller.

The local launcher (``distflow-jax launch``) passes the coordinator through
``DISTFLOW_*`` environment variables.  On a real cluster (Slurm, TPU pods,
GKE) ``jax.distributed.initialize()`` auto-detects everything, so
``initialize(auto=True)`` defers to it.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import traceback
from typing import Callable, NoReturn

ENV_COORDINATOR = "DISTFLOW_COORDINATOR"
ENV_NUM_PROCESSES = "DISTFLOW_NUM_PROCESSES"
ENV_PROCESS_ID = "DISTFLOW_PROCESS_ID"
ENV_INIT_TIMEOUT = "DISTFLOW_INIT_TIMEOUT_S"
ENV_HEARTBEAT = "DISTFLOW_HEARTBEAT_TIMEOUT_S"
ENV_SHUTDOWN = "DISTFLOW_SHUTDOWN_TIMEOUT_S"
# host:port this process serves cross-process array transfers on (an asynchronous run on
# disjoint processes moves batches and weights with them, run/transfer.py); the local
# launcher gives each process a free loopback port, a cluster the host's address.
ENV_TRANSFER = "DISTFLOW_TRANSFER_ADDRESS"


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
  process_index: int
  process_count: int
  local_device_count: int
  global_device_count: int


def launched_by_distflow() -> bool:
  return ENV_COORDINATOR in os.environ


def initialize(auto: bool = False) -> ProcessInfo:
  """Joins the process group and returns where this process stands.

  With ``DISTFLOW_*`` variables set (our launcher) it initializes from them,
  with gloo for cross-process CPU collectives.  With ``auto=True`` and no such
  variables it calls ``jax.distributed.initialize()`` for cluster
  auto-detection.  Otherwise it stays single-process.  Safe to call twice.
  """
  import jax

  if launched_by_distflow():
    coordinator = os.environ[ENV_COORDINATOR]
    try:
      num = int(os.environ[ENV_NUM_PROCESSES])
      pid = int(os.environ[ENV_PROCESS_ID])
    except (KeyError, ValueError) as e:
      raise RuntimeError(
          f"{ENV_COORDINATOR} is set but {ENV_NUM_PROCESSES}/{ENV_PROCESS_ID} "
          f"are missing or not integers: {e}") from e
    if not jax.distributed.is_initialized():
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
      set_transfer_address()
      timeout = int(os.environ.get(ENV_INIT_TIMEOUT, "60"))
      jax.distributed.initialize(
          coordinator_address=coordinator, num_processes=num, process_id=pid,
          initialization_timeout=timeout,
          # A dead peer is noticed through missed heartbeats; keep it well
          # under a minute so a lost host fails the job instead of hanging.
          heartbeat_timeout_seconds=int(os.environ.get(ENV_HEARTBEAT, "30")),
          # At a clean exit JAX waits in a barrier for every peer, which may
          # still be working (more prompts, a last save): 10 s aborted a loaded
          # CI machine's peers.  A failing process skips the barrier (run_main's
          # os._exit), so a long wait costs only the clean path.
          shutdown_timeout_seconds=int(os.environ.get(ENV_SHUTDOWN, "120")))
      _record_self()
  elif auto and not jax.distributed.is_initialized():
    set_transfer_address()
    jax.distributed.initialize()
  return ProcessInfo(
      process_index=jax.process_index(),
      process_count=jax.process_count(),
      local_device_count=jax.local_device_count(),
      global_device_count=jax.device_count(),
  )


def set_transfer_address() -> None:
  """Serves cross-process array transfers on ``DISTFLOW_TRANSFER_ADDRESS`` (when set); must
  run before ``jax.distributed.initialize``."""
  import jax
  address = os.environ.get(ENV_TRANSFER, "")
  if address:
    jax.config.update("jax_cross_host_transfer_socket_address", address)
    host = address.rsplit(":", 1)[0]
    jax.config.update("jax_cross_host_transport_addresses", f"{host}:0")


def coordination_client():
  """JAX's coordination-service client (None before initialize): ``peers`` owns it (this
  module imports nothing at import time, so it can set device flags before jax loads)."""
  from distflow_jax import peers
  return peers.coordination_client()


def _record_self() -> None:
  """Publishes ``host:pid`` so a survivor can tell at once which local peer died
  (``peers``)."""

  import jax
  from distflow_jax.peers import HOST_PID_KEY
  client = coordination_client()
  if client is not None and jax.process_count() > 1:
    client.key_value_set(HOST_PID_KEY.format(jax.process_index()),
                         f"{socket.gethostname()}:{os.getpid()}")


def simulate_cpu_devices(n: int) -> None:
  """On a CPU-only run started without our launcher, give this process ``n``
  simulated devices.  Must run before jax is imported; a no-op after that, when
  ``n`` is 0, under the launcher (which sets the count), or off CPU."""
  if not n or "jax" in sys.modules or launched_by_distflow():
    return
  if os.environ.get("JAX_PLATFORMS", "cpu") not in ("cpu", ""):
    return
  os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), n)


def with_device_count(xla_flags: str, n: int) -> str:
  """``xla_flags`` with the simulated CPU device count set to ``n`` (replacing any)."""
  kept = [f for f in xla_flags.split()
          if not f.startswith("--xla_force_host_platform_device_count")]
  return " ".join(kept + [f"--xla_force_host_platform_device_count={n}"])


def run_main(main: Callable[[], int | None]) -> NoReturn:
  """Runs an entry point and exits with its code, failing fast on error.

  On failure JAX's exit hook would wait in a shutdown barrier for peers that
  are still working, then abort, losing the exit code.  A failing process
  therefore leaves with ``os._exit`` right after flushing its output, so the
  launcher (or the cluster scheduler) sees the real code at once.
  """
  try:
    code = main()
    code = 0 if code is None else int(code)
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if not isinstance(e.code, int) and e.code is not None:
      print(e.code, file=sys.stderr)
  except KeyboardInterrupt:
    code = 130
  except BaseException:  # noqa: BLE001 - report anything, then leave fast
    traceback.print_exc()
    code = 1
  if "jax" in sys.modules:
    from distflow_jax import peers
    peers.mark_exiting(ok=code == 0)
  sys.stdout.flush()
  sys.stderr.flush()
  if code != 0:
    os._exit(code)
  sys.exit(0)
