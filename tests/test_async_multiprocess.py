"""Asynchronous RL on disjoint processes (run/disjoint.py): one rollout process, one
training process, real jax.distributed processes with SIGKILL deadlines.

* K = 0, 1 and 2 end with weights bitwise equal to the single-process run at the same K
  on the same device split (1 process x 2 devices: rollout on device 0, training on
  device 1, against 2 processes x 1 device), and the same metrics, the held-out
  evaluation's included (the rollout process evaluates);
* the staleness bound holds: no trained sample is older than K versions;
* two rollout processes driving one tensor-parallel replica + two training processes
  generate the same samples as 1 process x 4 devices, train to the same figures up to
  float32 reassociation;
* unequal groups (run/links.py): 1 rollout device against a 2-device actor, and 2 against
  1, on 2 x 2 processes equal 1 process x 4 devices on the same split, bitwise;
* a run killed while it saves, resumed, ends bitwise where the uninterrupted run ends,
  with one process a group (2 rollout devices, a 1-device actor) and with two (2 + 2);
* a peer killed in either group stops the other in one line (the victim is process 1
  either way; process 0's death, which takes the coordination service with it, is
  tests/test_peer_watchdog.py's; docs/launching.md).
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from distflow_jax import launcher
from distflow_jax.persist import checkpoint as ck
from workflow_util import smoke_overrides

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SPLIT = ["placement.rollout.devices=0:1", "placement.actor.devices=1:2",
         "placement.reference.devices=1:2", "data.prompts_per_step=8", "rollout.n=2",
         "actor.micro_batch_size=4"]
EVAL = ("eval/accuracy", "eval/response_length", "eval/formatted")
SAME = ("reward", "actor/loss", "actor/grad_norm", "tokens", "response_length",
        "async/staleness", "async/staleness_max", "async/dropped")


def _run(tmp_path, procs, devs, k, steps, split=SPLIT, *extra):
  out = tmp_path / f"{procs}x{devs}_k{k}.json"
  overrides = smoke_overrides(tmp_path / f"run_{procs}x{devs}_k{k}",
                              f"cluster.devices_per_process={devs}",
                              f"cluster.num_processes={procs}", f"trainer.max_staleness={k}",
                              f"trainer.total_steps={steps}", *split, *extra)
  env = dict(os.environ, DISTFLOW_TEST_DIGITS="1")
  result = launcher.launch(procs, devs, [sys.executable, "tests/mp/async_train.py", str(out),
                                         "grpo:tiny", *overrides],
                           timeout_s=400, env=env, out=None)
  assert result.ok, result.describe() + "\n" + "\n".join(sum(result.outputs, [])[-40:])
  trained = sorted(out.parent.glob(out.name + ".[0-9]*"))  # the training processes'
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
  # K = 1 evaluates at steps 0, 2 and 3: on disjoint processes the rollout process
  # evaluates each version as it arrives (the last one makes no batch).
  extra = ["trainer.eval_every=2"] if k == 1 else []
  single = _run(tmp_path, 1, 2, k, steps, SPLIT, *extra)
  split = _run(tmp_path, 2, 1, k, steps, SPLIT, *extra)
  evals = [[m.get(n) for n in EVAL] for m in split if "eval/accuracy" in m]
  assert evals == [[m.get(n) for n in EVAL] for m in single if "eval/accuracy" in m]
  assert [m["step"] for m in split if "eval/accuracy" in m] == ([0, 2, 3] if k == 1 else [])
  if k == 1:  # one process evaluates its own held-out batch; a training process draws none
    assert single[-1]["eval_rows_drawn"] > 0 and split[-1]["eval_rows_drawn"] == 0
  split, single = [m for m in split if m["step"]], [m for m in single if m["step"]]
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
           "placement.reference.devices=2:4", "rollout.tensor_parallel=2", *SPLIT[3:]]
  single = _run(tmp_path, 1, 4, 1, 3, split)
  multi = _run(tmp_path, 4, 1, 1, 3, split)
  for p in (0, 1):  # one replica over both rollout processes (dag/replicas.py)
    assert json.loads((tmp_path / f"4x1_k1.json.replicas.{p}").read_text()) == [[0, 1]]
  assert [m["async/staleness_max"] for m in multi] == [0.0, 1.0, 1.0]
  for a, b in zip(multi, single):
    for key in ("reward", "tokens", "response_length", "async/staleness"):
      assert a[key] == b[key], (a["step"], key)
    for key in ("actor/loss", "actor/grad_norm"):  # as test_workflow_multiprocess's REL, ABS
      assert abs(a[key] - b[key]) <= 2e-4 * abs(b[key]) + 1e-6, (a["step"], key)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("rollout,training", [("3:4", "0:2"), ("2:4", "0:1")],
                         ids=["1_rollout_device_2_training", "2_rollout_devices_1_training"])
def test_groups_of_unequal_device_counts(tmp_path, rollout, training):
  """Weights and batches move in blocks of the smaller group's size (run/links.py): the
  actor cut into two blocks, block 0 copied, each half of a batch to its training device;
  or the actor copied onto each rollout device, a batch's halves concatenated.  Against
  one process of four devices: the same samples, staleness, figures and weights."""
  split = [f"placement.rollout.devices={rollout}", f"placement.actor.devices={training}",
           f"placement.reference.devices={training}", *SPLIT[3:]]
  single = _run(tmp_path, 1, 4, 1, 3, split)
  multi = _run(tmp_path, 2, 2, 1, 3, split)
  assert [m["async/staleness_max"] for m in multi] == [0.0, 1.0, 1.0]
  # The training is one process's either way: the same figures and weights, bitwise.
  assert multi[-1]["params_sha256"] == single[-1]["params_sha256"]
  for a, b in zip(multi, single):
    for key in SAME:
      assert a[key] == b[key], (a["step"], key, a[key], b[key])
  assert any(m["actor/grad_norm"] > 0 for m in multi)


# Which process trains, which generates (devices 0:1 are process 0's).  The training
# processes of a run that checkpoints (the train command) include process 0, where orbax
# writes a checkpoint's shared files; a killed training process 1 is seen through the
# test child, which saves nothing (process 0 hosts the coordination service: when it dies
# JAX itself ends the others, docs/launching.md).
GROUPS = {"rollout_killed": ("1:2", "0:1"), "training_killed": ("0:1", "1:2")}
TRAIN_FIRST = ["placement.rollout.devices=1:2", "placement.actor.devices=0:1",
               "placement.reference.devices=0:1", *SPLIT[3:]]


def _overrides(run_dir, *extra, procs=2, devs=1):
  return smoke_overrides(run_dir, f"cluster.devices_per_process={devs}",
                         f"cluster.num_processes={procs}", *extra)


def _train(overrides, *flags):  # the train command with these config overrides
  return [sys.executable, "-m", "distflow_jax.cli", "train",
          *[f"--config.{o}" for o in overrides], *flags]


def _start(tmp_path, rollout, training, steps=10000, env=None, *extra, n=2, devs=1):
  """``n`` processes x ``devs`` devices started by hand, their output in files: ``distflow-jax
  train`` when the training holds process 0, else the test child (it saves no checkpoint)."""
  coord = f"127.0.0.1:{launcher.free_port()}"
  overrides = _overrides(tmp_path / "run", "trainer.max_staleness=1",
                         f"trainer.total_steps={steps}", *SPLIT,
                         f"placement.rollout.devices={rollout}",
                         f"placement.actor.devices={training}",
                         f"placement.reference.devices={training}", *extra, procs=n, devs=devs)
  cmd = _train(overrides) if training.startswith("0:") else [
      sys.executable, "tests/mp/async_train.py", str(tmp_path / "out.json"), "grpo:tiny",
      *overrides]
  procs, logs = [], []
  for i in range(n):
    child = launcher.child_env(dict(env or os.environ), coordinator=coord, num_processes=n,
                               process_id=i, devices_per_process=devs)
    logs.append(tmp_path / f"out{i}.txt")
    with open(logs[-1], "w") as f:
      procs.append(subprocess.Popen(
          cmd, env=child, stdout=f, stderr=subprocess.STDOUT,
          stdin=subprocess.DEVNULL, start_new_session=True))
  return procs, logs


def _kill(procs):
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def _steps_done(tmp_path, logs, training) -> int:
  if training.startswith("0:"):
    metrics = tmp_path / "run" / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0
  return logs[1].read_text().count("\nstep ") if logs[1].exists() else 0


# The killed training process 0 takes the coordination service with it: jax's client
# aborts the rollout process at once, and the watchdog usually names it first, but it is
# a race (docs/launching.md), so that case tries up to three times.
KILLS = {**{case: (*groups, 1) for case, groups in GROUPS.items()},
         "training_process_0_killed": (*GROUPS["rollout_killed"], 0)}


def _kill_mid_run(tmp_path, case):
  """Kills one process after two steps; the survivor's code, seconds to its end, output."""
  rollout, training, dead = KILLS[case]
  procs, logs = _start(tmp_path, rollout, training)
  victim, survivor = procs[dead], procs[1 - dead]
  try:
    deadline = time.monotonic() + 200
    while _steps_done(tmp_path, logs, training) < 2:
      assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
          logs[0].read_text()[-3000:], logs[1].read_text()[-3000:])
      time.sleep(0.2)
    os.killpg(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    survivor.wait(timeout=120)
    took = time.monotonic() - killed
  finally:
    _kill(procs)
  return survivor.returncode, took, logs[1 - dead].read_text()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(KILLS))
