"""Multi-turn episodes (rollout.env) through a checkpoint: a GRPO run on scripted episodes
stopped after step 1 and resumed equals the uninterrupted run, its step-2 metrics (the
episodes' turns, truncation and rewards) and its parameters bitwise."""

import os
import shutil

import jax
import numpy as np
import pytest

from distflow_jax.dag.spec import Role
from distflow_jax.persist import checkpoint as ck
from distflow_jax.run import trainer
from test_episodes_train import _cfg

pytestmark = pytest.mark.timeout(900)


def _run(run_dir):
  cfg = _cfg(run_dir, "trainer.total_steps=2", "trainer.save_every=1")
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  checkpointer, start = ck.open_run(cfg, ctx.roles, loaders.train, log=lambda m: None, ctx=ctx)
  metrics = list(trainer.train(ctx, loaders, start, checkpointer=checkpointer))
  checkpointer.close()
  params = [np.asarray(x) for x in jax.tree.leaves(ctx.roles[Role.ACTOR].params)]
  return start, metrics, params


def test_a_resumed_episode_run_matches_the_uninterrupted_run(tmp_path):
  # The uninterrupted run saves steps 1 and 2; without step 2 its folder is what a run
  # stopped after step 1 leaves.
  whole = tmp_path / "whole"
  start, metrics, params = _run(whole)
  assert start == 0 and [m["step"] for m in metrics] == [1, 2]
  assert all(m["env/turns_mean"] >= 1 for m in metrics)
  cut = tmp_path / "cut"
  shutil.copytree(whole, cut)
  shutil.rmtree(os.path.join(ck.checkpoint_dir(str(cut)), "2"))
  start2, metrics2, params2 = _run(cut)
  assert start2 == 1 and [m["step"] for m in metrics2] == [2]
  for key in ("env/turns_mean", "env/truncated", "env/errors", "env/reward",
              "response_length", "actor/token_count", "actor/loss", "reward"):
    assert metrics2[0][key] == metrics[1][key], (key, metrics2[0][key], metrics[1][key])
  for got, want in zip(params2, params):
    np.testing.assert_array_equal(got, want)
