"""The workflow on 2 real processes x 2 devices equals the single-process 1 x 8 run."""

import json
import math
import sys

import pytest

from distflow_jax import launcher
from distflow_jax.config import loading
from distflow_jax.workflow import trainer
from workflow_util import smoke_overrides

pytestmark = pytest.mark.multiprocess

COMPARE = ("reward", "accuracy", "response_length", "actor/loss", "actor/grad_norm",
           "actor/pg_clipfrac", "actor/ppo_kl", "critic/loss", "kl_penalty", "tokens")

CASES = {
    "grpo": ("grpo:tiny", ["data.prompts_per_step=8", "rollout.n=2", "actor.micro_batch_size=1",
                           "rollout.temperature=1.0"]),
    "ppo": ("ppo:tiny", ["data.prompts_per_step=8", "actor.micro_batch_size=1",
                         "critic.micro_batch_size=1"]),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", sorted(CASES))
def test_two_processes_match_one_process(case, tmp_path):
  name, extra = CASES[case]
  single_dir, multi_dir = tmp_path / "single", tmp_path / "multi"
  cfg = loading.load(name, smoke_overrides(single_dir, "cluster.devices_per_process=8", *extra))
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  single = list(trainer.train(cfg, ctx, loaders))

  out = tmp_path / "multi.json"
  overrides = smoke_overrides(multi_dir, "cluster.devices_per_process=2",
                              "cluster.num_processes=2", *extra)
  result = launcher.launch(2, 2, [sys.executable, "tests/mp/workflow_train.py", str(out), name,
                                  *overrides], timeout_s=800, out=None)
  assert result.ok, result.describe() + "\n" + "\n".join(sum(result.outputs, [])[-40:])
  multi = json.loads(out.read_text())
  assert [m["step"] for m in multi] == [m["step"] for m in single] == [1, 2, 3]
  for s, m in zip(single, multi):
    for key in COMPARE:
      if key in s:
        assert math.isclose(s[key], m[key], rel_tol=2e-3, abs_tol=2e-4), (s["step"], key,
                                                                           s[key], m[key])
