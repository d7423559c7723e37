"""Child program: run the RL workflow for a config; process 0 writes the metrics as JSON.

  python tests/mp/workflow_train.py OUT.json CONFIG [override ...]
"""

import json
import sys

from distflow_jax import distributed


def main() -> int:
  out, name, *overrides = sys.argv[1:]
  info = distributed.initialize()
  from distflow_jax.config import loading
  from distflow_jax.workflow import trainer
  cfg = loading.load(name, overrides)
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  metrics = list(trainer.train(cfg, ctx, loaders))
  if info.process_index == 0:
    with open(out, "w") as f:
      json.dump(metrics, f)
  print(f"OK process {info.process_index}: {len(metrics)} steps")
  return 0


if __name__ == "__main__":
  distributed.run_main(main)
