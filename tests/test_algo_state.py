"""Algorithm state across steps (issue 18): typed, saved with the checkpoint, resumed exactly.

The adaptive KL-in-reward coefficient is the state today.  A PPO run of 4
steps and the same run stopped after 2 and resumed must end with bitwise-equal
weights and the same kl_coef every step; a checkpoint written before the
state was saved restores the config's defaults, or is refused in one line when
the run adapts its coefficient.
"""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from distflow_jax.config import loading
from distflow_jax.dag.spec import Role
from distflow_jax.state import algo_state
from distflow_jax.run import trainer
from distflow_jax.persist import checkpoint as ck
from distflow_jax.state.algo_state import AlgoState
from test_checkpoint import data  # noqa: F401  (a fixture)
from test_checkpoint import cfg, host, loader, mesh, model_cfg, perturb, roles_on
from workflow_util import smoke_overrides


def adaptive(c):
  c.actor.kl.in_reward, c.actor.kl.target, c.actor.kl.coef = True, 1.0, 0.01
  return c


def test_state_round_trips_through_json():
  s = AlgoState(kl_coef=0.0009840000420808792)
  assert AlgoState.from_dict(json.loads(json.dumps(s.to_dict()))) == s
  assert AlgoState.from_dict({}) == AlgoState()  # an older version's fields: defaults
  with pytest.raises(ValueError, match=r"unknown algorithm state \['beta'\]"):
    AlgoState.from_dict({"beta": 1.0})


def test_after_step_adapts_only_an_adaptive_coefficient():
  c = cfg()
  c.data.prompts_per_step, c.rollout.n, c.actor.kl.horizon = 10, 10, 1000
  assert algo_state.after_step(c, AlgoState(), {"kl_penalty": 0.5}) == AlgoState()
  adaptive(c)
  assert algo_state.after_step(c, AlgoState(), {}) == AlgoState()  # no KL measured
  # Far above the target: the clipped factor 1 + 0.2 * 100 / 1000, from actor.kl.coef.
  got = algo_state.after_step(c, AlgoState(), {"kl_penalty": 5.0}).kl_coef
  assert got == pytest.approx(0.01 * 1.02, rel=1e-6)
  assert algo_state.after_step(c, AlgoState(0.5), {"kl_penalty": 5.0}).kl_coef == (
      pytest.approx(0.5 * 1.02, rel=1e-6))


def test_restored_rules():
  c = cfg()
  assert algo_state.restored(c, None) == AlgoState()  # nothing adapts: defaults are exact
  assert algo_state.restored(c, {"kl_coef": 0.3}) == AlgoState()  # adaptive KL turned off
  adaptive(c)
  assert algo_state.restored(c, None) is None  # would silently restart: refused
  assert algo_state.restored(c, {"kl_coef": 0.3}) == AlgoState(0.3)


class Ctx:
  def __init__(self, state=AlgoState()):
    self.algo_state = state


def test_checkpoint_saves_and_restores_the_state(tmp_path, data):
  c = adaptive(cfg())
  mcfg = model_cfg()
  roles = roles_on(mesh(2, fsdp=2), mcfg)
  saver = ck.Checkpointer(str(tmp_path / "ck"), save_every=1, keep=3, log=lambda m: None,
                          ctx=Ctx(AlgoState(kl_coef=0.123)))
  saver.save(1, roles, loader(data), c, mcfg)
  saver.close()
  into = Ctx()
  back = ck.Checkpointer(str(tmp_path / "ck"), save_every=1, keep=3, log=lambda m: None,
                         ctx=into)
  back.restore(1, roles_on(mesh(2, fsdp=2), mcfg, seed=1), loader(data), c)
  assert into.algo_state == AlgoState(kl_coef=0.123)
  # The state has to go somewhere: a checkpointer without the run's context refuses.
  with pytest.raises(ValueError, match=r"open_run\(\.\.\., ctx=ctx\)"):
    ck.Checkpointer(str(tmp_path / "ck"), save_every=1, keep=3, log=lambda m: None).restore(
        1, roles_on(mesh(2, fsdp=2), mcfg, seed=1), loader(data), c)


