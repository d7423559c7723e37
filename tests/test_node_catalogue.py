"""The node catalogue (distflow_jax/nodes/): the family tables and the registry agree, and an
advantage estimator is added with one call and runs through the DAG executor."""

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distflow_jax import nodes
from distflow_jax.algos.advantages import AdvantageOutput
from distflow_jax.config import loading
from distflow_jax.config.checks import plan_from_config
from distflow_jax.dag import FUNCTIONS, Topology, rules
from distflow_jax.dag.registry import BUILTIN_SPECS, estimator_spec
from distflow_jax.dag.spec import Node, NodeType, Role
from distflow_jax.data import layout as dlayout
from distflow_jax.data.batch import GROUP_ID, SAMPLE_ID, Batch, to_global, to_local
from distflow_jax.nodes import training
from distflow_jax.nodes.advantages import register_estimator
from distflow_jax.algos.estimators import BUILTIN_ESTIMATORS, AdvantageInput, Estimator
from distflow_jax.run import trainer
from workflow_util import smoke_overrides

TEST_NAME = "advantage.test_constant"


# ---- (a) tables and registry agree ---------------------------------------------------------

def test_every_builtin_spec_has_one_implementation_in_one_family_and_back():
  owners = collections.defaultdict(list)
  for family, table in nodes.tables().items():
    for name in table:
      owners[name].append(family)
  spec_names = [s.name for s in BUILTIN_SPECS]
  assert len(set(spec_names)) == len(spec_names)
  assert sorted(owners) == sorted(spec_names)
  assert {n: f for n, f in owners.items() if len(f) != 1} == {}


def test_bind_builtins_binds_each_family_function():
  nodes.bind_builtins()
  for table in nodes.tables().values():
    for name, fn in table.items():
      assert FUNCTIONS.impl(name) is fn


def test_estimator_table_is_the_advantage_family_and_specs_come_from_it():
  assert sorted(nodes.tables()["advantages"]) == sorted(e.name for e in BUILTIN_ESTIMATORS)
  for est in BUILTIN_ESTIMATORS:
    spec = FUNCTIONS.spec(est.name)
    assert spec == estimator_spec(est)
    assert spec.needs_groups == est.needs_groups
    assert ("values" in spec.requires) == est.values
    assert ("baseline_tokens" in spec.requires) == est.baseline
    assert ("sum_pi_squared" in spec.requires) == est.token_stats
  # The KL-in-reward rule reads the estimators that use per-token rewards.
  assert {s.name for s in BUILTIN_SPECS if s.kl_reward} == {
      "advantage.gae", "advantage.reinforce_pp", "advantage.remax", "advantage.otb"}


def test_rule_reward_specs_and_nodes_come_from_the_reward_table():
  from distflow_jax.dag.registry import rule_reward_spec
  from distflow_jax.rewards.registry import BUILTIN_RULE_NODES
  names = {f"reward.{r.name}" for r in BUILTIN_RULE_NODES}
  assert names == {"reward.math", "reward.math_lenient", "reward.format"}
  assert names <= set(nodes.tables()["rewards"])
  for rule in BUILTIN_RULE_NODES:
    assert FUNCTIONS.spec(f"reward.{rule.name}") == rule_reward_spec(rule)
  assert {r.name for r in BUILTIN_RULE_NODES if r.verifier} == {"math", "math_lenient"}


def test_a_rule_reward_is_one_call_and_a_verifier_logs_accuracy():
  from distflow_jax.dag.registry import Registry
  from distflow_jax.nodes.rewards import register_rule_reward
  from distflow_jax.rewards import registry as rewards
  reg = Registry("node function")
  register_rule_reward("test_is_seven", lambda c, t: float(c.strip() == "7"),
                       "test: 1 when the answer is 7", verifier=True, registry=reg)
  try:
    spec = reg.spec("reward.test_is_seven")
    assert spec.doc == "test: 1 when the answer is 7" and spec.produces == {"rewards"}
    assert spec.scores_baseline and reg.impl("reward.test_is_seven").args == ("test_is_seven",)
    assert rewards.rule_node("test_is_seven").verifier
    with pytest.raises(ValueError, match="'math' is built in"):
      register_rule_reward("math", lambda c, t: 1.0, "a second math", registry=reg)
    rewards.register_reward("test_is_seven", lambda c, t: 0.0, overwrite=True)
    assert rewards.rule_node("test_is_seven") is None  # a scoring function only now
  finally:
    rewards._REGISTRY.pop("test_is_seven", None)
    rewards._NODES.pop("test_is_seven", None)


# ---- (b) a test-only estimator, one call ----------------------------------------------------

