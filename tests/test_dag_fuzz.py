"""Property test: any mutation of a valid workflow DAG is either still valid and plans, or
is refused with the project's own one-line error; never a raw Python exception."""

import copy
import re
import random

from hypothesis import HealthCheck, given, settings, strategies as st

from distflow_jax.config import loading
from distflow_jax.config.checks import plan_from_config
from distflow_jax.config.loading import ConfigError
from distflow_jax.dag import FUNCTIONS, DagError, Topology, build_dag, make_plan
from distflow_jax.dag.rules import check_kl_reference
from test_dag_scale import chain, fan, random_workflow

OURS = (DagError, ConfigError)
NODE_KEYS = ("id", "fn", "type", "role", "deps", "config")

junk = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True),
    st.text(max_size=6), st.binary(max_size=4),
    st.lists(st.one_of(st.text(max_size=4), st.integers(), st.none()), max_size=3),
    st.tuples(st.text(max_size=3)), st.dictionaries(st.text(max_size=3), st.integers(),
                                                    max_size=2),
    st.sampled_from(["ACTOR", "critic", "MODEL_TRAIN", "COMPUTE", "none", "", " ", "gen",
                     "train", "generate", "reward.math", "train.critic", "values",
                     "a\nb", "ref_logprob", "advantage.gae"]))
names = st.one_of(st.text(max_size=6), st.sampled_from(
    ["gen", "rw", "adv", "train", "r0", "r1", "values", "logprob", "ref_logprob", "x",
     "a\nb", "c\td"]))


def base_dag(kind, seed):
  if kind == "chain":
    return chain(3)
  if kind == "fan":
    return fan(3)
  return random_workflow(random.Random(seed), 1 + seed % 5, max_deps=2)


def mutate(nodes, draw):
  """One random change; ``nodes`` may stop being a list of dicts."""
  op = draw(st.sampled_from([
      "drop_dep", "add_dep", "rename", "duplicate", "copy_as_new", "set_field",
      "junk_field", "del_key", "add_key", "cycle", "junk_node", "drop_node", "swap",
      "junk_list"]))
  if not isinstance(nodes, list) or not nodes:
    return nodes
  i = draw(st.integers(0, len(nodes) - 1))
  node = nodes[i]
  ids = [n.get("id") for n in nodes if isinstance(n, dict)]
  if op == "junk_list":
    return draw(st.one_of(junk, st.just(tuple(nodes)), st.just({"dag": nodes})))
  if op == "junk_node":
    nodes[i] = draw(junk)
  elif op == "drop_node":
    del nodes[i]
  elif op == "swap":
    j = draw(st.integers(0, len(nodes) - 1))
    nodes[i], nodes[j] = nodes[j], nodes[i]
  elif not isinstance(node, dict):
    return nodes
  elif op == "drop_dep" and isinstance(node.get("deps"), list) and node["deps"]:
    node["deps"] = [d for d in node["deps"]
                    if d != draw(st.sampled_from(node["deps"]))]
  elif op == "add_dep":
    deps = node.get("deps")
    new = draw(st.one_of(st.sampled_from(ids or ["x"]), names, junk))
    node["deps"] = (list(deps) if isinstance(deps, (list, tuple)) else []) + [new]
  elif op == "cycle":
    j = draw(st.integers(0, len(nodes) - 1))
    deps = node.get("deps")
    node["deps"] = (list(deps) if isinstance(deps, (list, tuple)) else []) + [
        nodes[j].get("id") if isinstance(nodes[j], dict) else "x"]
  elif op == "rename":
    node["id"] = draw(names)
  elif op == "duplicate":
    nodes.insert(draw(st.integers(0, len(nodes))), copy.deepcopy(node))
  elif op == "copy_as_new":
    twin = copy.deepcopy(node)
    twin["id"] = draw(names)
    nodes.insert(draw(st.integers(0, len(nodes))), twin)
  elif op == "set_field":
    key = draw(st.sampled_from(NODE_KEYS))
    node[key] = draw(names if key in ("id", "fn", "role", "type") else junk)
  elif op == "junk_field":
    node[draw(st.sampled_from(NODE_KEYS))] = draw(junk)
  elif op == "del_key":
    if node:
      del node[draw(st.sampled_from(sorted(node, key=repr)))]
  elif op == "add_key":
    node[draw(st.one_of(st.text(max_size=4), st.integers(), st.none()))] = draw(junk)
  return nodes


def check_one_line(e):
  assert str(e) and "\n" not in str(e), str(e)
  assert "Traceback" not in str(e)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["chain", "fan", "random"]), seed=st.integers(0, 10**6),
       data=st.data(), steps=st.integers(1, 4), entry=st.one_of(st.none(), names, junk))
def test_mutated_dags_fail_only_with_our_error(kind, seed, data, steps, entry):
  nodes = base_dag(kind, seed)
  for _ in range(steps):
    nodes = mutate(nodes, data.draw)
  use_entry = data.draw(st.booleans())
  try:
    dag = build_dag(nodes, FUNCTIONS, entry=entry if use_entry else None)
    make_plan(dag, FUNCTIONS, Topology(2, 4), rollout_tensor_parallel=data.draw(
        st.sampled_from([1, 2, 4])))
  except OURS as e:
    check_one_line(e)