def test_a_killed_peer_in_either_group_stops_the_other_in_one_line(tmp_path, case):
  dead = KILLS[case][2]
  for attempt in range(3 if dead == 0 else 1):
    (tmp_path / str(attempt)).mkdir()
    code, took, out = _kill_mid_run(tmp_path / str(attempt), case)
    if not (dead == 0 and code == -signal.SIGABRT and "leader task" in out):
      break  # not jax's abort on process 0's death, which may win the race
  assert code == 1, out[-3000:]
  assert took < 30, (took, out[-3000:])
  lines = [l for l in out.splitlines() if "lost process" in l]
  # The watchdog's line or the command's (whichever notices first), one of them.
  assert len(lines) == 1 and lines[0].startswith("distflow-jax") and (
      f"lost process {dead} of 2" in lines[0]), out[-3000:]
  assert "Check failure" not in out and "Traceback" not in out, out[-3000:]


@pytest.mark.timeout(400)
def test_the_rollout_process_waits_for_the_trainer_at_the_end(tmp_path):
  """With K = 1 and 2 steps the rollout process makes both batches from version 0 and is
  done while the trainer still compiles its first step; jax's shutdown barrier (1 s here)
  must not be where it waits."""
  overrides = _overrides(tmp_path / "run", "trainer.max_staleness=1", "trainer.total_steps=2",
                         *TRAIN_FIRST)
  env = dict(os.environ, DISTFLOW_SHUTDOWN_TIMEOUT_S="1")
  result = launcher.launch(2, 1, _train(overrides), timeout_s=300, env=env, out=None)
  assert result.ok, result.describe() + "\n" + "\n".join(sum(result.outputs, [])[-30:])
  rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(r)["step"] for r in rows] == [1, 2]


