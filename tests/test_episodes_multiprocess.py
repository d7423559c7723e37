"""Multi-turn episodes across layouts: in deterministic mode a GRPO run on scripted episodes
(rollout.env) is bitwise the same on 1 x 8 and 2 x 2 devices: the episodes (each host plays
its own prompts' on its replica) and the training on them, with the loss mask moved by the
re-partition with its samples."""

import pytest

from test_workflow_multiprocess import _multi, _single

pytestmark = [pytest.mark.multiprocess]

EXTRA = ["data.prompts_per_step=8", "rollout.n=2", "actor.micro_batch_size=1",
         "trainer.deterministic=True", "trainer.total_steps=2", "plugins=('plugin_envs',)",
         "rollout.env=scripted", "rollout.max_new_tokens=16", "model.max_seq_len=64",
         "rollout.prefill_buckets=(40,56)"]


@pytest.mark.timeout(1200)
@pytest.mark.llvm_level1  # bitwise; at LLVM level 0 it differs by an ulp
def test_episodes_on_2x2_equal_1x8_bitwise(tmp_path):
  single = _single(tmp_path, "grpo:tiny_env", EXTRA)
  multi = _multi(tmp_path, "grpo:tiny_env", EXTRA, 2, 2)
  assert [m["step"] for m in multi] == [s["step"] for s in single] == [1, 2]
  for s, m in zip(single, multi):
    for key in ("env/turns_mean", "env/errors", "response_length", "actor/token_count",
                "actor/loss", "reward"):
      assert s[key] == m[key], (s["step"], key, s[key], m[key])
    # the observation tokens (reset's, one or more per sample) are not trained on
    assert s["actor/token_count"] < s["response_length"] * 16
  assert single[-1]["params_sha256"] == multi[-1]["params_sha256"]