hashable = st.one_of(st.none(), st.integers(), st.text(max_size=5), st.tuples(st.integers()))
placements = st.dictionaries(
    st.one_of(st.sampled_from(["actor", "critic", "reference", "reward"]), hashable),
    st.one_of(junk, st.dictionaries(hashable, junk, max_size=2), st.fixed_dictionaries(
        {}, optional={"devices": st.one_of(junk, st.sampled_from(["all", "0:4", "4:8", "2:",
                                                                 ":3", "5:2", "a:b"])),
                      "mesh": st.one_of(junk, st.dictionaries(
                          st.sampled_from(["data", "fsdp", "tensor", "pipe"]),
                          st.one_of(st.integers(-2, 9), junk), max_size=3))})),
    max_size=3)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), placement=placements,
       tp=st.one_of(st.integers(-1, 9), junk))
def test_bad_placements_fail_only_with_our_error(seed, placement, tp):
  dag = build_dag(random_workflow(random.Random(seed), 2, max_deps=2), FUNCTIONS)
  try:
    make_plan(dag, FUNCTIONS, Topology(2, 4), placement=placement, rollout_tensor_parallel=tp)
  except OURS as e:
    check_one_line(e)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10**6), coef=junk, in_reward=junk, over=junk)
def test_kl_check_fails_only_with_our_error(seed, coef, in_reward, over):
  nodes = random_workflow(random.Random(seed), 2, max_deps=2)
  nodes[-1 if nodes[-1]["fn"] == "train.actor" else -2]["config"] = {"kl": over}
  plan = make_plan(build_dag(nodes, FUNCTIONS), FUNCTIONS, Topology(1, 8))
  try:
    check_kl_reference(plan.steps, FUNCTIONS, coef, in_reward)
  except OURS as e:
    check_one_line(e)


CONFIGS = {name: loading.load(name, []) for name in ("grpo:tiny", "ppo:tiny")}
override = st.one_of(junk, st.dictionaries(
    st.sampled_from(["kl", "weight", "gamma", "lam", "lr", "mini_batches", "x"]),
    st.one_of(junk, st.dictionaries(st.sampled_from(["coef", "in_reward", "target", "y"]),
                                    junk, max_size=2)), max_size=2))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(CONFIGS)), data=st.data(), steps=st.integers(0, 3))
def test_mutated_config_dags_fail_only_with_our_error_in_plan(name, data, steps):
  cfg = copy.deepcopy(CONFIGS[name])
  nodes = [dict(n) for n in cfg.dag]
  for _ in range(steps):
    nodes = mutate(nodes, data.draw)
  if not isinstance(nodes, list):
    return  # a config's dag field holds a list (ml_collections refuses anything else)
  if nodes and isinstance(nodes[-1], dict) and data.draw(st.booleans()):
    nodes[-1]["config"] = data.draw(override)
  with cfg.unlocked():
    cfg.dag = nodes
    cfg.actor.kl.coef = data.draw(st.sampled_from([0.0, 0.1]))
    cfg.actor.kl.in_reward = data.draw(st.booleans())
  try:
    plan_from_config(cfg, Topology(1, 8), FUNCTIONS)
  except OURS as e:
    check_one_line(e)


def test_what_the_fuzzing_found():
  good = chain(1)
  cases = [
      # Unknown keys of mixed types could not be sorted for the message.
      (lambda: build_dag([dict(good[0], **{"zz": 1}) | {1: 2}] + good[1:], FUNCTIONS),
       r"'gen': unknown key\(s\) \['zz', 1\]"),
      # A non-int tensor_parallel, placement or mesh reached int() / < / dict().
      (lambda: make_plan(build_dag(good, FUNCTIONS), FUNCTIONS, Topology(1, 8),
                         rollout_tensor_parallel="2"), r"tensor_parallel must be an int"),
      (lambda: make_plan(build_dag(good, FUNCTIONS), FUNCTIONS, Topology(1, 8),
                         placement={"actor": "0:4"}), r"placement.actor must be a dict"),
      (lambda: make_plan(build_dag(good, FUNCTIONS), FUNCTIONS, Topology(1, 8),
                         placement={"actor": {"devices": [0, "x"]}}), r"devices \[0, 'x'\]"),
      (lambda: make_plan(build_dag(good, FUNCTIONS), FUNCTIONS, Topology(1, 8),
                         placement={"actor": {"mesh": {"fsdp": True}}}), r"mesh.fsdp = True"),
      # An id with a line break stays on one line in the cycle message.
      (lambda: build_dag([dict(id="a\nb", fn="generate", deps=["t"]),
                          dict(id="t", fn="train.actor", deps=["a\nb"])], FUNCTIONS),
       r"cycle: 'a\\nb' -> t -> 'a\\nb'"),
  ]
  for run, pattern in cases:
    try:
      run()
    except OURS as e:
      check_one_line(e)
      assert re.search(pattern, str(e)), (pattern, str(e))
    else:
      raise AssertionError(f"not refused: {pattern}")
