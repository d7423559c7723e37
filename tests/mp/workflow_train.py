"""Child program: run the RL workflow for a config; process 0 writes the metrics as JSON.

  python tests/mp/workflow_train.py OUT.json CONFIG [override ...]

With DISTFLOW_TEST_TAPE / DISTFLOW_TEST_TAPE_MODE set, the generate node records or
replays rollouts (tests/plugin_rollout_tape.py).  With DISTFLOW_TEST_OVERLAP=1 the run is
handed the catalogue's late programs as the ``train`` command hands them
(``trainer.compile_overlap``).  The last row also carries ``params_sha256``, a digest of
the trained actor's parameters, and ``params_sum_squares`` (float64).
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from distflow_jax import distributed  # noqa: E402


def main() -> int:
  out, name, *overrides = sys.argv[1:]
  info = distributed.initialize()
  from distflow_jax.config import loading
  from distflow_jax.run import trainer
  from workflow_util import params_digest, params_sum_squares, use_tape
  cfg = loading.load(name, overrides)
  if os.environ.get("DISTFLOW_TEST_TAPE"):
    use_tape(cfg, os.environ["DISTFLOW_TEST_TAPE"], os.environ["DISTFLOW_TEST_TAPE_MODE"])
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  programs_at = None
  if os.environ.get("DISTFLOW_TEST_OVERLAP") == "1":
    from distflow_jax.lowering import catalogue
    programs_at = catalogue.late_programs
  metrics = list(trainer.train(ctx, loaders, programs_at=programs_at))
  metrics[-1]["params_sha256"] = params_digest(ctx)
  metrics[-1]["params_sum_squares"] = params_sum_squares(ctx)
  metrics[-1]["replica_processes"] = ctx.replicas.built()
  if info.process_index == 0:
    with open(out, "w") as f:
      json.dump(metrics, f)
  print(f"OK process {info.process_index}: {len(metrics)} steps")
  return 0


if __name__ == "__main__":
  distributed.run_main(main)
