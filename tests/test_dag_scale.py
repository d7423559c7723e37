"""Valid workflow DAGs of any size, for the DAG scale and property tests."""

import random

from distflow_jax.data.fields import SUMMED as SUMMED_FIELDS

REWARD_FNS = ("reward.math", "reward.format", "reward.model")
ADVANTAGE_FNS = ("advantage.grpo", "advantage.rloo", "advantage.reinforce_pp",
                 "advantage.reinforce_pp_baseline", "advantage.gae")


def chain(n: int) -> list[dict]:
  """generate -> n reward nodes in a line -> advantage -> train: n + 3 nodes."""
  nodes = [dict(id="gen", fn="generate")]
  prev = "gen"
  for i in range(n):
    nodes.append(dict(id=f"r{i}", fn="reward.math", deps=[prev]))
    prev = f"r{i}"
  nodes += [dict(id="adv", fn="advantage.grpo", deps=[prev]),
            dict(id="train", fn="train.actor", deps=["adv"])]
  return nodes


def fan(n: int) -> list[dict]:
  """generate -> n parallel reward nodes -> one advantage over all -> train."""
  nodes = [dict(id="gen", fn="generate")]
  nodes += [dict(id=f"r{i}", fn="reward.format", deps=["gen"]) for i in range(n)]
  nodes += [dict(id="adv", fn="advantage.reinforce_pp", deps=[f"r{i}" for i in range(n)]),
            dict(id="train", fn="train.actor", deps=["adv"])]
  return nodes


def random_workflow(rng: random.Random, n_rewards: int, max_deps: int = 3,
                    model_nodes: bool = True, reward_model: bool = True) -> list[dict]:
  """A random valid DAG: generate, ``n_rewards`` reward nodes each depending on 1..max_deps
  earlier nodes, optional logprob / ref_logprob / values+critic, an advantage, train."""
  nodes = [dict(id="gen", fn="generate")]
  pool = ["gen"]
  extras = []
  if model_nodes:
    extras = [fn for fn in ("logprob", "ref_logprob") if rng.random() < 0.6]
  adv_fn = rng.choice(ADVANTAGE_FNS)
  if adv_fn == "advantage.gae":
    extras.append("values")
  rng.shuffle(extras)
  fns = list(rng.choices(REWARD_FNS if reward_model else REWARD_FNS[:2],
                         k=max(n_rewards, 1)))
  for fn in extras:  # model passes anywhere among the rewards
    fns.insert(rng.randrange(len(fns) + 1), fn)
  for i, fn in enumerate(fns):
    nid = fn if fn in extras else f"r{i}"
    deps = rng.sample(pool, k=rng.randint(1, min(max_deps, len(pool))))
    nodes.append(dict(id=nid, fn=fn, deps=deps))
    pool.append(nid)
  adv_deps = [n["id"] for n in nodes if n["fn"] in REWARD_FNS][-1:] + (
      ["values"] if adv_fn == "advantage.gae" else [])
  nodes.append(dict(id="adv", fn=adv_fn, deps=adv_deps))
  used = {d for n in nodes for d in n.get("deps", ())}
  childless = [n["id"] for n in nodes if n["id"] not in used and n["id"] != "adv"]
  nodes.append(dict(id="train", fn="train.actor",
                    deps=["adv"] + [c for c in childless if c not in adv_deps]))
  if adv_fn == "advantage.gae":
    nodes.append(dict(id="train_critic", fn="train.critic", deps=["adv", "values"]))
  assert "rewards" in SUMMED_FIELDS
  return nodes


def declared(nodes: list[dict], order: str, seed: int = 0) -> list[dict]:
  if order == "forward":
    return list(nodes)
  if order == "reverse":
    return nodes[::-1]
  out = list(nodes)
  random.Random(seed).shuffle(out)
  return out


def is_topological(order: list[str], nodes: list[dict]) -> bool:
  pos = {nid: i for i, nid in enumerate(order)}
  return len(pos) == len(nodes) == len(order) and all(
      pos[d] < pos[n["id"]] for n in nodes for d in n.get("deps", ()))


# ---------------------------------------------------------------------------- the tests

import time  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from distflow_jax.config import loading  # noqa: E402
from distflow_jax.config.checks import plan_from_config  # noqa: E402
from distflow_jax.dag import FUNCTIONS, Topology, build_dag, make_plan, render  # noqa: E402
from distflow_jax.dag import planner as planner_lib  # noqa: E402
from distflow_jax.dag.registry import Placement  # noqa: E402
from distflow_jax.dag.spec import Role  # noqa: E402

BIG = 10_000
# CPU seconds of this process (time.process_time), not wall seconds: a planner that went
# quadratic in the nodes takes minutes of CPU; a busy machine only stretches the wall clock
# (5.97 s wall for 0.84 s of CPU was seen at load 10).
LIMIT_S = 5.0


def timed_plan(nodes, topo=Topology(1, 8), **kw):
  t0 = time.process_time()
  dag = build_dag(nodes, FUNCTIONS)
  plan = make_plan(dag, FUNCTIONS, topo, **kw)
  return plan, time.process_time() - t0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", ["forward", "reverse", "shuffled"])
