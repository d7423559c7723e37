"""DAPO dynamic sampling: constant-reward groups are dropped and refilled."""

import numpy as np
import pytest

from distflow_jax.config import loading
from distflow_jax.data import layout as dlayout
from distflow_jax.data.batch import Batch, to_global, to_local
from distflow_jax.run import dynamic_sampling, trainer
from distflow_jax.state.metrics import Metrics
from workflow_util import smoke_overrides

N = 2


def fake_prefix(reward_rows):
  """run_prefix stand-in: each call returns the next batch of rewards (4 groups of 2)."""
  lay = dlayout.Layout(dlayout.flat_mesh("data"), ("data",))
  calls = iter(reward_rows)
  counter = iter(range(1000))

  def run(prompts):
    del prompts
    rewards = np.asarray(next(calls), np.float32)
    base = next(counter) * 100
    ids = base + np.arange(len(rewards), dtype=np.int32)
    data = {"rewards": rewards, "sample_id": ids, "group_id": ids // N}
    return to_global(Batch(data, {int(g): {"answer": str(g)} for g in ids // N}), lay), lay
  return run


def test_varied_groups_are_kept_in_order_and_constant_ones_refilled():
  rows = [[1, 1, 0, 1, 0, 0, 1, 0],   # varied groups: 1, 3  (of 0..3)
          [0, 0, 0, 0, 1, 0, 1, 1],   # varied: 2
          [1, 0, 0, 1, 1, 1, 0, 0]]   # varied: 0, 1
  m = Metrics()
  batch, _ = dynamic_sampling.sample(fake_prefix(rows), None, lambda: None, n=N, max_tries=5,
                                     metrics=m)
  local = to_local(batch).data
  # Kept: try 0 groups 1,3; try 1 group 2; try 2 group 0 -> 4 groups, in that order.
  np.testing.assert_array_equal(local["sample_id"], [2, 3, 6, 7, 104, 105, 200, 201])
  out = m.reduce()
  assert out["dynamic_sampling/tries"] == 3
  assert out["dynamic_sampling/filled_constant"] == 0
  assert out["dynamic_sampling/varied_fraction"] == pytest.approx(5 / 12)


def test_tries_run_out_and_constant_groups_fill_the_batch():
  rows = [[1, 1, 0, 0, 0, 0, 1, 1], [1, 0, 0, 0, 1, 1, 0, 0]]
  m = Metrics()
  batch, _ = dynamic_sampling.sample(fake_prefix(rows), None, lambda: None, n=N, max_tries=2,
                                     metrics=m)
  local = to_local(batch).data
  assert len(local["sample_id"]) == 8
  # The one varied group first, then constant groups in generation order.
  np.testing.assert_array_equal(local["sample_id"][:2], [100, 101])
  out = m.reduce()
  assert out["dynamic_sampling/tries"] == 2
  assert out["dynamic_sampling/filled_constant"] == 3


@pytest.mark.timeout(600)
def test_dynamic_sampling_in_a_grpo_run(tmp_path):
  # An untrained micro model never answers right: every group is constant.
  cfg = loading.load("grpo:tiny", smoke_overrides(
      tmp_path, "cluster.devices_per_process=8", "data.prompts_per_step=8", "rollout.n=2",
      "actor.micro_batch_size=1", "trainer.total_steps=1", "algo.dynamic_sampling_tries=2"))
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  (m,) = list(trainer.train(ctx, loaders))
  assert m["dynamic_sampling/tries"] == 2
  assert m["dynamic_sampling/varied_fraction"] == 0.0
  assert m["dynamic_sampling/filled_constant"] == 8  # all 8 groups of this host


def test_groups_of_different_prompt_widths_are_left_padded_to_the_widest():
  from distflow_jax.run.dynamic_sampling import _same_prompt_width
  a = {"prompt_tokens": np.array([[0, 5, 6]]), "prompt_mask": np.array([[False, True, True]])}
  b = {"prompt_tokens": np.array([[7, 8, 9, 1, 2]]), "prompt_mask": np.ones((1, 5), bool)}
  _same_prompt_width([a, b])
  assert a["prompt_tokens"].shape == (1, 5) and b["prompt_tokens"].shape == (1, 5)
  np.testing.assert_array_equal(a["prompt_mask"], [[False, False, False, True, True]])
  np.testing.assert_array_equal(a["prompt_tokens"][0, -2:], [5, 6])
  np.testing.assert_array_equal(b["prompt_tokens"], [[7, 8, 9, 1, 2]])
