"""DAG validation and planning: shipped workflows, a custom one, and bad DAGs."""

import copy

import numpy as np
import pytest

from distflow_jax.config import loading
from distflow_jax.config.checks import plan_from_config
from distflow_jax.dag import FUNCTIONS, DagError, Topology, build_dag, make_plan, render
from distflow_jax.dag.planner import LayoutKind, Move
from distflow_jax.dag.registry import FunctionSpec, Placement, Registry, default_registry
from distflow_jax.dag.spec import NodeType, Role

TOPO_1x8 = Topology(1, 8)
TOPO_2x4 = Topology(2, 4)


def plan_of(name, topo=TOPO_1x8, overrides=()):
  cfg = loading.load(name, overrides)
  return plan_from_config(cfg, topo, FUNCTIONS)


def test_grpo_plan_is_distflow_order():
  plan = plan_of("grpo:tiny")
  assert plan.order == ["generate", "reward", "advantage", "old_logprob", "ref_logprob",
                        "train_actor"]
  assert plan.repartitions() == []


def test_ppo_plan_is_distflow_order():
  plan = plan_of("ppo:tiny")
  assert plan.order == ["generate", "reward", "old_logprob", "ref_logprob", "values",
                        "advantage", "train_critic", "train_actor"]


def test_custom_two_reward_dag_validates_and_plans():
  plan = plan_of("reinforce_pp_two_rewards")
  assert plan.order[:4] == ["generate", "reward_math", "reward_format", "advantage"]
  adv = plan.step("advantage")
  assert adv.node.deps == ("reward_math", "reward_format")
  assert adv.groups_intact
  assert dict(plan.step("reward_format").node.overrides) == {"weight": 0.2}


def test_layout_change_gives_repartition_edge():
  # Rollout replicas of 2 devices (dp 4) feeding FSDP over 8 devices (dp 8).
  plan = plan_of("grpo:tiny", TOPO_2x4, ["cluster.devices_per_process=4",
                                         "rollout.tensor_parallel=2"])
  assert plan.repartitions() == [("advantage", "old_logprob")]
  kinds = {(e.src, e.dst): e.kind for e in plan.edges}
  assert kinds[("generate", "reward")] is Move.FAST
  assert kinds[("generate", "old_logprob")] is Move.REPARTITION
  assert kinds[("old_logprob", "train_actor")] is Move.FAST
  # Group advantages ran before the re-partition, so groups were whole.
  assert plan.step("advantage").groups_intact
  assert not plan.step("train_actor").groups_intact


def test_group_node_after_repartition_moves_back_to_rollout_layout():
  dag = build_dag([
      dict(id="gen", fn="generate"),
      dict(id="lp", fn="logprob", deps=["gen"]),
      dict(id="rw", fn="reward.math", deps=["lp"]),
      dict(id="adv", fn="advantage.grpo", deps=["rw"]),
      dict(id="train", fn="train.actor", deps=["adv", "lp"]),
  ], FUNCTIONS)
  plan = make_plan(dag, FUNCTIONS, TOPO_2x4, rollout_tensor_parallel=2)
  adv = plan.step("adv")
  assert adv.layout.kind is LayoutKind.ROLLOUT and adv.groups_intact
  assert plan.repartitions() == [("gen", "lp"), ("rw", "adv"), ("adv", "train")]


def test_disaggregated_placement():
  plan = plan_of("ppo:tiny", overrides=["placement.critic.devices=4:8",
                                        "placement.critic.mesh.fsdp=4"])
  critic = next(m for m in plan.meshes if m.role is Role.CRITIC)
  assert critic.devices == (4, 5, 6, 7) and critic.dp_size == 4
  assert ("generate", "values") in [(e.src, e.dst) for e in plan.edges
                                    if e.kind is Move.REPARTITION]
  # Process portions: with 2 processes, process 0 holds no critic devices.
  plan2 = plan_of("ppo:tiny", TOPO_2x4, ["cluster.devices_per_process=4",
                                         "placement.critic.devices=4:8",
                                         "placement.critic.mesh.fsdp=4",
                                         "actor.micro_batch_size=1",
                                         "critic.micro_batch_size=1"])
  p0 = [s.node.id for s, _ in plan2.portion(0)]
  p1 = [s.node.id for s, _ in plan2.portion(1)]
  assert "values" not in p0 and "train_critic" not in p0
  assert "values" in p1 and dict(plan2.portion(1))[plan2.step("values")] == (4, 5, 6, 7)


def test_every_process_gets_the_same_plan():
  a = render(plan_of("ppo:tiny", TOPO_2x4, ["cluster.devices_per_process=4",
                                            "actor.micro_batch_size=1",
                                            "critic.micro_batch_size=1"]))
  b = render(plan_of("ppo:tiny", TOPO_2x4, ["cluster.devices_per_process=4",
                                            "actor.micro_batch_size=1",
                                            "critic.micro_batch_size=1"]))
  assert a == b


GOOD = [
    dict(id="gen", fn="generate"),
    dict(id="rw", fn="reward.math", deps=["gen"]),
    dict(id="adv", fn="advantage.grpo", deps=["rw"]),
    dict(id="train", fn="train.actor", deps=["adv"]),
]


def with_change(i, **kv):
  nodes = copy.deepcopy(GOOD)
  nodes[i].update(kv)
  return nodes


