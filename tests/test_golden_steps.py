"""Golden values: three steps of a tiny GRPO and a tiny PPO run (micro model, no warm start,
the share of digits as the reward: tests/fixtures/golden_configs.py,
XLA's CPU code capped at AVX2), their per-step loss, gradient norm, reward, KL, entropy and
lengths and the trained weights' sum of squares, against figures recorded on 2026-12-02
before the house redesign (issue 53), so a change of any number shows here when it happens.

Compared to 1e-5 relative, not bit for bit: the recorded machine is one CPU kind, and the
sums XLA emits may round differently in the last bits on another even under the AVX2 cap;
any change of the algorithm moves these figures by far more.  To re-record after a change
that is meant to move them: DISTFLOW_RECORD_GOLDEN=1 pytest tests/test_golden_steps.py
(and say why in the commit)."""

import json
import math
import os
import sys
from pathlib import Path

import pytest

from distflow_jax import launcher
from isa import isa_env
from workflow_util import smoke_overrides

pytestmark = pytest.mark.timeout(600)
GOLDEN = Path(__file__).parent / "fixtures" / "golden_steps.json"
KEYS = ("actor/loss", "actor/grad_norm", "actor/entropy", "actor/kl", "reward",
        "response_length", "critic/loss", "critic/grad_norm", "params_sum_squares")
CONFIGS = Path(__file__).parent / "fixtures" / "golden_configs.py"
RUNS = {"grpo": (f"{CONFIGS}:grpo", []), "ppo": (f"{CONFIGS}:ppo", ["critic.warmup_steps=0"])}
REL, ABS = 1e-5, 1e-6  # ABS: the losses of steps whose advantages sum to 0 are ~1e-8


def _run(tmp_path, name, extra):
  out = tmp_path / "metrics.json"
  overrides = smoke_overrides(tmp_path / "run", "cluster.devices_per_process=1",
                              "cluster.num_processes=1", "data.prompts_per_step=4",
                              "rollout.n=2", "actor.micro_batch_size=2",
                              "critic.micro_batch_size=2", *extra)
  result = launcher.launch(1, 1, [sys.executable, "tests/mp/workflow_train.py", str(out), name,
                                  *overrides], timeout_s=500, env=isa_env("avx2"), out=None)
  assert result.ok, result.describe() + "\n" + "\n".join(sum(result.outputs, [])[-40:])
  rows = json.loads(out.read_text())
  return [{k: r[k] for k in KEYS if k in r} for r in rows]


@pytest.mark.parametrize("case", sorted(RUNS))
def test_three_steps_give_the_recorded_figures(case, tmp_path):
  got = _run(tmp_path, *RUNS[case])
  golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
  if os.environ.get("DISTFLOW_RECORD_GOLDEN") == "1":
    golden[case] = got
    GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    pytest.skip(f"recorded {case} into {GOLDEN}")
  want = golden[case]
  assert len(got) == len(want) == 3
  assert [sorted(r) for r in got] == [sorted(r) for r in want]
  for step, (g, w) in enumerate(zip(got, want), 1):
    for key, value in w.items():
      assert math.isclose(g[key], value, rel_tol=REL, abs_tol=ABS), (
          f"step {step} {key}: {g[key]!r}, recorded {value!r}")
