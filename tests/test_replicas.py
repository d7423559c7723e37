"""Rollout replicas inside a host or across hosts (dag/replicas.py) and the pooling of a
spanning replica's prompts (rollout/spanning.py), in one process.  The multi-process runs:
tests/test_workflow_multiprocess.py (deterministic mode, 4 x 1 with two replicas each over
two processes, bitwise equal to 1 x 8 and 2 x 2) and tests/test_async_multiprocess.py (two
rollout processes driving one replica beside two training processes)."""

import numpy as np
import pytest

from distflow_jax.config import loading
from distflow_jax.config.checks import plan_from_config
from distflow_jax.dag import FUNCTIONS, DagError, Topology
from distflow_jax.dag.render import render
from distflow_jax.dag.replicas import group_of, replica_groups, spans_hosts
from distflow_jax.rollout import driver
from distflow_jax.rollout.spanning import SpanningReplica, own_rows, pooled


@pytest.mark.parametrize("topo, devices, tp, want", [
    (Topology(2, 4), range(8), 2, ((0,), (1,))),          # two replicas a host: inside
    (Topology(2, 4), range(8), 4, ((0,), (1,))),
    (Topology(2, 4), range(8), 8, ((0, 1),)),             # one replica over both hosts
    (Topology(4, 2), range(8), 4, ((0, 1), (2, 3))),
    (Topology(4, 1), range(4), 2, ((0, 1), (2, 3))),
    (Topology(4, 2), range(8), 8, ((0, 1, 2, 3),)),
    (Topology(4, 1), (2, 3), 2, ((2, 3),)),               # placement.rollout on processes 2, 3
])
def test_replica_groups(topo, devices, tp, want):
  groups = replica_groups(tuple(devices), tp, topo.process_of)
  assert groups == want
  assert spans_hosts(groups) == (len(want[0]) > 1)
  assert group_of(groups, want[-1][-1]) == want[-1]


@pytest.mark.parametrize("topo, devices, tp", [
    (Topology(3, 2), range(6), 4),    # 3 processes do not pair up
    (Topology(2, 2), range(3), 2),    # process 1 holds 1 device, process 0 two
    (Topology(2, 2), range(4), 3),    # 3 is neither a divisor nor a multiple of 2
    (Topology(2, 4), range(8), 6),
])
def test_replica_shapes_that_fit_no_way_are_one_line(topo, devices, tp):
  with pytest.raises(DagError) as e:
    replica_groups(tuple(devices), tp, topo.process_of, "actor")
  msg = str(e.value)
  assert "\n" not in msg and f"rollout.tensor_parallel={tp} does not fit the actor" in msg


def _plan(topo, *overrides):
  overrides = ["data.prompts_per_step=8", "actor.micro_batch_size=2", *overrides]
  name = "grpo:tiny_env" if any(o.startswith("rollout.env=") for o in overrides) else "grpo:tiny"
  return plan_from_config(loading.load(name, overrides), topo, FUNCTIONS)


def test_plan_says_a_replica_spans_hosts_and_splits_rows_per_process():
  plan = _plan(Topology(4, 1), "rollout.tensor_parallel=2")
  text = render(plan)
  assert ("rollout: one replica per 2 processes (2 actor devices, tensor-parallel across "
          "hosts): processes 0+1, processes 2+3") in text, text
  # Each process keeps its own prompts' rows: the batch splits over the 4 processes.
  assert plan.steps[0].layout.dp_size == 4
  assert "inside each host" in render(_plan(Topology(2, 2), "rollout.tensor_parallel=2"))


EPISODES = ("rollout.env=plugin_envs:Scripted", "rollout.max_new_tokens=24",
            "rollout.max_episode_tokens=48", "rollout.prefill_buckets=(16,32,80)")


@pytest.mark.parametrize("overrides, key", [
    (("rollout.backend=reference",), "rollout.backend"),
    (EPISODES, "rollout.env"),
], ids=["reference_backend", "episodes"])
def test_what_a_spanning_replica_cannot_pool_is_refused_in_one_line(overrides, key):
  with pytest.raises(loading.ConfigError) as e:
    _plan(Topology(2, 1), "rollout.tensor_parallel=2", *overrides)
  msg = str(e.value)
  assert "\n" not in msg
  assert f"rollout.tensor_parallel=2 makes a replica span hosts, which {key}" in msg, msg
  _plan(Topology(2, 2), "rollout.tensor_parallel=2", *overrides)  # inside a host: fine


