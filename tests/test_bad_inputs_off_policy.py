"""Bad off-policy correction settings (actor.off_policy, algos/off_policy.py) through the real
command line: one line naming the key, exit 2, no traceback (the corpus style of
test_bad_inputs_corpus.py, whose GRPO config file and helpers these rows reuse)."""

from __future__ import annotations

import pytest
from test_bad_inputs_corpus import assert_one_line, config_file, run

# The corpus's GRPO DAG without its logprob node: the old log-probs would be the rollout's own.
NO_LOGPROB = ("c.dag = [n for n in c.dag if n['id'] != 'old_logprob']\n"
              "c.dag[-1]['deps'] = ['advantage']\n")
KEY = "actor.off_policy.correction"

# (config-file body, extra overrides, what the line must name)
CASES = {
    "unknown_correction": ("", [f"--config.{KEY}=is"], f"{KEY}='is'"),
    "cap_zero": ("", ["--config.actor.off_policy.tis_cap=0"], "actor.off_policy.tis_cap"),
    "cap_inf": ("", ["--config.actor.off_policy.tis_cap=inf"], "actor.off_policy.tis_cap"),
    "tis_without_logprob_node": (NO_LOGPROB + "c.actor.off_policy.correction = 'tis'", [],
                                 KEY),
    "decoupled_without_logprob_node": (NO_LOGPROB, [f"--config.{KEY}=decoupled"], KEY),
    "override_without_logprob_node": (
        NO_LOGPROB + "c.dag[-1]['config'] = dict(off_policy=dict(correction='tis'))", [],
        "off_policy.correction='tis'"),
    "rollout_without_logprobs": ("c.plugins = ('plugin_tokens_only_rollout',)\n"
                                 "c.dag[0]['fn'] = 'generate.tokens_only'\n"
                                 "c.actor.off_policy.correction = 'decoupled'", [],
                                 "rollout_logprobs"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_refuses_bad_off_policy_setting_in_one_line(tmp_path, capsys, case):
  body, extra, needle = CASES[case]
  code, err = run(capsys, "plan", f"--config={config_file(tmp_path, body)}", *extra)
  assert code == 2, err
  assert_one_line(err, "distflow-jax plan: error:", needle)
  if "without" in case:  # names the key and what is missing
    assert KEY.split(".", 1)[1] in err and ("old_logprobs" in err or "rollout_logprobs" in err)


@pytest.mark.timeout(120)
def test_the_same_dag_without_a_correction_plans(tmp_path, capsys):
  code, err = run(capsys, "plan", f"--config={config_file(tmp_path, NO_LOGPROB)}",
                  "--config.actor.micro_batch_size=1")
  assert code == 0, err


@pytest.mark.timeout(300)
def test_train_refuses_a_correction_without_recomputed_logprobs(tmp_path, capsys):
  body = NO_LOGPROB + "c.actor.off_policy.correction = 'tis'"
  code, err = run(capsys, "train", f"--config={config_file(tmp_path, body)}",
                  f"--config.run_dir={tmp_path}/run", "--config.trainer.total_steps=1")
  assert code == 2, err
  assert_one_line(err, "distflow-jax train: error:", KEY, "old_logprobs")
