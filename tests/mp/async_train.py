"""Child program: an RL run (asynchronous on disjoint processes, say); each process that
trained writes its metrics and the trained actor's digest to OUT.json.<process index>;
each that built a rollout replica, the processes it spans to OUT.json.replicas.<index>.

  python tests/mp/async_train.py OUT.json CONFIG [override ...]

With DISTFLOW_TEST_DIGITS=1 the reward is tests/plugin_length_reward.py's reward.digits
(it varies within a prompt's samples for an untrained model: the weights move).  Each
training step prints ``step N`` as it ends.
"""

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from distflow_jax import distributed  # noqa: E402


def main() -> int:
  out, name, *overrides = sys.argv[1:]
  info = distributed.initialize()
  from distflow_jax import peers
  peers.start_watchdog()
  import jax
  import numpy as np
  from distflow_jax.config import loading
  from distflow_jax.dag.spec import Role
  from distflow_jax.run import trainer
  cfg = loading.load(name, overrides)
  if os.environ.get("DISTFLOW_TEST_DIGITS") == "1":
    cfg.plugins = tuple(cfg.plugins) + ("plugin_length_reward",)
    cfg.dag = [dict(d, fn="reward.digits") if d["fn"] == "reward.math" else dict(d)
               for d in cfg.dag]
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  metrics = []
  for row in trainer.train(ctx, loaders):
    metrics.append(row)
    print(f"step {row['step']}", flush=True)
  if metrics:  # a rollout process of a run on disjoint processes trains nothing
    h = hashlib.sha256()
    from jax.experimental import multihost_utils
    for x in jax.tree.leaves(ctx.roles[Role.ACTOR].params):  # gathered among the trainers
      h.update(np.asarray(x if x.is_fully_addressable else
                          multihost_utils.process_allgather(x, tiled=True)).tobytes())
    metrics[-1]["params_sha256"] = h.hexdigest()
    # Held-out rows this process parsed (on disjoint processes the rollout side evaluates).
    metrics[-1]["eval_rows_drawn"] = loaders.eval.counts["ok"] if loaders.eval else None
    with open(f"{out}.{info.process_index}", "w") as f:
      json.dump(metrics, f)
  replicas = ctx.replicas.built()
  if replicas:  # a rollout process: the processes its replica spans
    with open(f"{out}.replicas.{info.process_index}", "w") as f:
      json.dump(replicas, f)
  print(f"OK process {info.process_index}: {len(metrics)} steps")
  return 0


def guarded() -> int:
  """``main``, a lost peer said in one line as the train command says it."""
  try:
    return main()
  except Exception as e:  # pylint: disable=broad-except
    from distflow_jax import peers
    if not peers.looks_like_peer_failure(e):
      raise
    print(f"distflow-jax: {peers.describe(e)}", flush=True)
    return 1


if __name__ == "__main__":
  distributed.run_main(guarded)