@pytest.mark.timeout(300)
def test_training_without_process_0_is_refused_in_one_line(tmp_path):
  """The train command checkpoints; with the rollout on process 0 it cannot (orbax writes
  a checkpoint's shared files from process 0): one line before any step, on both sides."""
  overrides = _overrides(tmp_path / "run", "trainer.max_staleness=1", *SPLIT)
  result = launcher.launch(2, 1, _train(overrides), timeout_s=200, env=dict(os.environ),
                           out=None)
  assert result.first_failure is not None and result.first_failure[1] == 2, result.describe()
  out = result.outputs[result.first_failure[0]]  # the others are stopped by the launcher
  errors = [l for l in out if l.startswith("distflow-jax train: error:")]
  assert len(errors) == 1 and "must include process 0" in errors[0] and (
      "--config.placement.rollout.devices=1:2" in errors[0]), out
  assert not any("Traceback" in l for l in out), out[-20:]
  assert not (tmp_path / "run" / "metrics.jsonl").exists()


RESUME_STEPS, RESUME_K = 5, 2


def _metrics(run_dir):
  rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: {k: v for k, v in r.items()
                      if not k.startswith(("time/", "tokens_per_s", "compile/"))}
          for r in rows}


# (processes, devices each, rollout devices, training devices): a process a group with
# unequal device counts (run/links.py), and two processes a group.
RESUME_SPLITS = {"1+1_unequal": (2, 2, "2:4", "0:1"), "2+2": (4, 1, "2:4", "0:2")}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("split", sorted(RESUME_SPLITS))
def test_a_killed_run_resumed_equals_the_uninterrupted_one(tmp_path, split):
  """K = 2, a checkpoint after every step: every process is SIGKILLed while step 2's
  checkpoint is written; ``--resume`` starts from the last committed step with its two
  batches in flight (saved by the training processes, the rollout processes' prompt
  positions with them) and ends bitwise where the uninterrupted run ends, every step's
  metrics equal: no sample lost, none trained twice, none generated by another version.
  With two processes a group, each group's collectives span its two processes."""
  procs_n, devs, rollout, training = RESUME_SPLITS[split]
  cache = tmp_path / "jax_cache"
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  common = [f"trainer.max_staleness={RESUME_K}", f"trainer.total_steps={RESUME_STEPS}",
            "trainer.save_every=1", "trainer.keep=0", "actor.entropy_coef=0.01",
            f"placement.rollout.devices={rollout}", f"placement.actor.devices={training}",
            f"placement.reference.devices={training}", *SPLIT[3:]]
  whole = tmp_path / "whole"

  def train(run_dir, *flags):
    result = launcher.launch(procs_n, devs, _train(_overrides(run_dir, *common, procs=procs_n,
                                                              devs=devs), *flags),
                             timeout_s=400, env=env, out=None)
    assert result.ok, result.describe() + "\n" + "\n".join(sum(result.outputs, [])[-40:])
    return result

  train(whole)
  cut = tmp_path / "cut"
  saving = ck.checkpoint_dir(str(cut / "run"))
  cut.mkdir()
  procs, logs = _start(cut, rollout, training, RESUME_STEPS, env, *common, n=procs_n,
                       devs=devs)
  try:
    deadline = time.monotonic() + 300
    while not (os.path.exists(os.path.join(saving, "2.orbax-checkpoint-tmp"))
               or os.path.isdir(os.path.join(saving, "2"))):
      assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
          [log.read_text()[-3000:] for log in logs])
      time.sleep(0.005)
  finally:
    _kill(procs)
  held = ck.Checkpointer(saving, save_every=1, keep=0, log=lambda m: None).steps()
  assert held and held[-1] < RESUME_STEPS, held  # killed mid-run, a step saved
  resumed = train(cut / "run", "--resume")
  log = "\n".join(resumed.outputs[0])
  assert f"(step {held[-1]})" in log, log[-3000:]
  want, got = _metrics(whole), _metrics(cut / "run")
  assert sorted(got) == sorted(want) == list(range(1, RESUME_STEPS + 1))
  for step in want:
    assert got[step] == want[step], (step, got[step], want[step])
  assert [want[s]["async/staleness_max"] for s in sorted(want)] == [0, 1, 2, 2, 2]
  _, a, _ = ck.read_arrays(ck.checkpoint_dir(str(whole)))
  _, b, _ = ck.read_arrays(saving)
  assert sorted(a) == sorted(b)
  for name in a:
    np.testing.assert_array_equal(b[name], a[name], err_msg=name)
  _, first, _ = ck.read_arrays(saving, 1)
  assert any(not np.array_equal(first[n], a[n]) for n in a if ".params." in n)  # it trained


