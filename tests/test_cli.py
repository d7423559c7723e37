"""The distflow-jax command line."""

import subprocess
import sys

import pytest


def run(*args):
  return subprocess.run([sys.executable, "-m", "distflow_jax.cli", *args],
                        capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(120)
def test_plan_prints_chain_and_is_deterministic():
  a = run("plan", "--config=configs/grpo.py:tiny")
  b = run("plan", "--config=configs/grpo.py:tiny")
  assert a.returncode == 0, a.stderr
  assert a.stdout == b.stdout
  chain = [l.split()[1] for l in a.stdout.splitlines() if l.startswith("  ") and ". " in l
           and "[" in l and "fn=" in l]
  assert chain == ["generate", "reward", "advantage", "old_logprob", "ref_logprob",
                   "train_actor"]
  assert "re-partitions per step: 0" in a.stdout


@pytest.mark.timeout(120)
def test_plan_for_one_process_with_overrides():
  r = run("plan", "--config=configs/grpo.py:tiny", "--num_processes=2",
          "--devices_per_process=4", "--config.cluster.devices_per_process=4",
          "--config.rollout.tensor_parallel=2", "--process=1")
  assert r.returncode == 0, r.stderr
  assert "process 1 (devices [4..7])" in r.stdout
  assert "process 0 (" not in r.stdout
  assert "advantage -> old_logprob (all-to-all)" in r.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, pattern", [
    (["--config=configs/grpo.py:tiny", "--config.actor.optimizr.lr=1"], "optimizr"),
    (["--config=configs/grpo.py:tiny", "--proces=1"], "unknown flag --proces; did you mean --process"),
    (["--config=configs/grpo.py:tiny", "--process=5"], "--process=5 is out of range"),
    (["--config=configs/grpo.py:tiny", "--config.rollout.n=3",
      "--config.data.prompts_per_step=3"], "prompts_per_step=3"),
])
def test_plan_errors_are_one_clean_line(args, pattern):
  r = run("plan", *args)
  assert r.returncode == 2
  assert pattern in r.stderr
  assert "Traceback" not in r.stderr


def test_unknown_command():
  r = run("trian")
  assert r.returncode == 2 and "unknown command 'trian'" in r.stderr


@pytest.mark.timeout(240)
def test_user_error_deep_in_a_command_is_one_line_and_debug_shows_the_traceback(tmp_path):
  # A run_dir below a regular file (tests run as root: chmod would not stop them).
  blocker = tmp_path / "a_file"
  blocker.write_text("x")
  args = ("train", "--config=grpo:tiny", f"--config.run_dir={blocker}/run")
  r = run(*args)
  assert r.returncode == 2, r.stderr[-2000:]
  assert f"distflow-jax train: error: Not a directory: {blocker}" in r.stderr
  assert "Traceback" not in r.stderr
  r = run("--debug", *args)
  assert r.returncode == 2 and "Traceback" in r.stderr, r.stderr[-2000:]


def test_dispatcher_imports_commands_only_when_they_run():
  """train/eval set the simulated device count before jax is imported; report needs no jax."""
  code = ("import sys; from distflow_jax import cli; "
          "assert 'jax' not in sys.modules and not any(f'distflow_jax.commands.{n}' in "
          "sys.modules for n in cli.COMMANDS), sorted(sys.modules); "
          "assert list(cli.COMMANDS) == ['plan', 'launch', 'train', 'sft', 'generate', 'export', "
          "'convert', 'report', 'eval', 'config']")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert r.returncode == 0, r.stderr[-2000:]