def test_a_vision_language_run_with_a_spanning_replica_is_one_line():
  cfg = loading.load("grpo_vl:tiny", ["rollout.tensor_parallel=2"])
  with pytest.raises(loading.ConfigError) as e:
    plan_from_config(cfg, Topology(2, 1), FUNCTIONS)
  assert "\n" not in str(e.value) and ("which a vision-language run does not take: images "
                                       "('image') take the reference backend") in str(e.value)


def test_pooled_prompts_and_own_rows_in_one_process():
  mine = [[5, 6, 7], [8]]
  ids = np.array([10, 11, 12, 13], np.uint32)
  prompts, every_ids, offset = pooled(mine, ids, 2, (0,))
  assert prompts == mine and every_ids.tolist() == ids.tolist() and offset == 0
  # A pooled rollout of 3 prompts x 2 samples; this process's prompts are the last two.
  r = 6
  ro = driver.Rollout(prompt_index_R=np.arange(r, dtype=np.int32) // 2,
                      tokens_RxN=np.arange(r * 3).reshape(r, 3).astype(np.int32),
                      mask_RxN=np.ones((r, 3), bool), logprobs_RxN=np.zeros((r, 3), np.float32),
                      sampling_logprobs_RxN=np.zeros((r, 3), np.float32),
                      lengths_R=np.arange(r, dtype=np.int32), stopped_R=np.zeros(r, bool))
  own = own_rows(ro, 1, 2, 2)
  assert own.tokens_RxN.tolist() == ro.tokens_RxN[2:].tolist()
  assert own.prompt_index_R.tolist() == [0, 0, 1, 1] and own.lengths_R.tolist() == [2, 3, 4, 5]


def test_a_spanning_replica_passes_its_pool_to_the_backend_and_refuses_extras():
  seen = {}

  class Inner:
    name = "engine"
    config = "the inner's"

    def generate(self, params, prompts, n, **kw):
      seen.update(prompts=prompts, ids=kw["request_ids"].tolist())
      r = len(prompts) * n
      return driver.Rollout(np.arange(r, dtype=np.int32) // n, np.zeros((r, 2), np.int32),
                            np.ones((r, 2), bool), np.zeros((r, 2), np.float32),
                            np.zeros((r, 2), np.float32), np.ones(r, np.int32),
                            np.zeros(r, bool))

  rep = SpanningReplica(Inner(), (0,))
  assert rep.config == "the inner's" and rep.name == "engine"
  out = rep.generate(None, [[1, 2], [3]], 2, request_ids=[4, 5, 6, 7])
  assert seen == {"prompts": [[1, 2], [3]], "ids": [4, 5, 6, 7]} and len(out.lengths_R) == 4
  with pytest.raises(ValueError, match="3 request_ids for 4 requests"):
    rep.generate(None, [[1, 2], [3]], 2, request_ids=[4, 5, 6])
  with pytest.raises(ValueError, match="images"):
    rep.generate(None, [[1]], 1, images=object())


def test_a_rollout_node_s_own_tensor_parallel_is_checked_as_it_will_run():
  cfg = loading.load("grpo:tiny", ["data.prompts_per_step=8", "actor.micro_batch_size=2"])
  cfg.dag = [dict(d, config=dict(tensor_parallel=3)) if d["fn"] == "generate" else d
             for d in cfg.dag]
  with pytest.raises(DagError) as e:
    plan_from_config(cfg, Topology(2, 2), FUNCTIONS)
  assert str(e.value).startswith("DAG node 'generate': rollout.tensor_parallel=3 does not "
                                 "fit the actor devices (process 0: 2, process 1: 2)"), e.value
  cfg.dag = [dict(d, config=dict(tensor_parallel=4, backend="reference"))
             if d["fn"] == "generate" else d for d in cfg.dag]
  with pytest.raises(loading.ConfigError, match="DAG node 'generate': rollout.tensor_parallel=4 "
                     "makes a replica span hosts, which rollout.backend"):
    plan_from_config(cfg, Topology(2, 2), FUNCTIONS)


@pytest.mark.parametrize("tp, hosts, want", [
    (8, 8, "every device of a host (8): span two hosts with rollout.tensor_parallel=16"),
    (8, 1, "every device of a host (8): make room beside it"),
    (16, 8, "rollout.tensor_parallel=16 already spans 2 hosts (dag/replicas.py): make room"),
])
def test_plan_memory_advice_on_the_rollout_weights(tp, hosts, want):
  from distflow_jax.memory.report import _advice
  cfg = loading.load("grpo:tiny", [f"rollout.tensor_parallel={tp}"])
  assert want in _advice(cfg, fsdp=8, per_host=8, hosts=hosts)["rollout_w"]