@pytest.mark.timeout(180)
def test_a_sender_waits_until_its_copy_has_arrived_before_it_runs_on(tmp_path):
  """A cross-process copy's bytes leave the sender's device only when that device gets to
  them: behind any program its main thread dispatches after issuing the copy (a manual
  run without the acknowledgement: the copy arrived 2.0 s after the sender's 0.6-0.75 s
  program began, after it ended).  That made K = 1 on disjoint processes fall into
  lock-step (the trainer's next train step went ahead of the weights it had just "sent",
  so the rollout waited a whole train step).  Each copy is now acknowledged by its
  receivers and the sender's transfer thread waits for that: the program starts only
  after the copy arrived (process 1 sleeps 1 s before acknowledging, so a sender that did
  not wait would start first)."""
  out = tmp_path / "t"
  result = launcher.launch(2, 1, [sys.executable, "tests/mp/transfer_ack.py", str(out), "ack"],
                           timeout_s=120, out=None)
  assert result.ok, result.describe() + "\n" + "\n".join(sum(result.outputs, [])[-40:])
  sender = json.loads((tmp_path / "t.0").read_text())
  receiver = json.loads((tmp_path / "t.1").read_text())
  assert receiver["got"] < receiver["ack"] <= sender["dispatch"] < sender["end"], (sender,
                                                                                  receiver)
