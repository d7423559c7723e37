"""Bad inputs of multi-turn episodes (rollout.env and its keys, environments that fail),
through the real command line (``cli.main``): one line naming the culprit, exit 2, never a
traceback or a hung process.  The corpus style of test_bad_inputs_corpus.py."""

import pytest

from test_bad_inputs_corpus import assert_one_line, config_file, run
from workflow_util import SMOKE

ENV = ('c.plugins = ("plugin_envs",)\nc.rollout.prefill_buckets = (64, 96)\n'
       'c.dag[1]["fn"] = "reward.env"\n')

# (config-file body, what the line must name)
PLAN_CASES = {
    "unknown_env": (ENV + "c.rollout.env = 'calculator'", "'calculator' is not a registered"),
    "env_module_missing": (ENV + "c.rollout.env = 'no_such_mod:Env'", "cannot import"),
    "env_class_missing": (ENV + "c.rollout.env = 'plugin_envs:Nope'", "no class or callable"),
    "bad_tool_parser": (ENV + "c.rollout.env = 'scripted'\nc.rollout.tool_parser = 'xml'",
                        "rollout.tool_parser"),
    "bad_on_env_error": (ENV + "c.rollout.env = 'scripted'\nc.rollout.on_env_error = 'skip'",
                         "rollout.on_env_error"),
    "zero_max_turns": (ENV + "c.rollout.env = 'scripted'\nc.rollout.max_turns = 0",
                       "rollout.max_turns"),
    "negative_timeout": (ENV + "c.rollout.env = 'scripted'\nc.rollout.env_timeout_s = -1.0",
                         "rollout.env_timeout_s"),
    "nan_timeout": (ENV + "c.rollout.env = 'scripted'\nc.rollout.env_timeout_s = float('nan')",
                    "rollout.env_timeout_s"),
    "reward_env_without_env": ('c.dag[1]["fn"] = "reward.env"', "'reward' (reward.env)"),
    "episode_tokens_without_env": ("c.rollout.max_episode_tokens = 64",
                                   "rollout.max_episode_tokens=64"),
    "episode_tokens_below_a_turn": (
        ENV + "c.rollout.env = 'scripted'\nc.rollout.max_episode_tokens = 16",
        "rollout.max_episode_tokens=16"),
    "negative_episode_tokens": (
        ENV + "c.rollout.env = 'scripted'\nc.rollout.max_episode_tokens = -8",
        "rollout.max_episode_tokens=-8 must be an int >= 0"),
    "bucket_too_small_for_episode_tokens": (
        ENV + "c.rollout.env = 'scripted'\nc.rollout.max_episode_tokens = 100\n"
        "c.model.max_seq_len = 512\nc.rollout.backend = 'reference'",
        "max_prompt_len + rollout.max_episode_tokens - 1"),
    "bucket_too_small_for_episodes": (
        ENV + "c.rollout.env = 'scripted'\nc.rollout.prefill_buckets = (64,)\n"
        "c.rollout.backend = 'reference'",
        "largest of rollout.prefill_buckets"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(PLAN_CASES))
def test_plan_refuses_bad_episode_settings_in_one_line(tmp_path, capsys, case):
  body, needle = PLAN_CASES[case]
  code, err = run(capsys, "plan", f"--config={config_file(tmp_path, body)}")
  assert code == 2, err
  assert_one_line(err, needle)


def _train(tmp_path, capsys, env, *extra):
  cfg = config_file(tmp_path, 'c.plugins = ("plugin_envs",)\n'
                              'c.dag[1]["fn"] = "reward.env"\n')
  return run(capsys, "train", f"--config={cfg}", f"--config.run_dir={tmp_path}/run",
             *(f"--config.{o}" for o in SMOKE), "--config.data.prompts_per_step=8",
             "--config.rollout.n=2", "--config.actor.micro_batch_size=1",
             "--config.trainer.total_steps=1", "--config.rollout.prefill_buckets=(40,48)",
             "--config.data.train=builtin:arithmetic:basic",
             "--config.data.eval=builtin:arithmetic:basic",
             f"--config.rollout.env={env}", "--config.rollout.env_timeout_s=0.5", *extra)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("env,needle", [
    ("raises", "step raised KeyError"),
    ("hangs", "did not return within rollout.env_timeout_s=0.5"),
    ("nan_reward", "reward nan"),
    ("plugin_envs:NotText", "int observation"),
])
def test_a_failing_environment_stops_the_run_in_one_line(tmp_path, capsys, env, needle):
  code, err = _train(tmp_path, capsys, env, "--config.rollout.on_env_error=stop")
  assert code == 2, err
  assert_one_line(err, f"environment {env!r}", needle, "sample id")


@pytest.mark.timeout(300)
def test_a_failing_environment_under_end_ends_its_episodes(tmp_path, capsys):
  code, err = _train(tmp_path, capsys, "raises")
  assert code == 0, err
  import json
  rows = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
  assert rows[-1]["env/errors"] == 1.0  # every episode ended by its failure, counted


@pytest.mark.timeout(300)
def test_bad_calc_expressions_are_observations_not_crashes(tmp_path, capsys):
  """The built-in calculator handed abusive calls (tests/plugin_envs.py's HostileCalc) in
  a real run: every call answered with an error observation, no environment error."""
  import json
  from plugin_envs import HostileCalc
  HostileCalc.seen.clear()
  code, err = _train(tmp_path, capsys, "hostile_calc")
  assert code == 0, err
  rows = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
  assert rows[-1]["env/errors"] == 0.0
  assert len(HostileCalc.seen) >= len(HostileCalc.CALLS), HostileCalc.seen
  assert all(o.startswith(" error: ") for o in HostileCalc.seen), HostileCalc.seen
