"""Asynchronous RL on disjoint processes (run/disjoint.py): one rollout process, one
training process, real jax.distributed processes with SIGKILL deadlines.

* K = 0, 1 and 2 end with weights bitwise equal to the single-process run at the same K
  on the same device split (1 process x 2 devices: rollout on device 0, training on
  device 1, against 2 processes x 1 device), and the same metrics;
* the staleness bound holds: no trained sample is older than K versions;
* two rollout processes + two training processes (each group's collectives among itself)
  generate the same samples as 1 process x 4 devices on the same split, and train to the
  same figures up to float32 reassociation (the training reduces across processes there);
* a peer killed in either group stops the other in one line (the victim is process 1
  either way: process 0 hosts the coordination service, and when it dies JAX itself
  ends the others, the launcher naming process 0; README "Launching").
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from distflow_jax import launcher
from workflow_util import smoke_overrides

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SPLIT = ["placement.rollout.devices=0:1", "placement.actor.devices=1:2",
         "placement.reference.devices=1:2", "data.prompts_per_step=8", "rollout.n=2",
         "actor.micro_batch_size=4"]
SAME = ("reward", "actor/loss", "actor/grad_norm", "tokens", "response_length",
        "async/staleness", "async/staleness_max", "async/dropped")


def _run(tmp_path, procs, devs, k, steps, split=SPLIT):
  out = tmp_path / f"{procs}x{devs}_k{k}.json"
  overrides = smoke_overrides(tmp_path / f"run_{procs}x{devs}_k{k}",
                              f"cluster.devices_per_process={devs}",
                              f"cluster.num_processes={procs}", f"trainer.max_staleness={k}",
                              f"trainer.total_steps={steps}", *split)
  env = dict(os.environ, DISTFLOW_TEST_DIGITS="1")
  result = launcher.launch(procs, devs, [sys.executable, "tests/mp/async_train.py", str(out),
                                         "grpo:tiny", *overrides],
                           timeout_s=400, env=env, out=None)
  assert result.ok, result.describe() + "\n" + "\n".join(sum(result.outputs, [])[-40:])
  trained = sorted(out.parent.glob(out.name + ".*"))  # the training processes'
  rows = [json.loads(f.read_text()) for f in trained]
  assert rows and all([[m.get(k) for k in SAME] for m in r]
                      == [[m.get(k) for k in SAME] for m in rows[0]]
                      and r[-1]["params_sha256"] == rows[0][-1]["params_sha256"]
                      for r in rows), trained
  return rows[0]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("k", [0, 1, 2])  # 0: the synchronous loop, through the transfers
def test_one_rollout_process_and_one_training_process_equal_one_process(tmp_path, k):
  steps = k + 2
  single = _run(tmp_path, 1, 2, k, steps)
  split = _run(tmp_path, 2, 1, k, steps)
  assert [m["step"] for m in split] == [m["step"] for m in single] == list(range(1, steps + 1))
  assert split[-1]["params_sha256"] == single[-1]["params_sha256"]
  for a, b in zip(split, single):
    for key in SAME:
      if k or not key.startswith("async/"):  # the synchronous loop reports none
        assert a[key] == b[key], (a["step"], key, a[key], b[key])
  # The staleness bound: step i trains the samples of version max(0, i - K), exactly.
  assert [m["async/staleness_max"] for m in split] == [min(i, k) for i in range(steps)]
  assert all(m["async/dropped"] == 0.0 for m in split)
  assert any(m["actor/grad_norm"] > 0 for m in split)  # the weights moved


@pytest.mark.timeout(900)
def test_two_rollout_processes_and_two_training_processes(tmp_path):
  split = ["placement.rollout.devices=0:2", "placement.actor.devices=2:4",
           "placement.reference.devices=2:4", *SPLIT[3:]]
  single = _run(tmp_path, 1, 4, 1, 3, split)
  multi = _run(tmp_path, 4, 1, 1, 3, split)
  assert [m["async/staleness_max"] for m in multi] == [0.0, 1.0, 1.0]
  for a, b in zip(multi, single):
    for key in ("reward", "tokens", "response_length", "async/staleness"):
      assert a[key] == b[key], (a["step"], key)
    for key in ("actor/loss", "actor/grad_norm"):  # as test_workflow_multiprocess's REL, ABS
      assert abs(a[key] - b[key]) <= 2e-4 * abs(b[key]) + 1e-6, (a["step"], key)


# Which process trains, which generates (devices 0:1 are process 0's).
GROUPS = {"rollout_killed": ("1:2", "0:1"), "training_killed": ("0:1", "1:2")}


def _start(tmp_path, rollout, training):
  """``distflow-jax train`` on 2 processes x 1 device, its output in files."""
  coord = f"127.0.0.1:{launcher.free_port()}"
  overrides = [f"--config.{o}" for o in smoke_overrides(
      tmp_path / "run", "cluster.devices_per_process=1", "cluster.num_processes=2",
      "trainer.max_staleness=1", "trainer.total_steps=10000", *SPLIT,
      f"placement.rollout.devices={rollout}", f"placement.actor.devices={training}",
      f"placement.reference.devices={training}")]
  procs, logs = [], []
  for i in range(2):
    env = launcher.child_env(dict(os.environ), coordinator=coord, num_processes=2,
                             process_id=i, devices_per_process=1)
    logs.append(tmp_path / f"out{i}.txt")
    with open(logs[-1], "w") as f:
      procs.append(subprocess.Popen(
          [sys.executable, "-m", "distflow_jax.cli", "train", *overrides], env=env, stdout=f,
          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
  return procs, logs


def _kill(procs):
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
    p.wait()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(GROUPS))
def test_a_killed_peer_in_either_group_stops_the_other_in_one_line(tmp_path, case):
  procs, logs = _start(tmp_path, *GROUPS[case])
  victim, survivor = procs[1], procs[0]
  metrics = tmp_path / "run" / "metrics.jsonl"
  try:
    deadline = time.monotonic() + 200
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
      assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
          logs[0].read_text()[-3000:], logs[1].read_text()[-3000:])
      time.sleep(0.2)
    os.killpg(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    survivor.wait(timeout=120)
    took = time.monotonic() - killed
  finally:
    _kill(procs)
  out = logs[0].read_text()
  assert survivor.returncode == 1, out[-3000:]
  assert took < 30, (took, out[-3000:])
  lines = [l for l in out.splitlines() if "lost process" in l]
  # The watchdog's line or the command's (whichever notices first), one of them.
  assert len(lines) == 1 and lines[0].startswith("distflow-jax") and (
      "lost process 1 of 2" in lines[0]), out[-3000:]
  assert "Check failure" not in out and "Traceback" not in out, out[-3000:]


@pytest.mark.timeout(400)
def test_the_rollout_process_waits_for_the_trainer_at_the_end(tmp_path):
  """With K = 1 and 2 steps the rollout process makes both batches from version 0 and is
  done while the trainer still compiles its first step; jax's shutdown barrier (1 s here)
  must not be where it waits."""
  overrides = [f"--config.{o}" for o in smoke_overrides(
      tmp_path / "run", "cluster.devices_per_process=1", "cluster.num_processes=2",
      "trainer.max_staleness=1", "trainer.total_steps=2", *SPLIT)]
  env = dict(os.environ, DISTFLOW_SHUTDOWN_TIMEOUT_S="1")
  result = launcher.launch(2, 1, [sys.executable, "-m", "distflow_jax.cli", "train",
                                  *overrides], timeout_s=300, env=env, out=None)
  assert result.ok, result.describe() + "\n" + "\n".join(sum(result.outputs, [])[-30:])
  rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(r)["step"] for r in rows] == [1, 2]


@pytest.mark.timeout(300)
def test_a_run_dir_with_checkpoints_is_refused_in_one_line(tmp_path):
  """No checkpoint is saved or restored on disjoint processes yet: a run dir that holds
  checkpoints would otherwise be started over in silence (its metrics mixed)."""
  (tmp_path / "run" / "checkpoints" / "1").mkdir(parents=True)  # a committed step's name
  overrides = [f"--config.{o}" for o in smoke_overrides(
      tmp_path / "run", "cluster.devices_per_process=1", "cluster.num_processes=2",
      "trainer.max_staleness=1", *SPLIT)]
  result = launcher.launch(2, 1, [sys.executable, "-m", "distflow_jax.cli", "train",
                                  *overrides], timeout_s=200, env=dict(os.environ), out=None)
  assert result.first_failure is not None and result.first_failure[1] == 2, result.describe()
  out = result.outputs[result.first_failure[0]]  # the others are stopped by the launcher
  errors = [l for l in out if l.startswith("distflow-jax train: error:")]
  assert len(errors) == 1 and "cannot resume yet" in errors[0] and (
      "holds checkpoints of steps [1]; choose another --config.run_dir" in errors[0]), out
  assert not any("Traceback" in l for l in out), out[-20:]
