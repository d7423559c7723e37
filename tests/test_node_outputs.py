"""A node returns what it made: no node writes into the run's context or a role's state.

``nodes.common.NodeOut`` carries a node's batch, its metrics and a trained role's new state;
``run/executor.py`` applies them.  The first tests read the node modules' code (and fail on
planted writes); the others run a step through a plugin node that returns its own metrics,
and check the executor refuses a result that is neither a batch nor a ``NodeOut``.
"""

import ast
import dataclasses
import json
import pathlib

import jax
import numpy as np
import pytest

from distflow_jax.config import loading
from distflow_jax.dag import FUNCTIONS
from distflow_jax.dag.spec import DagError, Node, NodeType, Role
from distflow_jax.data.batch import SAMPLE_ID
from distflow_jax.nodes.common import NodeOut, node_out
from distflow_jax.nodes.rewards import rule_reward_node
from distflow_jax.run import trainer
from distflow_jax.state.metrics import Metrics
from workflow_util import smoke_overrides

NODES_DIR = pathlib.Path(__file__).resolve().parents[1] / "distflow_jax" / "nodes"
# A role's train state: written by the executor alone.
STATE_FIELDS = {"params", "opt_state"}


def _root(expr: ast.expr) -> ast.expr:
  while isinstance(expr, (ast.Attribute, ast.Subscript)):
    expr = expr.value
  return expr


def writes(source: str, filename: str = "<source>") -> list[str]:
  """Each write of a node module into the context or a role's state, as 'file:line: what'."""
  found = []
  for n in ast.walk(ast.parse(source)):
    targets = []
    if isinstance(n, ast.Assign):
      targets = n.targets
    elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
      targets = [n.target]
    flat = []
    for t in targets:
      flat.extend(t.elts if isinstance(t, ast.Tuple) else [t])
    for t in flat:
      if not isinstance(t, (ast.Attribute, ast.Subscript)):
        continue
      root = _root(t)
      if isinstance(root, ast.Name) and root.id == "ctx":
        found.append(f"{filename}:{n.lineno}: assigns into ctx ({ast.unparse(t)})")
      elif isinstance(t, ast.Attribute) and t.attr in STATE_FIELDS:
        found.append(f"{filename}:{n.lineno}: assigns a role's {t.attr} ({ast.unparse(t)})")
    if (isinstance(n, ast.Attribute) and n.attr == "metrics"
        and isinstance(n.value, ast.Name) and n.value.id == "ctx"):
      found.append(f"{filename}:{n.lineno}: reads ctx.metrics (return the node's metrics)")
  return found


def test_no_node_module_writes_into_the_context_or_a_role_state():
  found = []
  for path in sorted(NODES_DIR.glob("*.py")):
    found += writes(path.read_text(), path.name)
  assert found == []


def test_the_reader_finds_planted_writes():
  planted = (
      "def f(ctx, node, lay, batch):\n"
      "  ctx.metrics.add('x', 1.0)\n"
      "  state = ctx.roles[role]\n"
      "  state.params, state.opt_state, stats = step(state.params, state.opt_state)\n"
      "  ctx.roles[role] = state\n"
      "  ctx.step += 1\n"
      "  return batch\n")
  found = writes(planted)
  assert len(found) == 5, found
  assert any("ctx.metrics" in f for f in found)
  assert any("state.params" in f for f in found) and any("state.opt_state" in f for f in found)
  assert any("ctx.roles[role]" in f for f in found) and any("ctx.step" in f for f in found)


def test_the_context_has_no_metrics_and_says_where_they_went():
  from distflow_jax.state.context import RunContext
  with pytest.raises(AttributeError, match="a node function returns them"):
    RunContext.metrics.fget(None)


def test_a_result_that_is_neither_batch_nor_node_out_is_one_line_naming_the_node():
  node = Node(id="score", fn="reward.mine", type=NodeType.COMPUTE, role=None)
  with pytest.raises(DagError, match=r"DAG node 'score': its function 'reward.mine' returned "
                                     r"dict; a node function returns the batch or"):
    node_out(node, {"rewards": 1})


PLUGIN = "reward.test_own_metrics"


def _own_metrics(ctx, node, lay, batch):
  """reward.math plus 1 for odd sample ids (so a group's advantages are not all 0), and a
  metric of the node's own: the step's rows."""
  out = rule_reward_node("math")(ctx, node, lay, batch)
  mine = Metrics()
  mine.add("mine/rows", float(jax.device_get(out.batch.data["rewards"]).shape[0]))
  mine.merge(out.metrics)
  rewards = out.batch.data["rewards"] + (out.batch.data[SAMPLE_ID] % 2).astype(np.float32)
  return NodeOut(out.batch.replace(rewards=rewards), mine)


@pytest.mark.timeout(600)
def test_a_step_returns_its_metrics_and_the_actor_state_the_node_made(tmp_path):
  FUNCTIONS.register(dataclasses.replace(FUNCTIONS.spec("reward.math"), name=PLUGIN),
                     _own_metrics)
  try:
    cfg = loading.load("grpo:tiny", smoke_overrides(tmp_path, "trainer.total_steps=1"))
    with cfg.unlocked():
      cfg.dag = [dict(d, fn=PLUGIN) if d["fn"] == "reward.math" else dict(d) for d in cfg.dag]
    ctx, loaders = trainer.setup(cfg, log=lambda m: None)
    actor = ctx.roles[Role.ACTOR]
    before = [np.asarray(x) for x in jax.tree.leaves(actor.params)]
    metrics = list(trainer.train(ctx, loaders))
  finally:
    FUNCTIONS.unregister(PLUGIN)
  assert [m["step"] for m in metrics] == [1]
  # the plugin's own metric and the built-in reward's, through the executor's merge
  assert metrics[0]["mine/rows"] == cfg.data.prompts_per_step * cfg.rollout.n
  assert "reward/reward" in metrics[0] and "accuracy" in metrics[0]
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert any("mine/rows" in r for r in rows)
  # train.actor returned the actor's new state; the executor put it in the same ModelState
  assert ctx.roles[Role.ACTOR] is actor
  after = [np.asarray(x) for x in jax.tree.leaves(actor.params)]
  assert any(not np.array_equal(a, b) for a, b in zip(before, after))
  assert all(not x.is_deleted() for x in jax.tree.leaves(actor.params))
