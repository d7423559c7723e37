"""A survivor blocked in a barrier leaves with one line when a peer on its host dies,
and a peer that leaves normally is no loss."""

import os
import signal
import subprocess
import sys
import time

import pytest

from distflow_jax import launcher

pytestmark = pytest.mark.multiprocess


def _start(mode):
  coord = f"127.0.0.1:{launcher.free_port()}"
  procs = []
  for i in range(2):
    env = launcher.child_env(dict(os.environ), coordinator=coord, num_processes=2,
                             process_id=i, devices_per_process=1)
    procs.append(subprocess.Popen([sys.executable, "tests/mp/peer_watchdog.py", mode], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  stdin=subprocess.DEVNULL, start_new_session=True))
  return procs


def _kill(procs):
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def _wait_ready(p, deadline):
  lines = []
  for line in p.stdout:
    lines.append(line)
    if line.startswith("ready"):
      return lines
    assert time.monotonic() < deadline, lines
  raise AssertionError(lines)


@pytest.mark.timeout(120)
def test_survivor_blocked_in_a_barrier_names_the_dead_peer_at_once():
  procs = _start("block")
  try:
    deadline = time.monotonic() + 60
    _wait_ready(procs[0], deadline)
    _wait_ready(procs[1], deadline)
    time.sleep(0.5)  # process 0 is in the barrier now
    os.killpg(procs[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    out, _ = procs[0].communicate(timeout=60)
    took = time.monotonic() - killed
  finally:
    _kill(procs)
  assert procs[0].returncode == 1, out
  # JAX's own heartbeat would take 30 s and end in a C++ stack trace.
  assert took < 10, (took, out)
  assert "lost process 1 of 2" in out and "Check failure" not in out, out


@pytest.mark.timeout(120)
def test_a_peer_that_leaves_normally_is_not_a_loss():
  procs = _start("finish")
  try:
    outs = [p.communicate(timeout=90)[0] for p in procs]
  finally:
    _kill(procs)
  assert [p.returncode for p in procs] == [0, 0], outs
  assert "done 0" in outs[0] and "lost process" not in outs[0], outs[0]


@pytest.mark.timeout(120)
def test_process_0_killed_the_survivor_says_so_in_one_line():
  """Process 0 hosts the coordination service: when it dies, jax's client ends the
  survivor at once with a C++ fatal log and stack trace (SIGABRT) unless the watchdog,
  which reads process 0's exit mark while it lives, names it first."""
  procs = _start("lead")
  try:
    deadline = time.monotonic() + 60
    _wait_ready(procs[0], deadline)
    _wait_ready(procs[1], deadline)
    time.sleep(1.0)  # the watchdog has read process 0's (absent) exit mark
    os.killpg(procs[0].pid, signal.SIGKILL)
    killed = time.monotonic()
    out, _ = procs[1].communicate(timeout=60)
    took = time.monotonic() - killed
  finally:
    _kill(procs)
  assert procs[1].returncode == 1, out
  assert took < 10, (took, out)
  assert "lost process 0 of 2" in out and "coordination service" in out, out
  assert "Check failure" not in out, out


@pytest.mark.timeout(120)
def test_process_0_leaving_normally_first_is_not_a_loss():
  procs = _start("first")
  try:
    outs = [p.communicate(timeout=90)[0] for p in procs]
  finally:
    _kill(procs)
  assert [p.returncode for p in procs] == [0, 0], outs
  assert "done 1" in outs[1] and "lost process" not in outs[1], outs[1]
