"""run/setup.py: the one run set-up of train, eval and generate; the model preset table."""

import pytest

from distflow_jax.config import loading
from distflow_jax.dag.spec import Role
from distflow_jax.models import config as model_configs
from distflow_jax.run.setup import prepare_run
from workflow_util import smoke_overrides


def test_preset_table_is_the_one_every_user_reads():
  assert model_configs.preset_names() == ["micro", "tiny", "tiny_moe"]
  tiny = model_configs.preset("tiny", 100, "bfloat16")
  assert tiny == model_configs.ModelConfig.tiny(vocab_size=100).replace(dtype="bfloat16")
  assert model_configs.preset("micro", 64).num_layers == 1
  assert model_configs.preset("tiny_moe", 64).moe.num_experts == 8
  with pytest.raises(ValueError, match=r"unknown model preset 'huge'; built-in: \['micro', "
                                       r"'tiny', 'tiny_moe'\]"):
    model_configs.preset("huge", 64)


def test_unknown_preset_lists_the_table(tmp_path):
  cfg = loading.load("grpo:tiny", smoke_overrides(tmp_path, "model.preset=huge"))
  with pytest.raises(loading.ConfigError, match=r"model.preset='huge' is not valid; choose one "
                                                r"of \['tiny', 'tiny_moe', 'micro'\]"):
    prepare_run(cfg, roles="actor", log=lambda m: None)


@pytest.mark.timeout(300)
def test_actor_only_and_all_roles(tmp_path):
  cfg = loading.load("grpo:tiny", smoke_overrides(tmp_path))
  seen = []
  run = prepare_run(cfg, roles="actor", check_inputs=lambda: seen.append(1) or "checked",
                    log=lambda m: None)
  assert list(run.ctx.roles) == [Role.ACTOR] and not run.ctx.roles[Role.ACTOR].trainable
  assert run.model_path == "" and run.inputs == "checked" and seen == [1]
  full = prepare_run(cfg, roles="all", log=lambda m: None)
  assert full.ctx.roles[Role.ACTOR].trainable and Role.REFERENCE in full.ctx.roles
  # The same seed, the same fresh weights, whichever set of roles was asked for.
  import jax
  import numpy as np
  for a, b in zip(jax.tree.leaves(run.ctx.roles[Role.ACTOR].params),
                  jax.tree.leaves(full.ctx.roles[Role.ACTOR].params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="roles='critic'"):
    prepare_run(cfg, roles="critic")


def test_inputs_are_checked_before_any_weights(tmp_path, monkeypatch):
  from distflow_jax.state import roles as roles_lib
  built = []
  monkeypatch.setattr(roles_lib, "build_actor", lambda *a, **k: built.append(a))
  cfg = loading.load("grpo:tiny", smoke_overrides(tmp_path))

  def bad_inputs():
    raise loading.ConfigError("data.train: bad")
  with pytest.raises(loading.ConfigError, match="data.train: bad"):
    prepare_run(cfg, roles="actor", check_inputs=bad_inputs, log=lambda m: None)
  assert built == []


def test_train_rejects_an_unknown_builtin_task_naming_the_valid_ones(tmp_path):
  from distflow_jax.run import trainer
  cfg = loading.load("grpo:tiny", smoke_overrides(tmp_path, "data.train=builtin:algebra"))
  with pytest.raises(loading.ConfigError, match=r"^data.train='builtin:algebra': unknown "
                                                r"built-in task 'algebra'; valid: "
                                                r"\['arithmetic', 'calc', 'letters', 'shapes'\]"):
    trainer.setup(cfg, log=lambda m: None)
  cfg = loading.load("grpo:tiny", smoke_overrides(tmp_path, "data.eval=builtin:arithmetic:x",
                                                  "trainer.eval_every=1"))
  with pytest.raises(loading.ConfigError, match=r"^data.eval=.*has no level 'x'"):
    trainer.setup(cfg, log=lambda m: None)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", [(), ("placement.actor.mesh.fsdp=2", "placement.actor.mesh.tensor=4")])
def test_reference_owns_its_buffers_whatever_the_actor_mesh(tmp_path, mesh):
  # The actor's train step donates its parameters: a reference leaf on the same buffers
  # (a replicated leaf under another mesh shape) died with it, and the next step's
  # reference pass crashed the process (a segfault at step 2 with an fsdp 2 x tensor 4
  # actor).
  from distflow_jax.state.roles import _shares_buffers
  cfg = loading.load("grpo:tiny", smoke_overrides(tmp_path, *mesh))
  roles = prepare_run(cfg, roles="all", log=lambda m: None).ctx.roles
  import jax
  actor, ref = (jax.tree.leaves(roles[r].params) for r in (Role.ACTOR, Role.REFERENCE))
  assert not any(_shares_buffers(r, a) for r, a in zip(ref, actor))
  assert _shares_buffers(actor[0], actor[0])  # the check itself can see a shared buffer


@pytest.mark.timeout(300)
def test_the_run_reads_the_typed_view_with_node_overrides(tmp_path):
  """The context holds the config's typed, frozen view (config/run_sections.Config), built
  once; a node's section is the view with the node's overrides (ints widen to floats as
  ml_collections widens them), and a derived config (with_values) is a new view."""
  import dataclasses

  from distflow_jax.config import response
  from distflow_jax.config.run_sections import Config
  from distflow_jax.config.sections import Actor
  dag = [dict(d) for d in loading.load("grpo:tiny").dag]
  for d in dag:
    if d["fn"] == "train.actor":
      d["config"] = {"kl": {"coef": 1}, "ppo_epochs": 2}
  cfg = loading.load("grpo:tiny", smoke_overrides(tmp_path))
  cfg = loading.with_values(cfg, {"dag": dag})
  ctx = prepare_run(cfg, roles="actor", log=lambda m: None).ctx
  assert isinstance(ctx.cfg, Config) and ctx.cfg.rollout.n == cfg.rollout.n
  with pytest.raises(dataclasses.FrozenInstanceError):
    ctx.cfg.rollout.n = 1
  assert ctx.cfg.rollout.response_width == response.response_width(cfg.rollout)
  assert ctx.cfg.row_tokens == response.row_tokens(cfg) and ctx.cfg.image_key == ""
  node = next(s.node for s in ctx.plan.steps if s.node.fn == "train.actor")
  actor = ctx.section(node, "actor")
  assert isinstance(actor, Actor) and actor.ppo_epochs == 2
  assert actor.kl.coef == 1.0 and isinstance(actor.kl.coef, float)
  assert ctx.cfg.actor.kl.coef == cfg.actor.kl.coef and ctx.section(node, "actor") is actor
  gen = next(s.node for s in ctx.plan.steps if s.node.fn == "generate")
  assert ctx.section(gen, "rollout") is ctx.cfg.rollout
  moved = loading.with_values(ctx.cfg, {"rollout.n": 2, "run_dir": "elsewhere"})
  assert (moved.rollout.n, moved.run_dir, ctx.cfg.rollout.n) == (2, "elsewhere", cfg.rollout.n)
  with pytest.raises(KeyError):
    loading.with_values(ctx.cfg, {"rollout.no_such_key": 1})
  assert ctx.replicas.devices() == list(ctx.roles[Role.ACTOR].mesh.devices.flat)
  with pytest.raises(AttributeError, match=r"ctx.replicas.backend\(rollout\)"):
    ctx.backend(ctx.cfg.rollout)
