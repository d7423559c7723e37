"""Bad ``model.lora`` settings through the real command line (``cli.main``): one line on
stderr naming the key, exit 2, no traceback (the corpus style of test_bad_inputs_corpus.py).

Value checks need no model (plain ``plan``); the fit to the model's layers is checked where
the model's config is built (``plan --memory`` here, as ``train`` does)."""

from __future__ import annotations

import pytest

from test_bad_inputs_corpus import assert_one_line, run

ON = "--config.model.lora.enabled=True"
SHAPE = ["--memory", "--memory_source=analytic", "--num_processes=1", "--devices_per_process=8"]

CASES = {
    "rank_zero": ([ON, "--config.model.lora.rank=0"], "model.lora.rank=0"),
    "rank_negative": ([ON, "--config.model.lora.rank=-4"], "model.lora.rank=-4"),
    "alpha_zero": ([ON, "--config.model.lora.alpha=0"], "model.lora.alpha=0"),
    "alpha_nan": ([ON, "--config.model.lora.alpha=nan"], "model.lora.alpha=nan"),
    "dropout_one": ([ON, "--config.model.lora.dropout=1.0"], "model.lora.dropout=1.0"),
    "dropout_negative": ([ON, "--config.model.lora.dropout=-0.1"], "model.lora.dropout=-0.1"),
    "dropout_not_built": ([ON, "--config.model.lora.dropout=0.05"], "not built yet"),
    "init_unknown": ([ON, "--config.model.lora.init=xavier"], "model.lora.init='xavier'"),
    "targets_empty": ([ON, "--config.model.lora.targets=()"], "model.lora.targets"),
    "path_without_lora": (["--config.model.lora.path=/some/adapter"], "model.lora.enabled=False"),
    "reference_elsewhere": ([ON, "--config.placement.reference.devices=0:1"],
                            "placement.reference must equal placement.actor"),
    "target_matches_nothing": ([ON, "--config.model.lora.targets=('qproj',)", *SHAPE],
                               "pattern 'qproj' matches no module"),
    "rank_above_layer": ([ON, "--config.model.lora.rank=100", *SHAPE],
                         "model.lora.rank=100 is larger than k_proj's"),
    "some_layers_only": ([ON, "--config.model.lora.targets=('model.layers.0.*',)", *SHAPE],
                         "every layer must carry the same adapters"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_lora_settings_are_one_line(capsys, case):
  argv, needle = CASES[case]
  code, err = run(capsys, "plan", "--config=grpo:tiny", *argv)
  assert code == 2, err
  assert_one_line(err, "distflow-jax plan: error:", needle)
