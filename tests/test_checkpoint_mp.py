"""Checkpoint, peer loss and resume across 2 real processes x 2 CPU devices.

One uninterrupted run (3 steps, a checkpoint after every step) is the
reference.  A second run with the same seed has its process 1 SIGKILLed
while the step-2 checkpoint is being written: process 0 must exit non-zero
within 60 s naming process 1, the half-written checkpoint must be ignored,
and ``--resume`` must finish the run from step 1 with the same metrics and
bitwise the same parameters as the reference.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from distflow_jax import launcher
from distflow_jax.persist import checkpoint as ck

pytestmark = pytest.mark.multiprocess

STEPS = 3
ARGS = ["--config=configs/grpo.py:tiny", "--config.model.preset=micro",
        "--config.cluster.devices_per_process=2", "--config.model.warmstart.steps=0",
        "--config.data.eval_size=8", "--config.trainer.eval_every=0",
        "--config.data.prompts_per_step=4", "--config.rollout.max_new_tokens=8",
        "--config.rollout.n=4", "--config.actor.micro_batch_size=4",
        # Entropy keeps the gradient non-zero even when every reward is 0, so the
        # parameters and the optimizer moments really move from step to step.
        "--config.actor.entropy_coef=0.01", "--config.trainer.save_every=1",
        f"--config.trainer.total_steps={STEPS}"]


def train_cmd(run_dir, *extra):
  return [sys.executable, "-m", "distflow_jax.cli", "train", *ARGS,
          f"--config.run_dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  # Later runs reuse the first run's compiled programs.
  cache = tmp_path_factory.mktemp("jax_cache")
  return dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
              JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def launch(cmd, env, timeout_s=400):
  result = launcher.launch(2, 2, cmd, timeout_s=timeout_s, env=env, out=None)
  assert result.ok, result.describe() + "\n" + "\n".join(sum(result.outputs, [])[-60:])
  return result


def metrics(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(l) for l in f]
  # Times and compile counts differ between runs (the second loads the first's compiled
  # programs from the cache): what the run computed may not.
  return {r["step"]: {k: v for k, v in r.items()
                      if not k.startswith(("time/", "tokens_per_s", "compile/"))}
          for r in rows}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, env):
  run = str(tmp_path_factory.mktemp("uninterrupted"))
  launch(train_cmd(run), env)
  return run


class Procs:
  """2 processes started by hand (the launcher would stop the survivor itself)."""

  def __init__(self, cmd, env):
    coord = f"127.0.0.1:{launcher.free_port()}"
    self.lines = [[], []]
    self.procs = []
    for i in range(2):
      p = subprocess.Popen(cmd, env=launcher.child_env(env, coordinator=coord, num_processes=2,
                                                       process_id=i, devices_per_process=2),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           stdin=subprocess.DEVNULL, start_new_session=True)
      threading.Thread(target=lambda p=p, i=i: [self.lines[i].append(l) for l in p.stdout],
                       daemon=True).start()
      self.procs.append(p)

  def kill_all(self):
    for p in self.procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
      p.wait()


@pytest.mark.timeout(900)
def test_peer_killed_during_save_then_resume_matches_uninterrupted(tmp_path, env,
                                                                    uninterrupted):
  run = str(tmp_path / "run")
  saving = os.path.join(ck.checkpoint_dir(run), "2.orbax-checkpoint-tmp")
  procs = Procs(train_cmd(run), env)
  try:
    deadline = time.monotonic() + 400
    while not os.path.exists(saving):
      assert time.monotonic() < deadline and procs.procs[0].poll() is None, procs.lines
      time.sleep(0.005)
    os.killpg(procs.procs[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    rc = procs.procs[0].wait(timeout=120)
    took = time.monotonic() - killed
  finally:
    procs.kill_all()
  out = "\n".join(procs.lines[0])
  assert rc != 0, out[-3000:]
  assert took < 60, took
  assert "lost process 1 of 2" in out, out[-3000:]
  # The save of step 2 never committed; step 1 is the latest complete checkpoint.
  assert not os.path.isdir(os.path.join(ck.checkpoint_dir(run), "2"))

  resumed = launch(train_cmd(run, "--resume"), env)
  log = "\n".join(resumed.outputs[0])
  assert "ignoring the incomplete save" in log and "2.orbax-checkpoint-tmp" in log, log
  assert "(step 1)" in log, log

  want, got = metrics(uninterrupted), metrics(run)
  assert sorted(got) == list(range(1, STEPS + 1))
  # Step 1 ran before the kill in both runs: a difference there is not the resume's.
  assert got[1] == want[1], ("two fresh runs with the same seed differ at step 1, before any "
                             "restore", got[1], want[1])
  for step in range(2, STEPS + 1):
    assert got[step] == want[step], (step, got[step], want[step])
  step_w, arrays_w, _ = ck.read_arrays(ck.checkpoint_dir(uninterrupted))
  step_g, arrays_g, _ = ck.read_arrays(ck.checkpoint_dir(run))
  assert step_w == step_g == STEPS
  assert sorted(arrays_w) == sorted(arrays_g)
  for name in arrays_w:  # same layout, same seed: bitwise
    np.testing.assert_array_equal(arrays_g[name], arrays_w[name], err_msg=name)
  _, first, _ = ck.read_arrays(ck.checkpoint_dir(run), 1)
  moved = sum(not np.array_equal(first[n], arrays_w[n]) for n in arrays_w if ".params." in n)
  assert moved > 0  # training changed the parameters between the checkpoints
