"""Silent cases of the trust issue (round three), each refused in one line or made right:
LoRA keys set while LoRA is off, `plan` without --config, `config` printing what `plan` and
`train` refuse, the README's example environment scoring "#### 56" right for 5."""

import re

import pytest

from distflow_jax import cli

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("flag", ["--config.model.lora.rank=8", "--config.model.lora.alpha=4.0",
                                  "--config.model.lora.targets=('q_proj',)"])
def test_a_lora_key_while_lora_is_off_is_refused(flag, capsys):
  assert cli.main(["plan", flag]) == 2
  err = capsys.readouterr().err.strip()
  key = flag.split("=", 1)[0][len("--config."):]
  assert len(err.splitlines()) == 1 and f"{key} is set but model.lora.enabled=False" in err
  assert cli.main(["plan", flag, "--config.model.lora.enabled=True"]) == 0, \
      capsys.readouterr().err


def test_a_config_file_setting_lora_without_enabling_it_is_refused(tmp_path, capsys):
  path = tmp_path / "c.py"
  path.write_text("from distflow_jax.config import loading\n\ndef get_config():\n"
                  "  c = loading.load('grpo:tiny')\n  c.model.lora.rank = 4\n  return c\n")
  assert cli.main(["plan", f"--config={path}"]) == 2
  assert "model.lora.rank is set but model.lora.enabled=False" in capsys.readouterr().err
  assert cli.main(["plan", "--config=grpo:tiny_lora"]) == 0  # enabled: as before


def test_plan_without_config_plans_the_default_as_train_runs_it(capsys):
  assert cli.main(["plan", "--config.rollout.n=4", "--num_processes=1",
                   "--devices_per_process=1"]) == 0, capsys.readouterr().err
  assert "config: grpo-tiny" in capsys.readouterr().out


def test_config_refuses_what_plan_and_train_refuse(capsys):
  assert cli.main(["config", "--config.trainer.total_steps=-1"]) == 2
  assert "trainer.total_steps=-1 must be > 0" in capsys.readouterr().err
  assert cli.main(["config", "--config=grpo:smollm2"]) == 0


def test_readme_example_environment_scores_the_answer_exactly(monkeypatch):
  from distflow_jax.envs import base  # pylint: disable=import-outside-toplevel
  text = open(__file__.replace("tests/test_trust_round3.py", "docs/multi_turn.md")).read()
  section = text.split("# Multi-turn episodes (`rollout.env`)", 1)[1]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  made = {}
  monkeypatch.setattr(base, "register_env", lambda name, cls: made.setdefault(name, cls))
  exec(compile(code, "README.md", "exec"), {})  # pylint: disable=exec-used
  env = made["adder"]()
  env.reset({"prompt": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"})
  assert env.step("So it is 5.\n#### 5") == ("", 1.0, True)
  assert env.step("#### 56") == ("", 0.0, True)
  assert env.step("5") == ("", 0.0, True)  # no final answer line
  assert env.step("Add: <tool>add(2, 3)</tool>") == (" = 5\n", 0.0, False)
  said, reward, done = env.step("<tool>add 2 3</tool>")  # malformed: the parser's error
  assert said.startswith(" error: expected name(args)") and (reward, done) == (0.0, False)
  assert env.step("<tool>mul(2, 3)</tool>") == (" error: no tool 'mul'\n", 0.0, False)


@pytest.mark.parametrize("case", ["no_get_config", "folder", "export_file", "report_file"])
def test_unclear_refusals_name_the_culprit(case, tmp_path, capsys):
  f = tmp_path / "thing.py"
  f.write_text("x = 1\n")
  argv, needle = {
      "no_get_config": (["plan", f"--config={f}"], "defines no get_config()"),
      "folder": (["plan", f"--config={tmp_path}"], "is a folder: name a config file"),
      "export_file": (["export", "--checkpoint", str(f), "--out", str(tmp_path / "o")],
                      "is a file, not a folder"),
      "report_file": (["report", str(f)], "is a file: give the run dir"),
  }[case]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and needle in err and "Recursion" not in err, err


def test_every_shipped_config_has_get_config():
  import glob  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  from distflow_jax.config import loading  # pylint: disable=import-outside-toplevel
  files = glob.glob(os.path.join(loading.configs_dir(), "*.py"))
  assert files
  for path in files:
    loading.resolve_config_path(path)  # no refusal


def test_a_tokenizer_with_ids_past_the_embedding_is_refused(tmp_path, capsys):
  import json  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from pathlib import Path  # pylint: disable=import-outside-toplevel
  import tokenizers  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
  import device_check  # pylint: disable=import-outside-toplevel
  import make_random_model as mrm  # pylint: disable=import-outside-toplevel
  folder = tmp_path / "m"
  mrm.write(Path(folder), device_check._hf_config("tiny"))  # pylint: disable=protected-access
  tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
  rows = json.loads((folder / "config.json").read_text())["vocab_size"]
  tok.add_tokens([f"<extra{i}>" for i in range(20)])
  tok.save(str(folder / "tokenizer.json"))
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"prompt": "What is 2 + 3?"}\n')
  code = cli.main(["generate", f"--model={folder}", f"--prompts={prompts}",
                   f"--out={tmp_path / 'o.jsonl'}", "--n=1", "--max_new_tokens=4"])
  err = capsys.readouterr().err.strip()
  assert code == 2 and f"the tokenizer has {rows + 20} ids" in err, err
  assert f"embedding has {rows} rows" in err and not (tmp_path / "o.jsonl").exists()


def test_generate_out_in_an_unwritable_folder_is_refused_before_any_work(tmp_path, capsys,
                                                                        monkeypatch):
  import tempfile  # pylint: disable=import-outside-toplevel
  real = tempfile.NamedTemporaryFile

  def read_only(*a, dir=None, **kw):  # pylint: disable=redefined-builtin
    if dir is not None and str(dir).startswith(str(tmp_path / "ro")):
      raise OSError(30, "Read-only file system")
    return real(*a, dir=dir, **kw)
  monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
  (tmp_path / "ro").mkdir()
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"prompt": "What is 2 + 3?"}\n')
  code = cli.main(["generate", "--random_init", f"--prompts={prompts}",
                   f"--out={tmp_path / 'ro' / 'o.jsonl'}"])
  err = capsys.readouterr().err.strip()
  assert code == 2 and "cannot write in" in err and "Read-only file system" in err, err


