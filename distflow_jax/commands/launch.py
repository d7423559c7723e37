"""``distflow-jax launch``: start N local jax.distributed processes running one command.

  distflow-jax launch -n 2 --devices-per-process 2 -- python prog.py

Exits 0 when every process did; else with the first failing process's code
(124 on the timeout).

On several plain hosts (no Slurm, no pod), run the same command on each host with:
  DISTFLOW_COORDINATOR=HOST0:PORT  (host 0's address, a free port on it)
  DISTFLOW_NUM_PROCESSES=N  DISTFLOW_PROCESS_ID=i  (0 on host 0, ..., N-1)
  e.g. on host 0 (10.0.0.1), and with DISTFLOW_PROCESS_ID=1 on host 1:
  DISTFLOW_COORDINATOR=10.0.0.1:8476 DISTFLOW_NUM_PROCESSES=2 DISTFLOW_PROCESS_ID=0
      distflow-jax train --config=...
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from distflow_jax import launcher


def run(argv: Sequence[str]) -> int:

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
