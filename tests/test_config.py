"""Config loading with overrides, and the checks that run before compiling."""

import pytest

from distflow_jax.config import loading
from distflow_jax.config.checks import check_runtime_topology, plan_from_config
from distflow_jax.dag import FUNCTIONS, DagError, Topology


def test_override_applies_and_config_is_locked():
  cfg = loading.load("configs/grpo.py:tiny", ["actor.optimizer.lr=1e-5"])
  assert cfg.actor.optimizer.lr == 1e-5
  assert cfg.name == "grpo-tiny"
  with pytest.raises(AttributeError):
    cfg.actor.new_key = 1  # locked


def test_builtin_name_resolves():
  assert loading.load("ppo:tiny").name == "ppo-tiny"


@pytest.mark.parametrize("override, pattern", [
    ("actor.optimizr.lr=1e-5", r"unknown config key 'actor.optimizr.lr' "
     r"\(from --config.actor.optimizr.lr\); did you mean 'actor.optimizer.lr'\?"),
    ("actor.optimizer.lr=abc", r"lr=abc: could not convert"),
    ("nosuchsection=1", r"nosuchsection"),
])
def test_bad_override_is_refused(override, pattern):
  with pytest.raises(loading.ConfigError, match=pattern):
    loading.load("grpo:tiny", [override])


def test_missing_config_file_lists_builtins():
  with pytest.raises(loading.ConfigError, match=r"not found; built-in configs: .*grpo"):
    loading.load("configs/nope.py")


def test_configs_path_names_the_shipped_file_outside_the_checkout(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # no configs/ here: the README's path form still works
  assert loading.load("configs/grpo.py:tiny").name == "grpo-tiny"
  assert loading.resolve_config_path("configs/ppo.py:tiny") == (
      f"{loading.configs_dir()}/ppo.py:tiny")
  with pytest.raises(loading.ConfigError, match=r"'configs/nope.py' not found"):
    loading.load("configs/nope.py")


def test_a_user_file_wins_over_the_shipped_one(tmp_path, monkeypatch):
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "grpo.py").write_text(
      "from distflow_jax.config import defaults\n\n"
      "def get_config(arg='x'):\n  c = defaults.base()\n  c.name = 'mine-' + arg\n  return c\n")
  monkeypatch.chdir(tmp_path)
  assert loading.load("configs/grpo.py:tiny").name == "mine-tiny"
  assert loading.load("grpo:tiny").name == "grpo-tiny"  # a bare name is always shipped


def test_configs_dir_is_the_packaged_one_in_an_install(tmp_path, monkeypatch):
  # A wheel puts configs/ under the package; a checkout keeps it beside the package.
  pkg = tmp_path / "site-packages" / "distflow_jax"
  (pkg / "config").mkdir(parents=True)
  monkeypatch.setattr(loading, "__file__", str(pkg / "config" / "loading.py"))
  assert loading.configs_dir() == str(tmp_path / "site-packages" / "configs")
  (pkg / "configs").mkdir()
  assert loading.configs_dir() == str(pkg / "configs")


def test_unknown_variant():
  with pytest.raises(loading.ConfigError, match=r"unknown variant 'huge'"):
    loading.load("grpo:huge")


def plan(overrides, topo=Topology(1, 8), name="grpo:tiny"):
  return plan_from_config(loading.load(name, overrides), topo, FUNCTIONS)


@pytest.mark.parametrize("overrides, pattern", [
    (["placement.actor.mesh.fsdp=3"], r"placement.actor.mesh .* 3 devices but the role has 8"),
    (["placement.actor.mesh.tensor=3"], r"8 devices do not divide by 3"),
    (["placement.actor.devices=6:12"], r"placement.actor: devices '6:12'"),
    (["data.prompts_per_step=6"], r"prompts_per_step=6 does not divide over the 8 rollout"),
    (["rollout.tensor_parallel=3"], r"tensor_parallel=3 does not fit the actor devices "
                                    r"\(process 0: 8\)"),
    (["actor.micro_batch_size=3"], r"micro_batch_size=3 does not divide the 16 samples"),
    (["rollout.n=1"], r"'advantage' .* needs prompt groups, but rollout.n=1"),
    (["rollout.max_new_tokens=250"], r"exceeds model.max_seq_len=80"),
    (["rollout.prefill_buckets=(64, 32)"], r"strictly increasing"),
    (["data.max_prompt_len=100"], r"largest bucket is smaller than data.max_prompt_len=100"),
    (["rollout.top_p=0.0"], r"top_p=0.0 must be in \(0, 1\]"),
    (["actor.loss_agg=mean"], r"actor.loss_agg='mean' is not valid"),
    (["actor.kl.estimator=k4"], r"actor.kl.estimator='k4' is not valid"),
    (["data.on_bad_row=ignore"], r"on_bad_row='ignore'"),
    (["actor.dual_clip=0.5"], r"dual_clip=0.5 must be 0"),
])
def test_config_checks_name_the_key(overrides, pattern):
  with pytest.raises((loading.ConfigError, DagError), match=pattern):
    plan(overrides)


def test_node_override_must_name_a_real_key():
  cfg = loading.load("reinforce_pp_two_rewards")
  with cfg.unlocked():
    cfg.dag[2]["config"] = {"wieght": 0.2}
  with pytest.raises(DagError, match=r"'reward_format': config override 'wieght'.*weight"):
    plan_from_config(cfg, Topology(1, 8), FUNCTIONS)
  with cfg.unlocked():
    cfg.dag[2]["config"] = {"weight": "heavy"}
  with pytest.raises(DagError, match=r"'heavy' has the wrong type"):
    plan_from_config(cfg, Topology(1, 8), FUNCTIONS)


def test_runtime_topology_mismatch():
  cfg = loading.load("grpo:tiny", ["cluster.devices_per_process=8"])
  check_runtime_topology(cfg, 1, 8)
  with pytest.raises(loading.ConfigError, match=r"cluster.devices_per_process=8 but this run"):
    check_runtime_topology(cfg, 1, 4)


def test_plugin_import_failure_is_named():
  cfg = loading.load("grpo:tiny", ["plugins=('no_such_plugin_mod',)"])
  with pytest.raises(loading.ConfigError, match=r"cannot import 'no_such_plugin_mod'"):
    plan_from_config(cfg, Topology(1, 8), FUNCTIONS)


def test_a_repeated_override_takes_its_last_value_also_for_tuples():
  # absl appended a repeated tuple override to the first: (40, 16, 40).
  cfg = loading.load("grpo:tiny", ["rollout.prefill_buckets=(40,)", "rollout.prefill_buckets=(16,40)",
                           "actor.optimizer.lr=0.5", "actor.optimizer.lr=0.25"])
  assert tuple(cfg.rollout.prefill_buckets) == (16, 40)
  assert cfg.actor.optimizer.lr == 0.25
