"""The declared config (config/sections.py, run_sections.py): every key has a type, a default
and a one-line doc (`config --keys`); each declared check refuses a bad value through
``check_values``; the typed view of a loaded config is frozen and typed; a config file
that drops a key is refused at load."""

import dataclasses
import typing

import ml_collections
import pytest

from distflow_jax.config import (declare, defaults, loading, response, schema, values,
                                 vision_checks)
from distflow_jax.config.run_sections import Config
from distflow_jax.config.validators import (Dataset, Flag, Float32, Folder, Increasing, InRange,
                                            LearningRate, OffOrAbove, Option, Positive, Whole)

pytestmark = pytest.mark.timeout(120)

SHIPPED = ("grpo:tiny", "grpo:calc", "grpo:tiny_env", "grpo:tiny_lora", "grpo:smollm2_lora",
           "ppo:tiny", "algorithms:dapo", "algorithms:gspo", "grpo_vl:tiny",
           "reinforce_pp_two_rewards")


def _leaves():
  return [e for e in declare.entries(Config()) if not e.is_section]


def test_every_schema_key_is_declared_with_a_one_line_doc():
  declared = {e.key: e for e in declare.entries(Config())}
  assert set(declared) == set(schema.keys(defaults.base()))
  for e in declared.values():
    assert e.info.doc.strip() and "\n" not in e.info.doc, e.key
  core = [e for e in _leaves() if e.info.core]
  assert 30 <= len(core) <= 50, len(core)


def test_config_keys_lists_every_key_core_first(capsys):
  from distflow_jax.commands import config as config_cmd
  assert config_cmd.run(["--keys"]) == 0
  lines = capsys.readouterr().out.splitlines()[1:]
  listed = [line[2:].split(" (", 1)[0] for line in lines]
  assert sorted(listed) == sorted(e.key for e in _leaves())
  marks = [line[0] for line in lines]
  assert marks == sorted(marks, key=lambda m: m != "*")  # the core keys first
  assert any(line.startswith("* rollout.n (int) = 4  [> 0]  samples per prompt") for line in lines)


def _bad_value(check, value):
  """A value of ``value``'s type that ``check`` refuses (None: the config's type lock already
  refuses every wrong value: a non-bool flag, a non-string folder)."""
  if isinstance(check, (Flag, Folder)):
    return None
  bad = {Option: "no-such-option", Dataset: "builtin:no_such_task", Increasing: (64, 32),
         Float32: 1e39, OffOrAbove: 0.5, LearningRate: 2.0}.get(type(check))
  if bad is not None:
    return bad
  if isinstance(check, (Positive, Whole)):
    bad = -1 if check.allow_zero else 0
  elif isinstance(check, InRange):
    bad = (check.lo - 1 if check.lo is not None else check.hi + 1 if check.hi is not None
           else float("inf"))
    if check.lo is not None and check.lo_open:
      bad = check.lo
  return type(value)(bad)


def test_each_declared_check_refuses_through_check_values():
  checked = [e for e in _leaves() if e.info.check is not None]
  assert len(checked) > 70
  for e in checked:
    cfg = defaults.base()
    *parents, leaf = e.key.split(".")
    node = cfg
    for p in parents:
      node = node[p]
    bad = _bad_value(e.info.check, node[leaf])
    if bad is None:
      continue
    node[leaf] = bad
    with pytest.raises(loading.ConfigError, match=rf"^{e.key}="):
      values.check_values(cfg)


def test_the_type_checks_refuse_what_a_type_lock_would_let_through():
  for check, bad in ((Flag(), 1), (Folder("x"), 3), (Whole(), True), (Whole(True), 2.5)):
    with pytest.raises(loading.ConfigError, match=r"^k="):
      check(bad, "k")
    assert str(check)


def test_spanning_rules_refuse_with_their_line():
  cases = {("rollout.prefill_buckets", "data.max_prompt_len"): {"rollout.prefill_buckets": (16,)},
           ("model.pack_sequences", "trainer.deterministic"): {
               "model.pack_sequences": True, "trainer.deterministic": True},
           ("critic.warmup_steps", "trainer.total_steps"): {"critic.warmup_steps": 30},
           ("sft.warmup_steps", "sft.steps"): {"sft.warmup_steps": 300}}
  rows = {r.keys: r for r in values.SPANNING}
  for keys, change in cases.items():
    cfg = loading.with_values(defaults.base(), change)
    assert rows[keys].refuses(cfg)
    with pytest.raises(loading.ConfigError, match=rf"^{keys[0]}"):
      values.check_values(cfg)
  assert not any(r.refuses(defaults.base()) for r in values.SPANNING)


