"""Two plain hosts, as docs/launching.md "Two plain hosts" tells a user to start them: the same
`distflow-jax train` on each with DISTFLOW_COORDINATOR (host 0's address and a free port),
DISTFLOW_NUM_PROCESSES and DISTFLOW_PROCESS_ID set, nothing else.  Here the two "hosts"
are two local processes of one device each, started by hand (not by `launch`)."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from distflow_jax import launcher
from workflow_util import SMOKE

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]
DEADLINE_S = 420


def test_train_on_two_processes_started_by_hand_through_the_documented_variables(tmp_path):
  run_dir = tmp_path / "run"
  coordinator = f"127.0.0.1:{launcher.free_port()}"
  cmd = [sys.executable, "-m", "distflow_jax.cli", "train", "--config=grpo:tiny",
         *(f"--config.{o}" for o in SMOKE), f"--config.run_dir={run_dir}",
         "--config.trainer.total_steps=1", "--config.data.prompts_per_step=2",
         "--config.rollout.n=2", "--config.actor.micro_batch_size=2"]
  procs = []
  for pid in range(2):
    env = dict(os.environ, DISTFLOW_COORDINATOR=coordinator, DISTFLOW_NUM_PROCESSES="2",
               DISTFLOW_PROCESS_ID=str(pid), JAX_PLATFORMS="cpu",
               XLA_FLAGS=re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                                os.environ.get("XLA_FLAGS", "")))
    procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True))
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=DEADLINE_S)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
  assert "2 process(es) x 1 device(s)" in outs[0], outs[0][-2000:]
  rows = [json.loads(l) for l in open(run_dir / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1]
