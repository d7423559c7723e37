"""Child program: process 1 exits with the given code, the others wait."""

import sys
import time

from distflow_jax import distributed


def main() -> int:
  info = distributed.initialize()
  if info.process_index == 1:
    return int(sys.argv[1])
  time.sleep(600)
  return 0


if __name__ == "__main__":
  distributed.run_main(main)
