"""Child program: both processes join, then process 0 (the coordination service's host)
SIGKILLs itself while process 1 waits in a barrier; no peer watchdog, so jax's client is
what ends process 1 (SIGABRT), unless the launcher stops it first."""

import os
import signal
import time

from distflow_jax import distributed


def main() -> int:
  distributed.initialize()
  import jax
  client = distributed.coordination_client()
  client.wait_at_barrier("joined", 60_000)
  if jax.process_index() == 0:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
  client.wait_at_barrier("never", 120_000)
  return 0


if __name__ == "__main__":
  distributed.run_main(main)
