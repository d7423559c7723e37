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
TWO = ["--num_processes=2", "--devices_per_process=4"]  # the rollout on a process of its own

# (config-file body, extra arguments, what the line must name)
CASES = {
    "negative": ("", ["--config.trainer.max_staleness=-1"], "trainer.max_staleness=-1"),
    "shared_devices": ("", [K1], "trainer.max_staleness=1: node 'old_logprob'"),
    "half_shared": ("", [K1, *EIGHT, "--config.placement.rollout.devices=0:4",
                         "--config.placement.actor.devices=2:6"],
                    "node 'old_logprob' runs on devices [2, 3]"),
    "two_processes_shared": ("", [K1, "--num_processes=2", "--devices_per_process=4",
                                  "--config.placement.rollout.devices=0:2",
                                  "--config.placement.actor.devices=2:8",
                                  "--config.placement.reference.devices=2:8"],
                             "needs the rollout on processes of its own"),
    "split_dynamic_sampling": ("", [*SPLIT, *TWO, "--config.trainer.eval_every=0",
                                    "--config.algo.dynamic_sampling_tries=2"],
                               "a rollout on processes of its own (placement.rollout.devices) "
                               "does not work with algo.dynamic_sampling_tries=2"),
    "split_device_counts": ("", [K1, *TWO, "--config.placement.rollout.devices=0:3",
                                 "--config.placement.actor.devices=4:8",
                                 "--config.placement.reference.devices=4:8"],
                            "placement.rollout.devices holds 3 devices but the actor "
                            "(placement.actor.devices) 4; weights and batches move in blocks "
                            "of the smaller count, so one must be a multiple of the other"),
    "split_rows": ("", [K1, *TWO, "--config.placement.rollout.devices=0:4",
                        "--config.placement.actor.devices=4:6",
                        "--config.placement.reference.devices=4:6",
                        "--config.data.prompts_per_step=2", "--config.rollout.n=1"],
                   "a batch's 2 rows (data.prompts_per_step x rollout.n) do not split over 4 "
                   "devices"),
    "split_idle_process": ("", [K1, *SPLIT, "--num_processes=3", "--devices_per_process=4"],
                           "processes [2] run neither the rollout nor the training"),
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
                         "rollout.tensor_parallel=2 does not fit the placement.rollout "
                         "devices (process 0: 3)"),
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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("k", [0, 1])  # 0: the synchronous loop on the same split
def test_plan_prints_the_process_groups_and_the_weight_sync(tmp_path, capsys, k):
  code = cli.main(["plan", f"--config={config_file(tmp_path, '')}",
                   f"--config.trainer.max_staleness={k}", *SPLIT, *TWO,
                   "--config.trainer.eval_every=0", "--config.actor.micro_batch_size=1"])
  out, err = capsys.readouterr()
  assert code == 0, err
  line = next(l for l in out.splitlines() if l.startswith("async on disjoint processes"))
  assert "rollout on processes [0], training on processes [1]" in line
  assert "each of the 4 rollout replica(s)" in line and " MB " in line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rollout,actor,needle", [
    ("0:4", "4:6", "5.0 MB across 2 times (9.9 MB), once onto each block of 2 of the 4 rollout"),
    ("0:2", "4:8", "across once, from 2 of the actor's 4 devices")])
def test_plan_prints_how_unequal_groups_copy_the_weights(tmp_path, capsys, rollout, actor,
                                                         needle):
  code = cli.main(["plan", f"--config={config_file(tmp_path, '')}", K1, *TWO,
                   f"--config.placement.rollout.devices={rollout}",
                   f"--config.placement.actor.devices={actor}",
                   f"--config.placement.reference.devices={actor}",
                   "--config.trainer.eval_every=0", "--config.actor.micro_batch_size=1"])
  out, err = capsys.readouterr()
  assert code == 0, err
  line = next(l for l in out.splitlines() if l.startswith("async on disjoint processes"))
  assert needle in line, line


@pytest.mark.timeout(300)
def test_train_refuses_overlap_on_shared_devices(tmp_path, capsys):
  code, err = run(capsys, "train", f"--config={config_file(tmp_path, '')}",
                  f"--config.run_dir={tmp_path}/run", "--config.trainer.total_steps=1", K1)
  assert code == 2, err
  assert_one_line(err, "distflow-jax train: error:", "trainer.max_staleness=1",
                  "placement.rollout.devices")
