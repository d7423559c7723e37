"""Child program: each process loads grpo:tiny with its own actor.optimizer.lr, then runs the
start-up checks trainer.setup runs first; prints the ConfigError line (or OK) and exits 0.

  python tests/mp/config_consistency.py LR_OF_PROCESS_0 LR_OF_PROCESS_1 ...
"""

import sys

from distflow_jax import distributed


def main() -> int:
  info = distributed.initialize()
  from distflow_jax.config import checks, loading
  cfg = loading.load("grpo:tiny", [f"actor.optimizer.lr={sys.argv[1 + info.process_index]}"])
  try:
    checks.check_runtime_topology(cfg, info.process_count, info.local_device_count)
  except loading.ConfigError as e:
    print(f"ConfigError: {e}")
    return 0
  print("OK same config")
  return 0


if __name__ == "__main__":
  distributed.run_main(main)
