"""The tiny visual GRPO run (tests/test_vl_rl.py) gives the same metrics on 1 process x 8
devices and 2 x 2 (issue 20): the 1 x 8 run's rollouts, image features included, are
replayed in the 2 x 2 one (tests/plugin_rollout_tape.py), so the passes, re-partitions
and train steps with images are compared on the same samples."""

import math

import numpy as np
import pytest

from distflow_jax.tasks import registry as tasks
from test_vl_rl import VL, tiny_vl_checkpoint
from test_workflow_multiprocess import ABS, COMPARE, REL, _multi, _single

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(1500)
def test_visual_grpo_on_2x2_agrees_with_1x8(tmp_path):
  ckpt = tiny_vl_checkpoint(tmp_path / "vl")
  rows = tasks.get("shapes").generate_split("basic", "train", 32, seed=0)
  data = tmp_path / "shapes.jsonl"
  tasks.write_jsonl(rows, str(data))
  extra = [f"model.path={ckpt}", *VL, f"data.train={data}", "data.image_key=image",
           "actor.entropy_coef=0.01", "trainer.total_steps=3"]
  tape = tmp_path / "tape"
  single = _single(tmp_path, "grpo:tiny", extra, tape, "record")
  # The tape carries the samples' image features: the 2 x 2 run replays them.
  with np.load(sorted(tape.glob("*.npz"))[0]) as z:
    assert z["image_embeds"].shape[1:] == (4, 32) and z["rope_positions"].shape[1] == 3
  multi = _multi(tmp_path, "grpo:tiny", extra, 2, 2, tape)
  assert [m["step"] for m in multi] == [m["step"] for m in single] == [1, 2, 3]
  for s, m in zip(single, multi):
    for key in COMPARE:
      if key in s:
        assert math.isclose(s[key], m[key], rel_tol=REL, abs_tol=ABS), (
            s["step"], key, s[key], m[key])
