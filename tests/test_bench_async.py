"""tools/bench_async.py's contenders: each is a config that plans, with the rollout stage on
the first half of the devices and the training on the second (the run itself is the
bench's; a full run takes minutes)."""

import argparse
import os
import sys

import pytest

from distflow_jax.config import async_checks, checks, loading
from distflow_jax.dag import FUNCTIONS

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import bench_async  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_each_contender_plans_on_the_split(k, tmp_path):
  args = argparse.Namespace(devices=8, prompts=8, n=4, new=32, warmup=2, steps=6)
  cfg = loading.load("grpo:tiny", bench_async.overrides(args, k, str(tmp_path)))
  plan = checks.plan_from_config(cfg, checks.topology(cfg), FUNCTIONS)
  n = async_checks.rollout_stage(plan)
  assert [s.node.id for s in plan.steps[:n]] == ["generate", "reward", "advantage"]
  assert all(s.layout.devices == (0, 1, 2, 3) for s in plan.steps[:n])
  assert all(s.layout.devices == (4, 5, 6, 7) for s in plan.steps[n:])
  assert cfg.trainer.max_staleness == k


@pytest.mark.parametrize("k", [0, 1, 2])
def test_two_process_contenders_put_each_stage_on_a_process_of_its_own(k, tmp_path):
  args = argparse.Namespace(devices=2, prompts=2, n=4, new=48, warmup=2, steps=6, processes=2)
  cfg = loading.load("grpo:tiny", bench_async.overrides(args, k, str(tmp_path)))
  plan = checks.plan_from_config(cfg, checks.topology(cfg), FUNCTIONS)
  split = async_checks.process_split(plan)
  assert split == async_checks.ProcessSplit(rollout=(0,), training=(1,))
  assert cfg.trainer.max_staleness == k
