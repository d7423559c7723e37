"""A corpus of bad data, model and reward inputs (issue 36), through the real command line
(``cli.main``), in the style of test_bad_inputs_corpus.py: each case is something that was
silently wrong (a good-looking run on bad input) or a raw traceback, and must now end in
ONE line on stderr naming the culprit, exit code 2, no traceback.
"""

from __future__ import annotations

import json

import pytest
from test_bad_inputs_corpus import assert_one_line, config_file, run
from workflow_util import tiny_model_folder


def _train(capsys, tmp_path, *extra: str, config: str = "grpo:tiny") -> tuple[int, str]:
  """One tiny GRPO step of the tiny model folder; ``extra`` flags last."""
  return run(capsys, "train", f"--config={config}", f"--config.run_dir={tmp_path}/run",
             f"--config.model.path={tiny_model_folder(tmp_path)}", "--config.data.eval=",
             "--config.data.prompts_per_step=8", "--config.rollout.n=2",
             "--config.rollout.max_new_tokens=8", "--config.actor.micro_batch_size=1",
             "--config.trainer.eval_every=0", "--config.trainer.total_steps=1",
             "--config.trainer.save_every=0", *extra)


# --- rewards: a score must be a real number, finite as the float32 the batch keeps --------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("node, needle", [
    ("reward.huge", "reward function 'huge_reward' returned 1e+300"),
    ("reward.text", "reward function 'text_reward' returned '1.0' (str)"),
])
def test_plugin_reward_that_is_not_a_finite_float32_is_refused(tmp_path, capsys, node, needle):
  config = config_file(tmp_path, f"""
      c.plugins = ("plugin_bad_reward",)
      c.dag[1]["fn"] = "{node}"
      """)
  code, err = _train(capsys, tmp_path, "--config.data.train=builtin:arithmetic",
                     config=config)
  assert code == 2, err
  assert_one_line(err, "distflow-jax train: error:", needle, "sample id")
