"""trainer.compile_overlap (run/compile_overlap.py): the first step's training programs
compile in background threads while its rollout runs.

Cold runs in fresh processes (tools/bench_first_step.py, which this also smoke-tests):

* the same programs, each compiled once: step 1 compiles as many backend programs with the
  overlap as without (the training nodes find the background's executables), and the
  background compiled the passes and the train step;
* the same result, bit for bit (step 2's loss: the weights after step 1 are equal);
* off, nothing runs in the background.
"""

import json
import os
import subprocess
import sys

import pytest

from distflow_jax import launcher
from workflow_util import smoke_overrides

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_overlap_compiles_each_program_once_and_changes_no_result(tmp_path):
  """Two cold runs in fresh processes (tools/bench_first_step.py, one round), off and on."""
  smoke = [f"--override={o}" for o in smoke_overrides(tmp_path / "unused",
                                                       "actor.entropy_coef=0.01")
           if not o.startswith(("run_dir=", "trainer.eval_every"))]
  out = subprocess.run([sys.executable, "tools/bench_first_step.py", "--rounds", "1",
                        *smoke], capture_output=True, text=True, timeout=500)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  rows = {r[1]: r for r in (l.split() for l in out.stdout.splitlines())
          if r and r[0].isdigit()}
  assert sorted(rows) == ["False", "True"], out.stdout
  off, on = rows["False"], rows["True"]
  assert int(off[5]) > 10 and on[5] == off[5], out.stdout  # each program compiled once
  # ref_logprob's pass, its prompt grouping and the train step, at the batch's width.
  assert int(off[6]) == 0 and int(on[6]) >= 3, out.stdout
  assert on[7] == off[7] and float(on[7]) != 0.0, out.stdout  # step 2's loss, bitwise
  assert "step 2's loss on every run: the same" in out.stdout, out.stdout
  assert "ratio on/off of the medians" in out.stdout


@pytest.mark.timeout(900)
def test_overlap_on_2x2_processes_compiles_in_each_and_changes_no_result(tmp_path):
  """Two processes of 2 devices, GRPO with a reference pass, overlap on and off.  The
  catalogue builds only the late nodes' programs: its first version built every node's,
  rollout replicas on the other process's devices included, and failed there with
  ``KeyError: CpuDevice(id=0)``.  Every process compiles its passes and train step in
  the background (process 0's row says how many) and the run is bitwise the same."""
  rows = {}
  for overlap in ("0", "1"):
    out = tmp_path / f"overlap{overlap}.json"
    overrides = smoke_overrides(tmp_path / f"run{overlap}", "cluster.devices_per_process=2",
                                "cluster.num_processes=2", "actor.entropy_coef=0.01",
                                "trainer.total_steps=1")
    result = launcher.launch(2, 2, [sys.executable, "tests/mp/workflow_train.py", str(out),
                                    "grpo:tiny", *overrides], timeout_s=600,
                             env={**os.environ, "DISTFLOW_TEST_OVERLAP": overlap}, out=None)
    assert result.ok, result.describe() + "\n" + "\n".join(sum(result.outputs, [])[-40:])
    rows[overlap] = json.loads(out.read_text())
  off, on = rows["0"], rows["1"]
  assert "compile/overlap_programs" not in off[0]
  assert on[0]["compile/overlap_programs"] >= 3, on[0]  # ref pass, grouping, train step
  assert [r["step"] for r in on] == [r["step"] for r in off] == [1]
  for a, b in zip(off, on):
    for key in ("actor/loss", "actor/kl", "reward/mean", "actor/grad_norm"):
      if key in a:
        assert a[key] == b[key], (key, a[key], b[key])
  assert off[-1]["params_sha256"] == on[-1]["params_sha256"]
