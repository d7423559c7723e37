"""Asynchronous RL (``trainer.max_staleness``, run/async_rollout.py) on 8 simulated devices
split 4 + 4: the rollout on devices 0:4, the training on 4:8.

* K = 1 follows the fixed version schedule: its weights equal, bitwise, a sequential
  replay that generates batch j with version max(0, j - 1) by hand;
* the result does not depend on thread timing (a slowed rollout thread changes nothing);
* an interrupted K = 1 run resumed from its checkpoint equals the uninterrupted one,
  bitwise (the batch in flight is saved with the loader's state);
* K = 0 is the synchronous loop, bitwise.
"""

import dataclasses
import os
import shutil
import time

import jax
import numpy as np
import pytest

from distflow_jax.config import async_checks, loading
from distflow_jax.dag.spec import Role
from distflow_jax.persist import checkpoint as ck
from distflow_jax.run import async_rollout, executor, trainer
from distflow_jax.state.metrics import Metrics
from workflow_util import smoke_overrides

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SPLIT = ["placement.rollout.devices=0:4", "placement.actor.devices=4:8",
         "placement.reference.devices=4:8"]
STEPS = 3


def config(run_dir, k, *extra):
  cfg = loading.load("grpo:tiny", smoke_overrides(
      run_dir, f"trainer.total_steps={STEPS}", f"trainer.max_staleness={k}",
      "data.prompts_per_step=8", "rollout.n=2", "actor.micro_batch_size=4",
      "trainer.save_every=1", "trainer.keep=0", "plugins=('plugin_length_reward',)",
      *SPLIT, *extra))
  # A reward that varies within a prompt's samples for an untrained model: weights move.
  cfg.dag = [dict(d, fn="reward.digits") if d["fn"] == "reward.math" else dict(d)
             for d in cfg.dag]
  return cfg


def weights(ctx):
  return [np.asarray(x) for x in jax.tree.leaves(ctx.roles[Role.ACTOR].params)]


def run(cfg):
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  checkpointer, start = ck.open_run(cfg, ctx.roles, loaders.train, log=lambda m: None, ctx=ctx)
  try:
    metrics = list(trainer.train(ctx, loaders, start, checkpointer=checkpointer))
  finally:
    checkpointer.close()
  return start, metrics, weights(ctx)


def assert_same(got, want):
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
  """The uninterrupted K = 1 run, a checkpoint after every step."""
  run_dir = str(tmp_path_factory.mktemp("whole"))
  start, metrics, params = run(config(run_dir, 1))
  assert start == 0
  return run_dir, metrics, params


@pytest.fixture(scope="module")
def sync(tmp_path_factory):
  """The K = 0 run of the same config: the synchronous loop's metrics and weights."""
  start, metrics, params = run(config(str(tmp_path_factory.mktemp("sync")), 0))
  assert start == 0
  return metrics, params


def sequential_replay(cfg, k):
  """Asynchronous K by hand, in one thread: batch j generated with version max(0, j - k)
  (the actor's weights after that many train steps), trained at step j."""
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  stage = async_checks.rollout_stage(ctx.plan)
  prefix, lay = ctx.plan.steps[:stage], ctx.layout(ctx.plan.steps[0].layout)
  actor = ctx.roles[Role.ACTOR]

  def generate(j, params):
    mine = dataclasses.replace(ctx, step=j, roles={
        **ctx.roles, Role.ACTOR: dataclasses.replace(actor, params=params)})
    metrics = Metrics()
    return executor.run_steps(mine, prefix, next(loaders.train), None, metrics)[0], metrics

  batches = {}
  for i in range(STEPS):
    copy = jax.device_put(ctx.roles[Role.ACTOR].params, may_alias=False)  # version i
    for j in ([*range(0, min(k, STEPS - 1) + 1)] if i == 0 else
              [i + k] if i + k < STEPS else []):
      batches[j] = generate(j, copy)
    ctx.step = i
    batch, metrics = batches.pop(i)
    executor.run_rest(ctx, batch, lay, stage, time.perf_counter(), metrics)
  return weights(ctx)


def test_k1_follows_the_version_schedule(whole, sync, tmp_path):
  _, metrics, params = whole
  assert [m["async/staleness"] for m in metrics] == [0.0, 1.0, 1.0]
  assert [m["async/staleness_max"] for m in metrics] == [0.0, 1.0, 1.0]
  assert all(m["async/dropped"] == 0.0 for m in metrics)
  assert all(m["actor/skipped"] == 0.0 for m in metrics)
  assert_same(params, sequential_replay(config(str(tmp_path / "replay"), 1), 1))
  # Not the synchronous result: step 2 trained samples of the previous version.
  assert any(not np.array_equal(a, b) for a, b in zip(params, sync[1]))


def test_results_do_not_depend_on_thread_timing(whole, tmp_path, monkeypatch):
  slow = async_rollout.AsyncRollout._generate

  def late(self, index, *args):
    time.sleep(1.0 if index % 2 else 0.0)  # the trainer waits on odd batches
    return slow(self, index, *args)

  monkeypatch.setattr(async_rollout.AsyncRollout, "_generate", late)
  _, metrics, params = run(config(str(tmp_path / "late"), 1))
  assert_same(params, whole[2])
  for got, want in zip(metrics, whole[1]):
    for key in ("reward", "actor/loss", "actor/grad_norm", "async/staleness"):
      assert got[key] == want[key], key


def test_resumed_k1_run_equals_the_uninterrupted_one(whole, tmp_path):
  run_dir, metrics, params = whole
  cut = str(tmp_path / "cut")
  shutil.copytree(run_dir, cut)
  for step in range(2, STEPS + 1):  # as if the run had stopped after step 1
    shutil.rmtree(os.path.join(ck.checkpoint_dir(cut), str(step)))
  start, resumed, got = run(config(cut, 1))
  assert start == 1
  assert_same(got, params)
  for a, b in zip(resumed, metrics[1:]):
    for key in ("step", "reward", "actor/loss", "actor/grad_norm", "async/staleness"):
      assert a[key] == b[key], key


def test_zero_staleness_is_the_synchronous_loop_bitwise(sync, tmp_path):
  metrics, params = sync
  assert len(metrics) == STEPS
  assert not any(k.startswith("async/") for m in metrics for k in m)
  ctx, loaders = trainer.setup(config(str(tmp_path / "loop"), 0), log=lambda m: None)
  for step in range(STEPS):  # today's loop: generate, score, train, one step after the other
    ctx.step = step
    executor.run_step(ctx, next(loaders.train))
  assert_same(params, weights(ctx))
