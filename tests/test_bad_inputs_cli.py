"""Bad inputs of the config and the command line, through the real ``cli.main`` (issue 36).

A sibling of test_bad_inputs_corpus.py (same helpers, same rule): each row must end in
ONE line on stderr naming the culprit, exit code 2, and no traceback.
"""

from __future__ import annotations

import os

import pytest
from distflow_jax import cli
from test_bad_inputs_corpus import assert_one_line, config_file, run


# (config-file body, extra arguments, what the line must name): `plan` refuses each.
PLAN_CASES = {
    # A typo inside the file made a new key and the run went on with the default.
    "file_typo_leaf": ("c.actor.optimizer.learning_rate = 3e-4", [],
                       ["user_config.py", "'actor.optimizer.learning_rate'",
                        "did you mean 'actor.optimizer.lr'"]),
    "file_typo_plural": ("c.trainer.total_step = 3", [],
                         ["user_config.py", "'trainer.total_step'",
                          "did you mean 'trainer.total_steps'"]),
    "file_typo_section": ("c.rolout = dict(n=2)", [],
                          ["user_config.py", "'rolout'", "did you mean 'rollout'"]),
    "file_typo_nested": ("c.actor.kl.coeff = 0.1", [],
                         ["user_config.py", "'actor.kl.coeff'", "did you mean 'actor.kl.coef'"]),
    # Command-line typos: the dotted key, the flag, the nearest key; no raw escapes.
    "override_typo_leaf": ("", ["--config.actor.optimizer.lrr=1"],
                           ["unknown config key 'actor.optimizer.lrr' "
                            "(from --config.actor.optimizer.lrr); did you mean "
                            "'actor.optimizer.lr'?"]),
    "override_typo_section": ("", ["--config.actor.optimizr.lr=1"],
                              ["'actor.optimizr.lr'", "did you mean 'actor.optimizer.lr'?"]),
    # Empty or blank paths name the key.
    "run_dir_empty": ("", ["--config.run_dir="], ["run_dir is empty"]),
    "run_dir_blank": ("", ["--config.run_dir=  "], ["run_dir='  ' is blank"]),
    "model_path_blank": ("", ["--config.model.path= "], ["model.path=' ' is blank",
                                                         "built-in model.preset"]),
    # What get_config returned.
    "get_config_dict": ("c = c.to_dict()", [],
                        ["user_config.py: get_config() returned dict, expected an "
                         "ml_collections ConfigDict", "defaults.base()"]),
    "get_config_none": ("c = None", [], ["user_config.py: get_config() returned None"]),
    "get_config_none_with_override": ("c = None", ["--config.seed=3"],
                                      ["get_config() returned None"]),
    # The same flag twice with different values.
    "process_twice": ("", ["--process=0", "--process=1"],
                      ["--process is given twice", "--process=0", "--process=1"]),
    "memory_contradiction": ("", ["--memory", "--nomemory"], ["--memory is given twice"]),
    "config_twice": ("", ["--config=grpo:tiny"], ["--config is given twice"]),
    # Refusals train makes from the config alone: plan makes them too.
    "unknown_backend": ("", ["--config.rollout.backend=vllm"],
                        ["rollout.backend='vllm'", "engine"]),
    "unknown_preset": ("", ["--config.model.preset=huge"], ["model.preset='huge'", "tiny"]),
    "unknown_builtin_task": ("", ["--config.data.train=builtin:arithmetc"],
                             ["data.train='builtin:arithmetc'", "arithmetic"]),
    "unknown_builtin_level": ("", ["--config.data.eval=builtin:arithmetic:hardest"],
                              ["data.eval='builtin:arithmetic:hardest'", "hardest"]),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(PLAN_CASES))
def test_plan_refuses_in_one_line(tmp_path, capsys, case):
  body, extra, needles = PLAN_CASES[case]
  code, err = run(capsys, "plan", f"--config={config_file(tmp_path, body)}", *extra)
  assert code == 2, err
  assert_one_line(err, "distflow-jax plan: error:", *needles)
  assert "\\n" not in err and "\\'" not in err, err  # no raw escapes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv, needles", [
    (["train", "--resume", "--noresume"], ["--resume is given twice", "--noresume"]),
    (["train", "--noresume", "--resume=true"], ["--resume is given twice"]),
    (["eval", "--k=2", "--k", "3", "--model=m", "--data=d"], ["--k is given twice"]),
    (["config", "--diff", "--nodiff"], ["--diff is given twice"]),
])
def test_contradictory_flags_are_refused_naming_the_flag(tmp_path, capsys, argv, needles):
  code, err = run(capsys, *argv, f"--config.run_dir={tmp_path}/run")
  assert code == 2, err
  assert_one_line(err, f"distflow-jax {argv[0]}: error:", *needles)


