"""Bad asynchronous-RL settings (trainer.max_staleness, placement.rollout) through the real
command line: one line naming the culprit, exit 2, no traceback (the corpus style of
test_bad_inputs_corpus.py, whose GRPO config file and helpers these rows reuse)."""

from __future__ import annotations

import pytest
from distflow_jax import cli
from test_bad_inputs_corpus import assert_one_line, config_file, run

K1 = "--config.trainer.max_staleness=1"
SPLIT = ["--config.placement.rollout.devices=0:4", "--config.placement.actor.devices=4:8",
         "--config.placement.reference.devices=4:8"]
EIGHT = ["--config.cluster.devices_per_process=8"]

# (config-file body, extra arguments, what the line must name)
CASES = {
    "negative": ("", ["--config.trainer.max_staleness=-1"], "trainer.max_staleness=-1"),
    "shared_devices": ("", [K1], "trainer.max_staleness=1: node 'old_logprob'"),
    "half_shared": ("", [K1, *EIGHT, "--config.placement.rollout.devices=0:4",
                         "--config.placement.actor.devices=2:6"],
                    "node 'old_logprob' runs on devices [2, 3]"),
    "two_processes": ("", [K1, *SPLIT, "--num_processes=2", "--devices_per_process=4"],
                      "one process only"),
    "dynamic_sampling": ("", [K1, *SPLIT, *EIGHT, "--config.algo.dynamic_sampling_tries=2"],
                         "algo.dynamic_sampling_tries=2"),
    "episodes": ("", [K1, *SPLIT, *EIGHT, "--config.rollout.env=plugin_envs:Scripted"],
                 "with multi-turn episodes (rollout.env='plugin_envs:Scripted') is not built"),
    "rollout_unknown_key": ("c.placement.rollout.mesh = dict(fsdp=2)", [],
                            "unknown config key 'placement.rollout.mesh'"),
    "rollout_out_of_range": ("", [*EIGHT, "--config.placement.rollout.devices=4:99"],
                             "placement.rollout: devices '4:99'"),
    "rollout_tp_split": ("", [*EIGHT, "--config.placement.rollout.devices=0:3",
                              "--config.rollout.tensor_parallel=2"],
                         "rollout.tensor_parallel=2 does not divide the 3 placement.rollout"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_refuses_bad_async_setting_in_one_line(tmp_path, capsys, case):
  body, extra, needle = CASES[case]
  code, err = run(capsys, "plan", f"--config={config_file(tmp_path, body)}", *extra)
  assert code == 2, err
  assert_one_line(err, "distflow-jax plan: error:", needle)


@pytest.mark.timeout(120)
def test_the_split_plans_with_the_rollout_on_its_own_devices(tmp_path, capsys):
  code = cli.main(["plan", f"--config={config_file(tmp_path, '')}", K1, *SPLIT, *EIGHT,
                   "--config.actor.micro_batch_size=1"])
  out, err = capsys.readouterr()
  assert code == 0, err
  assert "local placement.rollout (devices [0..3])" in out
  assert "layout=rollout(own, tp=1)" in out


@pytest.mark.timeout(300)
def test_train_refuses_overlap_on_shared_devices(tmp_path, capsys):
  code, err = run(capsys, "train", f"--config={config_file(tmp_path, '')}",
                  f"--config.run_dir={tmp_path}/run", "--config.trainer.total_steps=1", K1)
  assert code == 2, err
  assert_one_line(err, "distflow-jax train: error:", "trainer.max_staleness=1",
                  "placement.rollout.devices")
