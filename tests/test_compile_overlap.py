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


class _Fn:
  """A jitted function's stand-in: ``lower(...).compile()`` raises ``error`` or succeeds."""

  def __init__(self, error=None):
    self.error, self.compiled = error, 0

  def lower(self, *args, **kwargs):
    return self

  def compile(self):
    if self.error is not None:
      raise self.error
    self.compiled += 1
    return self


def _ctx_and_prompts():
  from types import SimpleNamespace

  import ml_collections
  import numpy as np

  from distflow_jax.dag.planner import LayoutKind
  cfg = ml_collections.ConfigDict({
      "trainer": {"compile_overlap": True},
      "rollout": {"prefill_buckets": (32,)}, "data": {"max_prompt_len": 32}})
  plan = SimpleNamespace(steps=[SimpleNamespace(layout=SimpleNamespace(kind=LayoutKind.ROLLOUT))])
  prompts = SimpleNamespace(data={"prompt_len": np.array([5, 9])})
  return SimpleNamespace(cfg=cfg, plan=plan), prompts


@pytest.mark.timeout(60)
def test_a_catalogue_or_compile_failure_is_one_log_line_and_the_step_goes_on():
  """The overlap never stops a run, but it does not fail silently either: a catalogue that
  cannot build the programs, and a program that does not compile in the background, each
  say so in one line naming the error, and the metrics count what failed."""
  from types import SimpleNamespace

  from distflow_jax.run import compile_overlap
  ctx, prompts = _ctx_and_prompts()
  lines = []

  def broken_catalogue(ctx, width):
    raise KeyError("CpuDevice(id=0)")

  assert compile_overlap.start(ctx, prompts, broken_catalogue, lines.append) is None
  assert len(lines) == 1 and "compile overlap off" in lines[0], lines
  assert "KeyError: 'CpuDevice(id=0)'" in lines[0] and "\n" not in lines[0], lines

  lines.clear()
  good, bad = _Fn(), _Fn(ValueError("shapes do not match\nsecond line"))
  widths = []
  programs = [SimpleNamespace(fn=f, args=(), kwargs={}) for f in (good, bad)]
  overlap = compile_overlap.start(ctx, prompts, lambda c, w: widths.append(w) or programs,
                                  lines.append)
  overlap.wait()
  assert widths == [32] and good.compiled == 1
  assert overlap.metrics()["compile/overlap_programs"] == 1.0
  assert overlap.metrics()["compile/overlap_failed"] == 1.0
  assert len(lines) == 1 and "1 of 2 training programs" in lines[0], lines
  assert "ValueError: shapes do not match second line" in lines[0], lines

  lines.clear()
  ctx.cfg.trainer.compile_overlap = False
  assert compile_overlap.start(ctx, prompts, lambda c, w: programs, lines.append) is None
  assert lines == []