@pytest.mark.timeout(120)
def test_the_same_flag_twice_with_the_same_value_is_fine(capsys):
  code = cli.main(["config", "--config=grpo:tiny", "--diff", "--diff=true"])
  assert code == 0, capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_blank_run_dir_is_refused_by_train_before_any_work(capsys):
  code, err = run(capsys, "train", "--config.run_dir=")
  assert code == 2, err
  assert_one_line(err, "distflow-jax train: error:", "run_dir is empty")
  assert "No such file" not in err


SHIPPED = {  # every shipped config file and its variants (the test below checks the files)
    "grpo": ("tiny", "qwen0.5b", "llama1b"),
    "grpo_vl": ("tiny", "qwen2.5-vl-3b"),
    "ppo": ("tiny", "qwen0.5b"),
    "reinforce_pp_two_rewards": ("tiny",),
    "algorithms": ("ppo", "grpo", "drgrpo", "rloo", "reinforce_pp_baseline", "dapo", "gspo"),
}


@pytest.mark.timeout(120)
def test_every_shipped_config_and_variant_loads_under_the_schema():
  from distflow_jax.config import loading
  shipped = {f[:-3] for f in os.listdir(loading.configs_dir())
             if f.endswith(".py") and not f.startswith("_")}
  assert shipped == set(SHIPPED), "a config file was added or removed: list its variants"
  for name, variants in SHIPPED.items():
    for variant in variants:
      assert loading.load(f"{name}:{variant}").run_dir, (name, variant)


def _run_dir_with_a_checkpoint(tmp_path, step: int = 3) -> str:
  """A run dir whose checkpoint ``step`` committed, its meta recording grpo:tiny's config
  (seed 0): what preflight reads, without orbax."""
  import json
  from distflow_jax.config import loading
  from distflow_jax.observe import run_config
  run_dir = str(tmp_path / "run")
  cfg = loading.load("grpo:tiny", [f"run_dir={run_dir}"])
  meta = tmp_path / "run" / "checkpoints" / str(step) / "meta"
  meta.mkdir(parents=True)
  import dataclasses
  from distflow_jax.models.tokenizer import Tokenizer
  from distflow_jax.state import roles
  model = dataclasses.asdict(roles.model_config(cfg, Tokenizer.builtin()))
  (meta / "metadata").write_text(json.dumps({"step": step, "seed": cfg.seed,
                                             "config": run_config.as_plain(cfg),
                                             "model_config": model}, default=str))
  return run_dir


@pytest.fixture
def no_expensive_work(monkeypatch):
  """Fails the test if train builds its roles, loads a model or warm-starts."""
  from distflow_jax.run import trainer
  from distflow_jax.warmstart import text

  def must_not_run(*args, **kwargs):
    raise AssertionError("expensive work started before the refusal")
  monkeypatch.setattr(trainer, "setup", must_not_run)
  monkeypatch.setattr(text, "ensure_model", must_not_run)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra, checkpoint, needles", [
    # The seed cannot change on a resume, --allow_config_change or not.
    (["--config.seed=1", "--allow_config_change"], True, ["seed 0 -> 1", "must keep its seed"]),
    (["--config.seed=1"], True, ["seed 0 -> 1", "must keep its seed"]),
    (["--resume"], False, ["--resume: there is no complete checkpoint"]),
    # Another model shape cannot restore, --allow_config_change or not: said before the
    # warm start (it was said by the restore, after it).
    (["--config.model.preset=micro", "--allow_config_change"], True,
     ["other parameter shapes than checkpoint step 3's", "hidden_size 192 -> 64"]),
    (["--config.model.lora.enabled=True", "--allow_config_change"], True,
     ["other parameter shapes", "lora None -> "]),
    (["--noresume"], True, ["holds checkpoints of steps [3]", "--resume"]),
])
def test_resume_refusals_come_before_the_warm_start(tmp_path, capsys, no_expensive_work, extra,
                                                    checkpoint, needles):
  run_dir = (_run_dir_with_a_checkpoint(tmp_path) if checkpoint else str(tmp_path / "run"))
  code, err = run(capsys, "train", "--config=grpo:tiny", f"--config.run_dir={run_dir}", *extra)
  assert code == 2, err
  assert_one_line(err, "distflow-jax train: error:", *needles)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lora, needles", [
    ("--config.model.lora.rank=100000", ["model.lora.rank=100000 is larger than q_proj's"]),
    ("--config.model.lora.targets=('nonexistent_proj',)",
     ["pattern 'nonexistent_proj' matches no module", "targetable:"]),
])
@pytest.mark.parametrize("command", ["plan", "train"])
def test_lora_that_does_not_fit_the_model_is_refused_by_plan_and_before_train_s_warm_start(
    tmp_path, capsys, no_expensive_work, command, lora, needles):
  """plan accepted what train refused (after its warm start); both refuse it now, from the
  model's config alone."""
  code, err = run(capsys, command, "--config=grpo:tiny", f"--config.run_dir={tmp_path}/run",
                  "--config.model.lora.enabled=True", lora)
  assert code == 2, err
  assert_one_line(err, f"distflow-jax {command}: error:", *needles)
