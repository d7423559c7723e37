"""SIGTERM (a scheduler's preemption, kill, docker stop) stops `train` as Ctrl-C does: one
line naming the last complete checkpoint, exit 143, the run lock released, no half-written
checkpoint left, and the same command resumes from it."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from workflow_util import SMOKE

pytestmark = pytest.mark.timeout(600)
DEADLINE_S = 300


def _cmd(run_dir, steps):
  return [sys.executable, "-m", "distflow_jax.cli", "train", "--config=grpo:tiny",
          *(f"--config.{o}" for o in SMOKE), f"--config.run_dir={run_dir}",
          f"--config.trainer.total_steps={steps}", "--config.trainer.save_every=1",
          "--config.trainer.async_save=False", "--config.data.prompts_per_step=8",
          "--config.rollout.n=2", "--config.actor.micro_batch_size=2"]


def _committed(run_dir):
  d = run_dir / "checkpoints"
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def test_sigterm_after_a_checkpoint_ends_in_one_line_and_resumes(tmp_path):
  run_dir = tmp_path / "run"
  p = subprocess.Popen(_cmd(run_dir, 200), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, start_new_session=True)
  try:
    t0 = time.monotonic()
    while not _committed(run_dir) and p.poll() is None:
      assert time.monotonic() - t0 < DEADLINE_S, "no checkpoint in time"
      time.sleep(0.2)
    assert p.poll() is None, p.communicate()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
  finally:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()
  assert p.returncode == 143, err[-3000:]
  lines = [l for l in err.splitlines() if l.startswith("distflow-jax train:")]
  assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
  assert lines[0].startswith("distflow-jax train: terminated (SIGTERM); the last complete "
                             "checkpoint is step "), lines[0]
  last = int(lines[0].split("checkpoint is step ")[1].split()[0])
  assert last == _committed(run_dir)[-1] >= 1
  assert not (run_dir / "run.lock").exists()
  assert not [p for p in (run_dir / "checkpoints").rglob("*") if "tmp" in p.name]
  # The same command, fewer steps, resumes from it.
  done = subprocess.run(_cmd(run_dir, last + 1), capture_output=True, text=True,
                        timeout=DEADLINE_S)
  assert done.returncode == 0, done.stderr[-3000:]
  steps = [json.loads(l)["step"] for l in open(run_dir / "metrics.jsonl")]
  assert steps[-1] == last + 1


# Ctrl-C (or SIGTERM) as the run's first save starts: sent by the process to itself from
# inside the save, before orbax's save is issued (where it used to raise, so no save was
# in flight and step 1 was lost).
_INTERRUPT_AT_SAVE = """
import os, signal, sys
from distflow_jax.persist import checkpoint
static = checkpoint.Checkpointer._save_static
def interrupted(self, *args, **kwargs):
  os.kill(os.getpid(), int(os.environ["SIGNAL_AT_SAVE"]))
  return static(self, *args, **kwargs)
checkpoint.Checkpointer._save_static = interrupted
from distflow_jax import cli
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signum,code,how", [(signal.SIGINT, 130, "interrupted (Ctrl-C)"),
                                             (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_a_signal_as_the_first_save_starts_keeps_that_save(tmp_path, signum, code, how):
  run_dir = tmp_path / "run"
  cmd = [sys.executable, "-c", _INTERRUPT_AT_SAVE, *_cmd(run_dir, 5)[3:]]
  cmd = [c for c in cmd if c != "--config.trainer.async_save=False"]  # the default: async
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE_S,
                        env=dict(os.environ, SIGNAL_AT_SAVE=str(int(signum))))
  assert proc.returncode == code, proc.stderr[-3000:]
  lines = [l for l in proc.stderr.splitlines() if l.startswith("distflow-jax train:")]
  assert lines == [f"distflow-jax train: {how}; the last complete checkpoint is step 1 in "
                   f"{run_dir}/checkpoints: run the same command to resume from it"], \
      proc.stderr[-3000:]
  assert _committed(run_dir) == [1] and not (run_dir / "run.lock").exists()