def test_checkpoint_without_state_restores_defaults_or_refuses(tmp_path, data):
  """A checkpoint of the version before (no algo_state in its meta)."""
  c = cfg()
  c.run_dir = str(tmp_path / "run")
  mcfg = model_cfg()
  roles = roles_on(mesh(2, fsdp=2), mcfg)
  perturb(roles, 0.5)
  want = host(roles[Role.ACTOR].params)
  old = ck.Checkpointer(ck.checkpoint_dir(c.run_dir), save_every=1, keep=3, log=lambda m: None)
  old.save(2, roles, loader(data), c, mcfg)
  old.close()
  # Nothing adapts in this run: the defaults are the exact state.
  into, fresh = Ctx(AlgoState(kl_coef=9.0)), roles_on(mesh(2, fsdp=2), mcfg, seed=1)
  checkpointer, start = ck.open_run(c, fresh, loader(data), log=lambda m: None, ctx=into)
  checkpointer.close()
  assert start == 2 and into.algo_state == AlgoState()
  for got, exp in zip(host(fresh[Role.ACTOR].params), want):
    np.testing.assert_array_equal(got, exp)
  # An adaptive coefficient would restart at actor.kl.coef: refused, in one line.
  with pytest.raises(ck.CheckpointError) as e:
    ck.open_run(adaptive(c), roles_on(mesh(2, fsdp=2), mcfg), loader(data),
                log=lambda m: None, ctx=Ctx())
  msg = str(e.value)
  assert "\n" not in msg and "(step 2) holds no algorithm state" in msg
  assert "actor.kl.target=1.0" in msg and "start a new run_dir" in msg


def ppo_run(run_dir):
  c = loading.load("ppo:tiny", smoke_overrides(
      run_dir, "cluster.devices_per_process=8", "data.prompts_per_step=8",
      "actor.micro_batch_size=1", "critic.micro_batch_size=1", "actor.kl.coef=0.05",
      "actor.kl.target=1.0", "actor.kl.horizon=100", "trainer.total_steps=4",
      "trainer.save_every=2"))
  ctx, loaders = trainer.setup(c, log=lambda m: None)
  checkpointer, start = ck.open_run(c, ctx.roles, loaders.train, log=lambda m: None, ctx=ctx)
  metrics = list(trainer.train(ctx, loaders, start, checkpointer=checkpointer))
  checkpointer.close()
  params = [np.asarray(x) for x in jax.tree.leaves(ctx.roles[Role.ACTOR].params)]
  return start, metrics, params, ctx


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resumed_ppo_matches_the_uninterrupted_run_bitwise(tmp_path):
  # The uninterrupted run saves steps 2 and 4; its step-2 checkpoint is what a run stopped
  # after step 2 leaves (same code, same state), so removing step 4 makes that run, and
  # the copy only costs one more model build and compile.
  whole = str(tmp_path / "whole")
  start, metrics, params, ctx = ppo_run(whole)
  assert start == 0 and ctx.kl_coef is not None
  coefs = [m["kl_coef"] for m in metrics]
  assert coefs[0] == 0.05 and len(set(coefs)) == 4  # it adapts every step
  cut = str(tmp_path / "cut")
  shutil.copytree(whole, cut)
  shutil.rmtree(os.path.join(ck.checkpoint_dir(cut), "4"))
  start2, metrics2, params2, ctx2 = ppo_run(cut)
  assert start2 == 2
  assert [m["kl_coef"] for m in metrics2] == coefs[2:]
  assert ctx2.algo_state == ctx.algo_state
  for got, want in zip(params2, params):
    np.testing.assert_array_equal(got, want)
