"""Child program for the peer watchdog: ``block`` makes process 0 wait in a barrier that
process 1 never reaches (it sleeps until killed); ``finish`` makes process 1 leave
normally at once while process 0 works on for a few seconds; ``lead`` keeps both busy
until the test kills process 0, which hosts the coordination service; ``first`` makes
process 0 end its work normally first (it then waits in jax's shutdown barrier) while
process 1 works on for a few seconds."""

import sys
import time

from distflow_jax import distributed


def main() -> int:
  distributed.initialize()
  from distflow_jax import peers
  import jax
  assert peers.start_watchdog(interval_s=0.2)
  print(f"ready {jax.process_index()}", flush=True)
  if sys.argv[1] == "lead":  # both work on; the test kills process 0
    time.sleep(600)
  elif sys.argv[1] == "block":
    if jax.process_index() == 0:
      distributed.coordination_client().wait_at_barrier("never", 120_000)
    else:
      time.sleep(600)
  elif sys.argv[1] == "first" and jax.process_index() == 1:
    time.sleep(4)
  elif sys.argv[1] == "finish" and jax.process_index() == 0:
    time.sleep(4)
  print(f"done {jax.process_index()}", flush=True)
  return 0


if __name__ == "__main__":
  distributed.run_main(main)
