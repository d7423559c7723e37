"""The local launcher with real jax.distributed processes."""

import os
import subprocess
import sys
import time

import pytest

from distflow_jax import launcher
from distflow_jax.config.loading import ConfigError

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(120)
def test_cross_process_all_to_all_2x2():
  result = launcher.launch(2, 2, [sys.executable, "tests/mp/all_to_all.py"], timeout_s=100,
                           out=None)
  assert result.ok, result.describe() + "\n" + "\n".join(sum(result.outputs, []))
  for i in range(2):
    assert f"OK process {i}/2 devices=4" in result.outputs[i]


@pytest.mark.timeout(120)
def test_failing_child_stops_the_others_and_is_named():
  start = time.monotonic()
  result = launcher.launch(2, 2, [sys.executable, "tests/mp/exit_code.py", "3"],
                           timeout_s=100, out=None)
  elapsed = time.monotonic() - start
  assert not result.ok
  assert result.first_failure == (1, 3)
  assert "process 1 exited with code 3" in result.describe()
  assert elapsed < 30, elapsed
  assert all(rc is not None for rc in result.returncodes)  # nobody left running


@pytest.mark.timeout(60)
def test_deadline_kills_a_hung_run():
  result = launcher.launch(2, 1, [sys.executable, "-c", "import time; time.sleep(600)"],
                           timeout_s=2, grace_s=1, out=None)
  assert result.timed_out and not result.ok
  assert all(rc is not None for rc in result.returncodes)


@pytest.mark.timeout(120)
def test_cli_launch_prefixes_lines_and_propagates_exit_code():
  proc = subprocess.run(
      [sys.executable, "-m", "distflow_jax.cli", "launch", "-n", "2",
       "--devices-per-process", "2", "--", sys.executable, "tests/mp/exit_code.py", "3"],
      capture_output=True, text=True, timeout=100)
  assert proc.returncode == 3, proc.stdout + proc.stderr
  assert "process 1 exited with code 3" in proc.stderr


@pytest.mark.timeout(60)
def test_child_env_sets_device_count_and_coordinator():
  env = launcher.child_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo"},
                           coordinator="127.0.0.1:1", num_processes=3, process_id=2,
                           devices_per_process=2)
  assert env["XLA_FLAGS"].split() == ["--foo", "--xla_force_host_platform_device_count=2"]
  assert env["DISTFLOW_PROCESS_ID"] == "2" and env["DISTFLOW_NUM_PROCESSES"] == "3"


def test_bad_arguments():
  with pytest.raises(ConfigError, match="num-processes must be >= 1"):
    launcher.launch(0, 1, ["true"])
  with pytest.raises(ConfigError, match="devices-per-process"):
    launcher.launch(1, -2, ["true"])
  with pytest.raises(ConfigError, match="command"):
    launcher.launch(1, 1, [])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("share", ["1", "0"])
def test_the_suites_processes_compile_a_program_once_and_share_it(tmp_path, share):
  """The suite's sharing (tests/share_site/sitecustomize.py): process 0 compiles the
  cross-process program, process 1 loads its binary instead of compiling, and the program's
  result is still exact in both; with the sharing off both compile.  Its own cache
  folder: a program already in the suite's cache would be loaded by both, shared by none."""
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
             DISTFLOW_TEST_SHARE_BINARIES=share, JAX_SHARE_BINARY_BETWEEN_HOSTS=share)
  result = launcher.launch(2, 2, [sys.executable, "tests/mp/shared_compile.py"], timeout_s=200,
                           env=env, out=None)
  assert result.ok, result.describe() + "\n" + "\n".join(sum(result.outputs, []))
  first, second = ("\n".join(o) for o in result.outputs)
  for i, text in enumerate((first, second)):
    assert f"OK process {i}/2 sum=20.0" in text
  if share == "1":
    assert "Process 0 compiling and sharing module" in first, first[-2000:]
    # It waits for the binary, or, when process 0 has already written it to the cache
    # folder by the time it looks (the key being the same), loads it from there.
    assert ("Waiting for module" in second or "Persistent compilation cache hit" in second
            ) and "compiling and sharing" not in second, second[-2000:]
  else:
    assert "Waiting for module" not in second and "compiling and sharing" not in first


def test_a_survivor_aborted_by_jax_is_not_named_as_the_failure():
  import signal
  # One poll saw both ended: process 1's SIGABRT is jax's client reacting to process 0.
  assert launcher._first_failure([-signal.SIGABRT, -signal.SIGKILL]) == (1, -signal.SIGKILL)
  assert launcher._first_failure([None, -signal.SIGABRT]) == (1, -signal.SIGABRT)
  result = launcher.LaunchResult(
      returncodes=[-signal.SIGKILL, -signal.SIGABRT],
      outputs=[[], ["F1202 client.cc:80] Terminating process because the leader task died"]],
      first_failure=(0, -signal.SIGKILL), timed_out=False, elapsed_s=3.0)
  assert result.describe() == (
      "process 0 killed by signal 9 (SIGKILL); then jax's coordination client aborted "
      "process(es) [1] (the C++ 'Check failure' stack trace above is that abort, not a "
      "second fault); the other processes were stopped")


@pytest.mark.timeout(120)
def test_process_0_killed_is_named_last_whoever_ends_the_survivor():
  """Process 0 SIGKILLs itself: the launch's last line names it (and, when jax's client
  aborted process 1 before the launcher stopped it, says that its trace is that)."""
  import io
  out = io.StringIO()
  result = launcher.launch(2, 1, [sys.executable, "tests/mp/leader_dies.py"], timeout_s=100,
                           out=out)
  assert result.first_failure == (0, -9), (result.returncodes, out.getvalue())
  last = out.getvalue().rstrip("\n").splitlines()[-1]
  assert last.startswith("[launch] process 0 killed by signal 9 (SIGKILL)"), last
  if result.returncodes[1] == -6:
    assert "aborted process(es) [1]" in last, last