def test_the_typed_view_is_frozen_and_holds_the_declared_types():
  for spec in SHIPPED:
    cfg = loading.load(spec, ["rollout.n=6"])
    view = declare.view(Config, cfg)
    assert view.rollout.n == 6 and view.name == cfg.name
    assert view.actor.optimizer.lr == cfg.actor.optimizer.lr
    with pytest.raises(dataclasses.FrozenInstanceError):
      view.rollout.n = 2
    _check_types(view, spec)
    # The derived quantities: properties of the view, computed as the load-time checks do.
    assert view.rollout.response_width == response.response_width(cfg.rollout)
    assert (view.row_tokens, view.longest_sample) == (response.row_tokens(cfg),
                                                      response.longest_sample(cfg))
    assert view.image_key == vision_checks.run_image_key(cfg)
    assert view.to_dict() == cfg.to_dict() and view["rollout"] is view.rollout


def _check_types(obj, where: str) -> None:
  hints = typing.get_type_hints(type(obj))
  for f in dataclasses.fields(obj):
    value, hint = getattr(obj, f.name), hints[f.name]
    if dataclasses.is_dataclass(hint):
      _check_types(value, where)
    else:
      assert isinstance(value, hint) and not (hint is int and isinstance(value, bool)), (
          where, f.name, value, hint)


def test_a_config_file_that_drops_a_key_is_refused(tmp_path):
  path = tmp_path / "partial.py"
  path.write_text(
      "from distflow_jax.config import defaults\n\n"
      "def get_config():\n"
      "  c = defaults.base().to_dict()\n"
      "  del c['rollout']['env']\n"
      "  import ml_collections\n"
      "  return ml_collections.ConfigDict(c)\n")
  with pytest.raises(loading.ConfigError, match=r"lacks key 'rollout.env'; start get_config\(\) "
                     r"from distflow_jax.config.defaults.base\(\)"):
    loading.load(str(path))


def test_optimizer_and_base_come_from_the_declarations():
  assert defaults.optimizer(3e-4).lr == 3e-4
  assert set(defaults.optimizer(3e-4).keys()) == {f.name for f in dataclasses.fields(
      Config().actor.optimizer)}
  assert isinstance(defaults.base(), ml_collections.ConfigDict)


def _config_writes(path) -> list[str]:
  """Assignments into a config (``cfg.x = ``, ``ctx.cfg.x[k] = ``) and ``unlocked()`` calls
  in one source file."""
  import ast
  tree = ast.parse(path.read_text())
  out = []

  def into_config(target) -> bool:
    node, steps = target, 0
    while isinstance(node, (ast.Attribute, ast.Subscript)):
      if steps and isinstance(node, ast.Attribute) and node.attr == "cfg":
        return True
      node, steps = node.value, steps + 1
    return steps > 0 and isinstance(node, ast.Name) and node.id == "cfg"

  for n in ast.walk(tree):
    targets = (n.targets if isinstance(n, ast.Assign) else
               [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else [])
    out += [f"{path}:{n.lineno}: {ast.unparse(t)} =" for t in targets if into_config(t)]
    if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
        and n.func.attr in ("unlocked", "unlock")):
      out.append(f"{path}:{n.lineno}: {ast.unparse(n)}")
  return out


def test_nothing_changes_a_loaded_config():
  """A config is changed only by ``loading.with_values``, which returns a new one; the one
  exception builds a node's effective config from a copy (config/checks.py)."""
  import pathlib
  pkg = pathlib.Path(__file__).resolve().parents[1] / "distflow_jax"
  allowed = {"config/loading.py", "config/checks.py"}
  found = [w for p in sorted(pkg.rglob("*.py")) if str(p.relative_to(pkg)) not in allowed
           for w in _config_writes(p)]
  assert not found, "\n".join(found)


def test_with_values_returns_a_locked_copy():
  cfg = loading.load("grpo:tiny")
  new = loading.with_values(cfg, {"model.path": "/x", "cluster.num_processes": 0})
  assert new.model.path == "/x" and cfg.model.path == ""
  with pytest.raises(AttributeError):
    new.model.no_such_key = 1
  with pytest.raises(KeyError, match="not a config key"):
    loading.with_values(cfg, {"model.no_such_key": 1})


def test_a_placement_may_name_some_axes_only(tmp_path):
  """placement is PARTIAL: a role's mesh may leave axes out (they are 1, as the planner reads
  them); the typed view says so, and the file is not refused for the axes it left out."""
  from distflow_jax.config.run_sections import Mesh, MeshShape
  path = tmp_path / "placed.py"
  path.write_text(
      "from distflow_jax.config import defaults\n\n"
      "def get_config():\n"
      "  c = defaults.base()\n"
      "  c.placement.actor = dict(devices='all', mesh=dict(data=2))\n"
      "  return c\n")
  view = declare.view(Config, loading.load(str(path)))
  assert view.placement.actor == Mesh("all", MeshShape(data=2, fsdp=1, tensor=1))
  assert view.placement.critic == Mesh("all", MeshShape(data=1, fsdp=-1, tensor=1))