@pytest.mark.parametrize("shape", ["chain", "fan", "random"])
def test_ten_thousand_nodes_plan_fast(shape, order):
  if shape == "chain":
    nodes = chain(BIG - 3)
  elif shape == "fan":
    nodes = fan(BIG - 3)
  else:
    nodes = random_workflow(random.Random(7), BIG - 8)
  nodes = declared(nodes, order, seed=3)
  assert len(nodes) >= BIG - 3
  plan, secs = timed_plan(nodes)
  print(f"{shape}/{order}: {len(nodes)} nodes planned in {secs:.2f} s")
  assert secs < LIMIT_S, f"{len(nodes)} nodes took {secs:.1f} CPU s"
  assert is_topological(plan.order, nodes)
  assert plan.order[0] == "gen" and plan.order[-1] in ("train", "train_critic")
  assert len(plan.edges) == sum(len(n.get("deps", ())) for n in nodes)
  assert plan.step(plan.order[-2]).index == len(nodes) - 2


@pytest.mark.timeout(120)
def test_long_chain_through_config_and_render():
  cfg = loading.load("grpo:tiny", ["actor.kl.coef=0.0"])  # the chain has no ref_logprob
  with cfg.unlocked():
    cfg.dag = declared(chain(BIG - 3), "reverse")
  t0 = time.process_time()
  plan = plan_from_config(cfg, Topology(1, 8), FUNCTIONS)
  text = render(plan)
  secs = time.process_time() - t0
  print(f"plan_from_config + render, {BIG} nodes: {secs:.2f} s")
  assert secs < LIMIT_S
  assert plan.order == [n["id"] for n in chain(BIG - 3)]
  assert text.count("\n") > BIG


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", ["forward", "reverse", "shuffled"])
def test_big_cycle_is_found_without_recursion(order):
  nodes = chain(BIG - 3)
  nodes[0] = dict(id="gen", fn="generate", deps=["r9000"])
  t0 = time.process_time()
  with pytest.raises(planner_lib.DagError, match=r"cycle of 9002 nodes: ") as e:
    build_dag(declared(nodes, order), FUNCTIONS)
  assert time.process_time() - t0 < LIMIT_S
  msg = str(e.value)
  assert len(msg) < 300 and "... (8991 more) ->" in msg
  # From the cycle's first declared node, in data-flow order, closed.
  first = {"forward": "gen", "reverse": "r9000"}.get(order)
  if first:
    assert msg.split(": ")[1].startswith(f"{first} -> ") and msg.endswith(f" -> {first}")
  if order == "forward":
    assert "cycle of 9002 nodes: gen -> r0 -> r1 -> r2 -> r3 -> r4 -> ..." in msg


# The planner's rule written the slow, obvious way (as it was before it had to scale):
# each step scans every ready node for (stays in layout, follows the last node, depth,
# declaration order).
def reference_order(dag, topo, placement=None, tp=1):
  used = sorted({n.role for n in dag.nodes if n.role is not None}
                | {Role.ACTOR}, key=lambda r: r.value)
  meshes = {r: planner_lib.role_mesh(r, (placement or {}).get(r.value.lower()), topo)
            for r in used}
  rollout = planner_lib.rollout_layout(meshes[Role.ACTOR], tp, topo)

  def layout_of(node, current, intact):
    spec = FUNCTIONS.spec(node.fn)
    if spec.placement is Placement.ROLLOUT:
      return rollout
    if spec.placement is Placement.ROLE_MESH:
      m = meshes[node.role]
      return planner_lib.NodeLayout("", planner_lib.LayoutKind.ROLE_MESH, m.devices, m.dp_size)
    return rollout if spec.needs_groups and not intact else current

  depth = {}
  while len(depth) < len(dag.nodes):
    for n in dag.nodes:
      if n.id not in depth and all(d in depth for d in n.deps):
        depth[n.id] = 1 + max((depth[d] for d in n.deps), default=-1)
  decl = {n.id: i for i, n in enumerate(dag.nodes)}
  order, current, intact = [], None, True
  while len(order) < len(dag.nodes):
    ready = [n for n in dag.nodes if n.id not in order and all(d in order for d in n.deps)]

    def key(n):
      lay = layout_of(n, current, intact)
      stays = current is not None and lay.same_data_layout(current)
      return (not stays, not (order and order[-1] in n.deps), depth[n.id], decl[n.id])

    node = min(ready, key=key)
    lay = layout_of(node, current, intact)
    moved = current is not None and not lay.same_data_layout(current)
    if FUNCTIONS.spec(node.fn).placement is Placement.ROLLOUT:
      intact = True
    elif moved:
      intact = lay.devices == rollout.devices and lay.dp_size == rollout.dp_size
    order.append(node.id)
    current = lay
  return order


SETUPS = [
    (Topology(1, 8), None, 1),
    (Topology(2, 4), None, 2),
    (Topology(2, 4), {"critic": {"devices": "4:8", "mesh": {"fsdp": 4}}}, 1),
    (Topology(2, 4), {"reference": {"devices": "0:4", "mesh": {"fsdp": 4}},
                      "reward": {"devices": "4:8", "mesh": {"fsdp": 2, "tensor": 2}}}, 4),
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(1, 14),
       setup=st.sampled_from(range(len(SETUPS))),
       order=st.sampled_from(["forward", "reverse", "shuffled"]))
def test_planner_keeps_its_ordering_rule(seed, size, setup, order):
  topo, placement, tp = SETUPS[setup]
  nodes = declared(random_workflow(random.Random(seed), size, max_deps=2), order, seed)
  dag = build_dag(nodes, FUNCTIONS)
  plan = make_plan(dag, FUNCTIONS, topo, placement=placement, rollout_tensor_parallel=tp)
  assert plan.order == reference_order(dag, topo, placement, tp)
