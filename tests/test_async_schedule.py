"""run/transfer.py's schedule: the one global order of an asynchronous run's cross-process
copies on disjoint processes (both groups issue exactly it; jax pairs copies by call
order, so any other order on one side deadlocks)."""

import pytest

from distflow_jax.run.transfer import Kind, Transfer, schedule

pytestmark = pytest.mark.timeout(60)


def _names(steps):
  return [f"{'w' if t.kind is Kind.WEIGHTS else 'b'}{t.index}" for t in steps]


def test_k1_alternates_after_the_first_two_batches():
  assert _names(schedule(1, 0, 4)) == ["w0", "b0", "b1", "w1", "b2", "w2", "b3"]


def test_k0_is_the_synchronous_loop():
  assert _names(schedule(0, 0, 3)) == ["w0", "b0", "w1", "b1", "w2", "b2"]


def test_nothing_past_the_last_step_and_no_unused_version():
  assert _names(schedule(2, 0, 2)) == ["w0", "b0", "b1"]
  assert _names(schedule(1, 3, 5)) == ["w3", "b3", "b4"]


@pytest.mark.parametrize("k,start,total", [(1, 0, 7), (2, 0, 9), (3, 2, 11), (0, 1, 5)])
def test_every_batch_follows_the_version_that_makes_it(k, start, total):
  steps = schedule(k, start, total)
  assert [t.index for t in steps if t.kind is Kind.BATCH] == list(range(start, total))
  for i, t in enumerate(steps):
    if t.kind is Kind.BATCH:
      version = max(start, t.index - k)
      assert Transfer(Kind.WEIGHTS, version) in steps[:i]
      later = [s.index for s in steps[:i] if s.kind is Kind.WEIGHTS]
      assert max(later) == version  # no newer version was sent before it: it is fresh


@pytest.mark.parametrize("k,start,total,restored", [(1, 3, 7, 1), (2, 1, 9, 2), (2, 0, 2, 2),
                                                    (3, 4, 6, 2)])
def test_a_resumed_run_moves_none_of_its_restored_batches(k, start, total, restored):
  """A resume from step ``start`` with ``restored`` batches in flight from the checkpoint
  (run/disjoint_state.py): the rest of the uninterrupted run's order, nothing before."""
  steps = schedule(k, start, total, restored)
  assert [t.index for t in steps if t.kind is Kind.BATCH] == list(range(start + restored,
                                                                           total))
  for i, t in enumerate(steps):
    if t.kind is Kind.BATCH:
      version = max(start, t.index - k)
      assert [s.index for s in steps[:i] if s.kind is Kind.WEIGHTS][-1] == version


def _thread(steps, gates, log):
  """A transfer thread whose copy ``t`` waits for ``gates[t]`` (a threading.Event)."""
  from distflow_jax.run.transfer import Transfers

  def handler(kind):
    def run(i):
      gates[Transfer(kind, i)].wait(10)
      log.append(Transfer(kind, i))
    return run
  return Transfers(steps, {k: handler(k) for k in Kind})


def test_wait_before_returns_once_every_earlier_copy_is_done():
  import threading
  steps = schedule(1, 0, 4)  # w0 b0 b1 w1 b2 w2 b3
  gates = {t: threading.Event() for t in steps}
  log = []
  threads = _thread(steps, gates, log)
  waited = threading.Event()

  def main():
    threads.wait_before(Transfer(Kind.BATCH, 2))  # after w0 b0 b1 w1
    waited.set()
  waiter = threading.Thread(target=main)
  waiter.start()
  for t in steps[:3]:
    gates[t].set()
  assert not waited.wait(0.3)  # w1 is not done: it still waits
  gates[steps[3]].set()
  assert waited.wait(5) and log == steps[:4]
  threads.wait_before(Transfer(Kind.BATCH, 9))  # not in the schedule: no wait
  for t in steps[4:]:
    gates[t].set()
  threads.join()
  waiter.join()


def test_wait_before_raises_the_threads_error_instead_of_hanging():
  from distflow_jax.run.transfer import Transfers
  steps = schedule(1, 0, 3)

  def fail(i):
    raise OSError(f"peer gone at {i}")
  threads = Transfers(steps, {Kind.WEIGHTS: fail, Kind.BATCH: fail})
  with pytest.raises(OSError, match="peer gone at 0"):
    threads.wait_before(Transfer(Kind.BATCH, 2))