def test_report_says_it_left_out_an_unreadable_last_line(tmp_path, capsys):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.1}\n'
                                          '{"step": 2, "reward": 0.2}\ngarbage\n')
  assert cli.main(["report", str(tmp_path)]) == 0
  assert "the last line of" in capsys.readouterr().err


GREEDY_NODE = """from distflow_jax.config import loading

def get_config():
  c = loading.load("grpo:tiny")
  c.dag = [dict(d, fn="advantage.rloo") if d["id"] == "advantage" else
           dict(d, config=dict(temperature=0.0)) if d["id"] == "generate" else dict(d)
           for d in c.dag]
  return c
"""


@pytest.mark.parametrize("flags,culprit", [
    (["--config.rollout.temperature=0"], "rollout.temperature=0 (greedy) on rollout node "
                                          "'generate' gives every one of a prompt's "
                                          "rollout.n=8 samples the same answer, so "
                                          "'advantage.grpo'"),
    (["--config.rollout.top_k=1"], "rollout.top_k=1 (greedy) on rollout node 'generate'"),
    (["--config=FILE"], "rollout.temperature=0 (greedy) on rollout node 'generate' gives "
                        "every one of a prompt's rollout.n=8 samples the same answer, so "
                        "'advantage.rloo'"),
])
def test_a_group_estimator_with_greedy_sampling_is_refused(flags, culprit, tmp_path, capsys):
  """Every sample of a prompt the same answer: every group advantage 0, nothing trains.
  The third case sets it as the rollout node's own override."""
  path = tmp_path / "greedy_node.py"
  path.write_text(GREEDY_NODE)
  flags = [f.replace("FILE", str(path)) for f in flags]
  for cmd in (["plan"], ["train", f"--config.run_dir={tmp_path / 'run'}"]):
    assert cli.main([cmd[0], *flags, *cmd[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and culprit in err, err
    assert "every advantage is 0 and nothing trains" in err
  assert not (tmp_path / "run" / "checkpoints").exists()
  # Sampling trains as before; greedy decoding to evaluate or generate stays allowed.
  assert cli.main(["plan", "--config.rollout.temperature=0.5"]) == 0, capsys.readouterr().err


def test_an_environment_without_a_reward_env_node_is_refused(capsys):
  """Its rewards would be dropped: the DAG scores episodes with reward.math only."""
  flags = ["--config.rollout.env=plugin_envs:Scripted", "--config.plugins=('plugin_envs',)",
           "--config.rollout.prefill_buckets=(16,32,80)"]
  assert cli.main(["plan", *flags]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1, err
  assert ("rollout.env='plugin_envs:Scripted' plays episodes, but no DAG node reads the "
          "environment's rewards (reward.env)") in err
  assert "--config=grpo:tiny_env" in err and "fn='reward.env', deps=['generate']" in err
  assert cli.main(["plan", "--config=grpo:tiny_env", *flags]) == 0, capsys.readouterr().err
  assert "reward.env" in capsys.readouterr().out


PLUGIN = """from distflow_jax.rewards import registry

def {name}(completion, ground_truth):
  return 1.0

if "{name}" not in registry.reward_names():
  registry.register_reward("{name}", {name})
"""


def test_plugins_import_from_the_working_directory_and_by_path(tmp_path, monkeypatch, capsys):
  """A plugin beside the user's config is found by name from its folder (the console
  script's folder, not the working directory, heads sys.path), and any .py by path."""
  here = tmp_path / "work"
  here.mkdir()
  (here / "cwd_reward_plugin.py").write_text(PLUGIN.format(name="cwd_reward"))
  (tmp_path / "elsewhere.py").write_text(PLUGIN.format(name="path_reward"))
  monkeypatch.chdir(here)
  monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", ".")])
  assert cli.main(["plan", "--config.plugins=('cwd_reward_plugin',)",
                   "--config.trainer.eval_reward=cwd_reward"]) == 0, capsys.readouterr().err
  assert cli.main(["plan", f"--config.plugins=('{tmp_path / 'elsewhere.py'}',)",
                   "--config.trainer.eval_reward=path_reward"]) == 0, capsys.readouterr().err
  capsys.readouterr()
  assert cli.main(["plan", "--config.plugins=('no_such_plugin_mod',)"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "plugins: cannot import 'no_such_plugin_mod'" in err
  assert cli.main(["plan", f"--config.plugins=('{tmp_path / 'missing.py'}',)"]) == 2
  assert "no such file" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--config.dag=[dict(id='generate', fn='generate')]",
                                  "--config.dag.0.fn=generate"])
def test_a_dag_on_the_command_line_says_to_write_a_config_file(flag, capsys):
  assert cli.main(["plan", flag]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1, err
  assert "the DAG (a list of node dicts) cannot be set on the command line" in err
  assert "--config=FILE.py" in err and "not supported for overriding" not in err


def test_prompts_with_unknown_tokens_are_counted_in_train_and_eval(tmp_path, capsys):
  """The built-in character tokenizer has no NUL, emoji or CJK: such prompts become
  <|unk|> tokens; they are kept, and counted (data/unk_prompts, eval/unk_prompts)."""
  import json
  from workflow_util import SMOKE, tiny_model_folder
  tiny_model_folder(tmp_path)
  rows = [{"prompt": p, "answer": "#### 5"} for p in
          ["What is 2 + 3?", "What is \x00 2 + 3?", "2 + 3 = ? \U0001f600", "\u65e5\u672c 2 + 3"]] * 2
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  run_dir = tmp_path / "run"
  code = cli.main(["train", *(f"--config.{o}" for o in SMOKE), f"--config.run_dir={run_dir}",
                   f"--config.model.path={tmp_path / 'model'}", f"--config.data.train={path}",
                   f"--config.data.eval={path}", "--config.data.eval_size=8",
                   "--config.trainer.eval_every=1", "--config.trainer.total_steps=1",
                   "--config.data.prompts_per_step=8", "--config.rollout.n=2",
                   "--config.actor.micro_batch_size=2"])
  assert code == 0, capsys.readouterr().err
  m = [json.loads(l) for l in open(run_dir / "metrics.jsonl")]
  assert m[0]["eval/unk_prompts"] == 0.75  # 6 of the 8 held-out prompts
  assert m[-1]["data/unk_prompts"] == 6.0 and m[-1]["data/bad_rows"] == 0.0


def test_docs_say_how_base_differs_from_the_default_run(capsys):
  """docs/workflows.md: defaults.base() (the config-file example's start) is not what
  `distflow-jax config` prints; the figures it gives for each are the real ones."""
  from distflow_jax import cli
  from distflow_jax.config import defaults
  text = open(__file__.replace("tests/test_trust_round3.py", "docs/workflows.md")).read()
  assert "`defaults.base()` is the library's neutral starting point" in text
  base = defaults.base()
  assert (base.actor.kl.coef, base.actor.optimizer.lr, base.trainer.total_steps) == (0.0, 1e-5, 20)
  assert cli.main(["config", "--diff"]) == 0
  out = capsys.readouterr().out
  for line in ("actor.kl.coef: 0.3", "actor.optimizer.lr: 0.0001", "trainer.total_steps: 50"):
    assert line in out.splitlines(), out


def test_a_training_file_smaller_than_a_step_is_said(tmp_path):
  """One row filling a whole step of 16 prompts trained without a word; now one line
  (run/trainer.setup logs the loader's short_epochs)."""
  import json
  from distflow_jax.data.loader import PromptLoader
  from distflow_jax.models.tokenizer import Tokenizer
  path = tmp_path / "one.jsonl"
  path.write_text(json.dumps({"prompt": "What is 1+1?", "answer": "2"}) + "\n")
  loader = PromptLoader(str(path), Tokenizer.builtin(), batch_size=16, max_prompt_len=32,
                        process_index=0, process_count=1)
  assert loader.short_epochs() == ("1 row(s) (1 per process), fewer than the 16 prompts each "
                                   "step draws per process: every step repeats rows, each "
                                   "about 16.0 times")
  path.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "answer": str(i + 1)})
                          + "\n" for i in range(16)))
  assert PromptLoader(str(path), Tokenizer.builtin(), batch_size=16, max_prompt_len=32,
                      process_index=0, process_count=1).short_epochs() == ""