BAD_DAGS = {
    "cycle": (with_change(0, deps=["train"]), r"cycle: .*gen"),
    "missing dependency": (with_change(2, deps=["rwd"]), r"'adv' depends on 'rwd'"),
    "duplicate id": (GOOD + [dict(id="rw", fn="reward.format", deps=["gen"])],
                     r"duplicate node id 'rw'"),
    "unknown function": (with_change(1, fn="reward.maths"),
                         r"'rw'.*unknown node function 'reward.maths'.*reward.math"),
    "unknown role": (with_change(1, role="JUDGE"), r"'rw'.*unknown role 'JUDGE'"),
    "unknown type": (with_change(1, type="MODEL_EVAL"), r"'rw'.*unknown type 'MODEL_EVAL'"),
    "train a rule reward": (with_change(1, type="MODEL_TRAIN", role="REWARD"),
                            r"'rw'.*type MODEL_TRAIN makes no sense"),
    "train the reference": (
        GOOD + [dict(id="tref", fn="train.actor", role="REFERENCE", deps=["adv"])],
        r"'tref'.*role REFERENCE makes no sense"),
    "unreachable": (GOOD + [dict(id="orphan", fn="reward.format", role=None, type="COMPUTE",
                                 deps=["orphan2"]),
                            dict(id="orphan2", fn="reward.format", deps=["orphan"])],
                    r"cycle"),
    "no training sink": (GOOD[:3], r"no training sink"),
    "dead end": (GOOD + [dict(id="extra", fn="reward.format", deps=["gen"])],
                 r"'extra' is a dead end"),
    "missing input": ([dict(id="gen", fn="generate"),
                       dict(id="train", fn="train.actor", deps=["gen"])],
                      r"'train'.*needs 'advantages'"),
    "unknown key": (with_change(1, weight=2.0), r"'rw': unknown key\(s\) \['weight'\]"),
    "self dependency": (with_change(1, deps=["rw"]), r"'rw' depends on itself"),
    "two producers": (GOOD[:3] + [
        dict(id="adv2", fn="advantage.rloo", deps=["rw"]),
        dict(id="train", fn="train.actor", deps=["adv", "adv2"])],
        r"'train' sees 'advantages' from several ancestors \['adv', 'adv2'\]"),
    "empty": ([], r"empty"),
}


@pytest.mark.parametrize("name", sorted(BAD_DAGS))
def test_bad_dag_is_refused_naming_the_culprit(name):
  nodes, pattern = BAD_DAGS[name]
  with pytest.raises(DagError, match=pattern):
    build_dag(nodes, FUNCTIONS)


def test_unreachable_from_entry():
  nodes = GOOD + [dict(id="lonely", fn="generate"),
                  dict(id="t2", fn="train.actor", deps=["adv", "lonely"])]
  with pytest.raises(DagError, match=r"entry"):
    build_dag(nodes, FUNCTIONS)
  with pytest.raises(DagError, match=r"\['lonely'\] unreachable from the entry node 'gen'"):
    build_dag(nodes, FUNCTIONS, entry="gen")


def test_user_registered_function_without_package_edit():
  reg = default_registry()
  reg.register(FunctionSpec(name="reward.length", types=frozenset({NodeType.COMPUTE}),
                            roles=frozenset({None}), placement=Placement.INHERIT,
                            section="reward",
                            requires=frozenset({"response_tokens", "response_mask"}),
                            produces=frozenset({"rewards"})))
  nodes = with_change(1, fn="reward.length")
  dag = build_dag(nodes, reg)
  assert dag.node("rw").fn == "reward.length"
  with pytest.raises(DagError):
    build_dag(nodes, FUNCTIONS)  # the global registry is untouched


@pytest.mark.parametrize("what, field, expect", [
    ("requires", "response_token", r"requires 'response_token', which is not a batch field; "
                                   r"did you mean 'response_tokens'"),
    ("produces", "reward", r"produces 'reward', which is not a batch field; did you "
                           r"mean 'rewards'"),
    # the old pseudo-field of the rollout's token fields
    ("requires", "tokens", r"requires 'tokens', which is not a batch field; the rollout's "
                           r"tokens are the fields prompt_tokens, prompt_mask, "
                           r"response_tokens, response_mask"),
])
def test_a_spec_naming_a_field_the_batch_lacks_fails_when_the_dag_is_built(what, field, expect):
  reg = default_registry()
  sets = {"requires": {"response_tokens"}, "produces": {"rewards"}}
  sets[what] = {field}
  reg.register(FunctionSpec(name="reward.length", types=frozenset({NodeType.COMPUTE}),
                            roles=frozenset({None}), placement=Placement.INHERIT,
                            section="reward", requires=frozenset(sets["requires"]),
                            produces=frozenset(sets["produces"])))
  with pytest.raises(DagError, match=r"DAG node 'rw': fn 'reward.length' " + expect):
    build_dag(with_change(1, fn="reward.length"), reg)


def test_a_plugin_field_registered_first_is_accepted():
  from distflow_jax.data import fields
  name = fields.register(fields.Field("length_bonus", (), np.float32, "a test field"))
  try:
    assert fields.register(fields.Field("length_bonus", (), np.float32, "a test field"))
    with pytest.raises(ValueError, match="registered already"):
      fields.register(fields.Field("length_bonus", ("N",), np.float32, "another"))
    with pytest.raises(ValueError, match="built-in batch field"):
      fields.unregister("rewards")
    reg = default_registry()
    reg.register(FunctionSpec(name="reward.length", types=frozenset({NodeType.COMPUTE}),
                              roles=frozenset({None}), placement=Placement.INHERIT,
                              section="reward", requires=frozenset({"response_tokens"}),
                              produces=frozenset({"rewards", name})))
    assert build_dag(with_change(1, fn="reward.length"), reg).node("rw").fn == "reward.length"
  finally:
    fields.unregister(name)


def test_registry_impl_binding_errors():
  reg = Registry("node function")
  with pytest.raises(DagError, match="unknown node function 'x'"):
    reg.bind("x", print)
  reg.register(FUNCTIONS.spec("generate"))
  with pytest.raises(DagError, match="no implementation bound"):
    reg.impl("generate")