def _constant(x: AdvantageInput) -> AdvantageOutput:
  """Advantage 1.0 on every real response token; no returns."""
  return AdvantageOutput(x.mask_BxT, jnp.zeros_like(x.mask_BxT))


@pytest.fixture
def estimator(request):
  """Registers the test estimator (with the fields given by the test's param) and removes
  it again, so no other test sees it."""
  est = Estimator(TEST_NAME, _constant, doc="test: advantage 1 per response token",
                  **getattr(request, "param", {}))
  register_estimator(est)
  try:
    yield est
  finally:
    FUNCTIONS.unregister(TEST_NAME)
  assert TEST_NAME not in FUNCTIONS


@pytest.mark.parametrize("estimator", [dict(needs_groups=True)], indirect=True)
def test_registered_estimator_spec_follows_its_entry(estimator):
  spec = FUNCTIONS.spec(TEST_NAME)
  assert spec.needs_groups and spec.section == "algo" and not spec.kl_reward
  assert spec.requires == {"rewards"} and spec.produces == {"advantages"}
  cfg = loading.load("grpo:tiny", ["rollout.n=1", "data.prompts_per_step=8"])
  with cfg.unlocked():
    cfg.dag = [dict(d, fn=TEST_NAME) if d["fn"] == "advantage.grpo" else dict(d)
               for d in cfg.dag]
  with pytest.raises(loading.ConfigError, match=r"needs prompt groups, but rollout\.n=1"):
    plan_from_config(cfg, Topology(1, 8), FUNCTIONS)


class _Ctx:
  """The parts of a RunContext an advantage node reads."""

  def __init__(self, cfg):
    self.cfg, self.kl_coef = cfg, None

  def section(self, node, name):
    return self.cfg[name]


@pytest.mark.parametrize("estimator, want", [
    (dict(), "mask"),
    # Whitening a constant gives zero: the flag alone decides that the node whitens.
    (dict(whiten=True), "zero"),
], indirect=["estimator"])
def test_estimator_node_honours_its_whiten_flag(estimator, want):
  lay = dlayout.Layout(dlayout.flat_mesh("data"), ("data",))
  b, t = 16, 5
  mask = np.arange(t)[None, :] < (np.arange(b) % t + 1)[:, None]
  ids = np.arange(b, dtype=np.int32)
  batch = to_global(Batch({"rewards": np.ones(b, np.float32), "response_mask": mask,
                           "rollout_logprobs": np.zeros((b, t), np.float32),
                           SAMPLE_ID: ids, GROUP_ID: ids // 2}, {}), lay)
  node = Node(id="adv", fn=TEST_NAME, type=NodeType.COMPUTE, role=None)
  out = FUNCTIONS.impl(TEST_NAME)(_Ctx(loading.load("grpo:tiny")), node, lay, batch).batch
  adv = to_local(Batch({k: out.data[k] for k in ("advantages", SAMPLE_ID, GROUP_ID)}))
  expect = mask.astype(np.float32) if want == "mask" else np.zeros((b, t), np.float32)
  np.testing.assert_array_equal(adv.data["advantages"], expect)


@pytest.mark.timeout(600)
def test_registered_estimator_runs_in_a_grpo_step_and_reaches_the_train_step(
    estimator, tmp_path):
  cfg = loading.load("grpo:tiny", smoke_overrides(
      tmp_path, "cluster.devices_per_process=8", "data.prompts_per_step=8", "rollout.n=2",
      "actor.micro_batch_size=1", "trainer.total_steps=1"))
  with cfg.unlocked():
    cfg.dag = [dict(d, fn=TEST_NAME) if d["fn"] == "advantage.grpo" else dict(d)
               for d in cfg.dag]
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  seen = []

  def spy(ctx, node, lay, batch):  # what train.actor is handed
    keys = ("advantages", "response_mask", SAMPLE_ID, GROUP_ID)
    seen.append(to_local(Batch({k: batch.data[k] for k in keys})).data)
    return training.NODES["train.actor"](ctx, node, lay, batch)

  before = jax.tree.map(np.asarray, ctx.roles[Role.ACTOR].params)
  FUNCTIONS.bind("train.actor", spy)
  try:
    metrics = list(trainer.train(ctx, loaders))
  finally:
    FUNCTIONS.bind("train.actor", training.NODES["train.actor"])
  after = jax.tree.map(np.asarray, ctx.roles[Role.ACTOR].params)
  assert [m["step"] for m in metrics] == [1]
  assert len(seen) == 1
  np.testing.assert_array_equal(seen[0]["advantages"],
                                seen[0]["response_mask"].astype(np.float32))
  assert seen[0]["response_mask"].any()
  assert math.isfinite(metrics[0]["actor/loss"]) and metrics[0]["actor/skipped"] == 0.0
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                      jax.tree.leaves(after)))
