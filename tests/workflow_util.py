"""Shared by the workflow tests: small overrides that keep a full RL step fast."""

SMOKE = [
    "model.preset=micro",
    "model.warmstart.steps=0",
    "data.max_prompt_len=40",
    "rollout.prefill_buckets=(40,)",
    "rollout.max_new_tokens=8",
    "rollout.max_concurrent_decodes=8",
    "data.eval_size=8",
    "trainer.eval_every=0",
    "trainer.total_steps=3",
    "data.chat_template=True",
]


def smoke_overrides(run_dir, *extra):
  return SMOKE + [f"run_dir={run_dir}", *extra]


def use_tape(cfg, directory, mode):
  """Swap the generate node for tests/plugin_rollout_tape.py's recorder / replayer."""
  import os
  os.environ["DISTFLOW_TEST_TAPE"] = str(directory)
  os.environ["DISTFLOW_TEST_TAPE_MODE"] = mode
  cfg.plugins = tuple(cfg.plugins) + ("plugin_rollout_tape",)
  cfg.dag = [dict(d, fn="generate.tape") if d["fn"] == "generate" else dict(d) for d in cfg.dag]


def params_digest(ctx):
  """sha256 of the actor's parameters, gathered whole (the same on every process)."""
  import hashlib

  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  from distflow_jax.dag.spec import Role
  h = hashlib.sha256()
  for x in jax.tree.leaves(ctx.roles[Role.ACTOR].params):
    h.update(np.asarray(multihost_utils.process_allgather(x, tiled=True)).tobytes())
  return h.hexdigest()
