"""trainer.compile_overlap (run/compile_overlap.py): the first step's training programs
compile in background threads while its rollout runs.

Cold runs in fresh processes (tools/bench_first_step.py, which this also smoke-tests):

* the same programs, each compiled once: step 1 compiles as many backend programs with the
  overlap as without (the training nodes find the background's executables), and the
  background compiled the passes and the train step;
* the same result, bit for bit (step 2's loss: the weights after step 1 are equal);
* off, nothing runs in the background.
"""

import subprocess
import sys

import pytest

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
