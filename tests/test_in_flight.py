"""An asynchronous run's in-flight batches in the loader's saved state (persist/in_flight.py,
run/async_rollout.InFlightLoader): exact round trip through JSON, one clear error for host
fields JSON cannot hold."""

import json

import numpy as np
import pytest

from distflow_jax.data.batch import Batch
from distflow_jax.persist import in_flight
from distflow_jax.run.async_rollout import InFlightLoader
from distflow_jax.state.metrics import Metrics

pytestmark = pytest.mark.timeout(60)


def saved(index=3, version=2, host=None):
  rng = np.random.default_rng(0)
  data = {"sample_id": np.arange(4, dtype=np.int32), "group_id": np.repeat([7, 9], 2),
          "response_tokens": rng.integers(0, 500, (4, 6)).astype(np.int32),
          "response_mask": rng.random((4, 6)) < 0.5,
          "rollout_logprobs": rng.standard_normal((4, 6)).astype(np.float32),
          "policy_version": np.full(4, version, np.int32)}
  m = Metrics()
  m.add_mean("response_length", np.array([3.0, 5.0]))
  m.add_time("time/generate", 0.25)
  host = host if host is not None else {7: {"answer": "12", "prompt": "3 + 9"},
                                        9: {"answer": "1", "prompt": "5 - 4"}}
  return in_flight.Saved(index, version, Batch(data, host), m)


def test_round_trip_is_exact_through_json():
  s = saved()
  back = in_flight.decode(json.loads(json.dumps(in_flight.encode(s))))
  assert (back.index, back.version) == (3, 2)
  assert sorted(back.batch.data) == sorted(s.batch.data)
  for k, v in s.batch.data.items():
    got = back.batch.data[k]
    assert got.dtype == v.dtype and got.shape == v.shape, k
    np.testing.assert_array_equal(got, v, err_msg=k)
  assert back.batch.host == s.batch.host
  assert back.metrics == s.metrics


def test_host_fields_json_cannot_hold_are_named():
  bad = saved(host={7: {"image": object()}, 9: {"answer": "1"}})
  with pytest.raises(ValueError, match=r"in-flight sample 7: its host fields \['image'\]"):
    in_flight.encode(bad)


class _Loader:
  def __init__(self):
    self.state = {"epoch": 0, "position": 5}

  def get_state(self):
    return dict(self.state)

  def set_state(self, state):
    self.state = dict(state)


class _Pipeline:
  def saved(self):
    return [in_flight.encode(saved(index=4, version=3))]


def test_the_loader_state_carries_the_batches_in_flight():
  loader = InFlightLoader(_Loader())
  assert loader.get_state() == {"epoch": 0, "position": 5, "in_flight": []}
  assert loader.state == {"epoch": 0, "position": 5}  # the prompt loader's own attributes
  loader.pipeline = _Pipeline()
  state = json.loads(json.dumps(loader.get_state()))
  other = InFlightLoader(_Loader())
  other.set_state(state)
  assert other.loader.state == {"epoch": 0, "position": 5}  # without the batches
  (back,) = other.restored
  assert (back.index, back.version) == (4, 3)
  np.testing.assert_array_equal(back.batch.data["policy_version"], np.full(4, 3))
