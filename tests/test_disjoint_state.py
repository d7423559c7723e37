"""run/disjoint_state.py without processes: what a training process of an asynchronous run
on disjoint processes restores, and what it refuses (each in one line naming what to do)."""

import numpy as np
import pytest

from distflow_jax.config.async_checks import ProcessSplit
from distflow_jax.config.loading import ConfigError
from distflow_jax.data.batch import GROUP_ID, SAMPLE_ID, Batch
from distflow_jax.persist import in_flight
from distflow_jax.persist.checkpoint_contents import CheckpointError, restore_loader
from distflow_jax.run import disjoint_state as ds

pytestmark = pytest.mark.timeout(60)

SPLIT = ProcessSplit(rollout=(2, 3), training=(0, 1))


def _state(indexes, loaders=2):
  ids = np.arange(4, dtype=np.int32)
  rows = Batch({"x": ids * 2, SAMPLE_ID: ids, GROUP_ID: ids}, {})
  return {ds.IN_FLIGHT: [ds.encode(j, j, rows, [{"metrics": {}}]) for j in indexes],
          ds.ROLLOUT_LOADERS: [{"epoch": 0, "position": p} for p in range(loaders)]}


def test_each_training_process_keeps_its_own_state():
  loader = ds.TrainingLoader(SPLIT, 1)
  states = [_state([3]), _state([3, 4])]
  restore_loader(loader, states, print)
  assert loader.restored is states[1]
  got = ds.restored_batches(loader.restored, 3, 2)
  assert [r["index"] for r in got] == [3, 4]
  assert in_flight.decode(got[0]).batch.data["x"].tolist() == [0, 2, 4, 6]


@pytest.mark.parametrize("states,needle", [
    ([_state([1])], "saved by 1 training process(es) and this run trains on 2"),
    ([_state([1], 1), _state([1], 1)], "positions of 1 rollout process(es) and this run has 2"),
    ([{"epoch": 0, "position": 3}] * 2, "each ran the rollout and the training"),
])
def test_another_split_is_refused(states, needle):
  with pytest.raises(CheckpointError) as e:
    restore_loader(ds.TrainingLoader(SPLIT, 0), states, print)
  assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_disjoint_checkpoint_is_refused_by_a_run_on_shared_processes():
  class Prompts:  # a prompt loader's restore surface
    process_count, process_index = 2, 0

    def set_state(self, state):
      raise AssertionError("not reached")
  with pytest.raises(CheckpointError, match="rollout on processes of its own"):
    restore_loader(Prompts(), [_state([1]), _state([1])], print)


def test_batches_in_flight_must_follow_the_start_and_fit_k():
  with pytest.raises(CheckpointError, match=r"steps \[2, 4\], expected consecutive steps "
                                            r"from 2"):
    ds.restored_batches(_state([2, 4]), 2, 2)
  with pytest.raises(ConfigError, match="more than trainer.max_staleness=1"):
    ds.restored_batches(_state([2, 3]), 2, 1)
  assert ds.restored_batches(None, 5, 1) == []


def test_a_training_process_draws_no_prompts_and_saves_only_with_its_pipeline():
  loader = ds.TrainingLoader(SPLIT, 0)
  with pytest.raises(RuntimeError, match="draws no prompts"):
    next(loader)
  with pytest.raises(RuntimeError, match="only while its pipeline runs"):
    loader.get_state()
