"""A corpus of bad inputs, one per row, through the real command line (``cli.main``).

Every row is something a user can get wrong: a config file, a DAG, a per-node override, a
config value, a data file, a prompts file, a run or checkpoint folder.  Each must end in ONE
line on stderr that names the culprit, with exit code 2 (a user error), and no traceback.
Model folders and tokenizers have their own corpus in test_bad_inputs_models.py, damaged
checkpoints in test_checkpoint_integrity.py, and random DAG mutations in test_dag_fuzz.py.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from distflow_jax import cli
from workflow_util import tiny_model_folder

GRPO = """
DAG = [
    dict(id="generate", fn="generate"),
    dict(id="reward", fn="reward.math", deps=["generate"]),
    dict(id="advantage", fn="advantage.grpo", deps=["reward"]),
    dict(id="old_logprob", fn="logprob", deps=["generate"]),
    dict(id="train_actor", fn="train.actor", deps=["advantage", "old_logprob"]),
]
"""


def config_file(tmp_path, body: str) -> str:
  """A user config file: the base config, a GRPO DAG, then ``body`` applied to ``c``."""
  path = tmp_path / "user_config.py"
  path.write_text("from distflow_jax.config import defaults\n" + GRPO + textwrap.dedent("""
      def get_config(arg=None):
        c = defaults.base()
        c.dag = [dict(n) for n in DAG]
      """) + textwrap.indent(textwrap.dedent(body), "  ") + "\n  return c\n")
  return str(path)


def run(capsys, *argv: str) -> tuple[int, str]:
  code = cli.main(list(argv))
  return code, capsys.readouterr().err


def assert_one_line(err: str, *needles: str) -> None:
  lines = [l for l in err.splitlines() if l.strip() and not l.startswith(("WARNING", "I1", "W1"))]
  assert len(lines) == 1, err
  assert "Traceback" not in err, err
  for needle in needles:
    assert needle in lines[0], lines[0]


# (config-file body, extra overrides, what the line must name)
PLAN_CASES = {
    "dag_is_none": ("c.dag = None", [], "dag"),
    "dag_cycle": ("c.dag[1]['deps'] = ['train_actor']", [], "cycle"),
    "unknown_function": ("c.dag[2]['fn'] = 'advantage.grpoo'", [], "advantage.grpoo"),
    "unknown_dep": ("c.dag[2]['deps'] = ['rewrad']", [], "rewrad"),
    "duplicate_id": ("c.dag.append(dict(id='reward', fn='reward.format', deps=['generate']))",
                     [], "reward"),
    "two_train_actor": ("c.dag.append(dict(id='train2', fn='train.actor', "
                        "deps=['advantage', 'old_logprob']))", [], "train2"),
    "two_logprob_producers": ("c.dag.append(dict(id='lp2', fn='logprob', deps=['generate']))\n"
                              "c.dag[4]['deps'].append('lp2')", [], "old_logprobs"),
    "gae_without_train_critic": (
        "c.dag[2] = dict(id='advantage', fn='advantage.gae', deps=['reward', 'values'])\n"
        "c.dag.append(dict(id='values', fn='values', deps=['generate']))", [], "train.critic"),
    "kl_without_ref_logprob": ("c.actor.kl.coef = 0.1", [], "ref_logprob"),
    "override_top_p": ("c.dag[0]['config'] = dict(top_p=2.0)", [], "top_p"),
    "override_temperature": ("c.dag[0]['config'] = dict(temperature=-1.0)", [], "temperature"),
    "override_n_zero": ("c.dag[0]['config'] = dict(n=0)", [], "n"),
    "override_unknown_key": ("c.dag[4]['config'] = dict(learning_rate=1.0)", [], "learning_rate"),
    "override_micro_batch": ("c.dag[4]['config'] = dict(micro_batch_size=7)", [],
                             "micro_batch_size"),
    "node_field_junk": ("c.dag[1]['colour'] = 'red'", [], "colour"),
    "lr_inf": ("", ["--config.actor.optimizer.lr=inf"], "lr"),
    "lr_huge": ("", ["--config.actor.optimizer.lr=1e30"], "lr"),
    "gamma_above_one": ("", ["--config.algo.gamma=5"], "gamma"),
    "negative_keep": ("", ["--config.trainer.keep=-2"], "keep"),
    "negative_save_every": ("", ["--config.trainer.save_every=-1"], "save_every"),
    "negative_total_steps": ("", ["--config.trainer.total_steps=-3"], "total_steps"),
    "unknown_optimizer": ("", ["--config.actor.optimizer.name=adamw2"], "adamw2"),
    "unknown_dtype": ("", ["--config.model.dtype=float8"], "float8"),
    "negative_processes": ("", ["--config.cluster.num_processes=-1"], "num_processes"),
    "misspelt_key": ("", ["--config.actor.optimizr.lr=1"], "optimizr"),
    "wrong_type": ("", ["--config.rollout.n=two"], "rollout.n"),
    "decode_chunk_zero": ("", ["--config.rollout.decode_chunk=0"], "rollout.decode_chunk=0"),
    "fuse_projections_unknown": ("", ["--config.rollout.fuse_projections=qkv"],
                                 "rollout.fuse_projections='qkv' is not valid; choose one of"),
    "config_raises": ("raise RuntimeError('my config is broken')", [], "my config is broken"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(PLAN_CASES))
def test_plan_refuses_bad_config_in_one_line(tmp_path, capsys, case):
  body, extra, needle = PLAN_CASES[case]
  code, err = run(capsys, "plan", f"--config={config_file(tmp_path, body)}", *extra)
  assert code == 2, err
  assert_one_line(err, "distflow-jax plan: error:", needle)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec, needle", [
    ("/no/such/config.py", "/no/such/config.py"),
    ("grpoo:tiny", "grpoo"),
])
def test_plan_refuses_missing_config_file(capsys, spec, needle):
  code, err = run(capsys, "plan", f"--config={spec}")
  assert code == 2, err
  assert_one_line(err, needle)


def test_config_file_with_a_syntax_error(tmp_path, capsys):
  path = tmp_path / "broken.py"
  path.write_text("def get_config(:\n  pass\n")
  code, err = run(capsys, "plan", f"--config={path}")
  assert code == 2, err
  assert_one_line(err, "broken.py")


def _bad_data(tmp_path) -> str:
  """A GSM8K-style file: 8 good lines, a blank line, then 8 lines that are not JSON (so any
  batch of 8 meets one, however shuffled)."""
  path = tmp_path / "train.jsonl"
  good = json.dumps({"prompt": "What is 1 + 1?", "answer": "#### 2"})
  path.write_text("\n".join([good] * 8 + [""] + ["{not json"] * 8) + "\n")
  return str(path)


def _tiny_model(tmp_path) -> str:
  return tiny_model_folder(tmp_path)


@pytest.mark.timeout(300)
def test_train_bad_row_under_on_bad_row_error_names_file_and_line(tmp_path, capsys):
  data = _bad_data(tmp_path)
  code, err = run(capsys, "train", "--config=grpo:tiny", f"--config.run_dir={tmp_path}/run",
                  f"--config.model.path={_tiny_model(tmp_path)}",
                  f"--config.data.train={data}", "--config.data.eval=",
                  "--config.data.on_bad_row=error", "--config.data.shuffle_seed=0",
                  "--config.data.prompts_per_step=8", "--config.rollout.n=2",
                  "--config.actor.micro_batch_size=1", "--config.critic.micro_batch_size=1",
                  "--config.trainer.eval_every=0", "--config.trainer.total_steps=1")
  assert code == 2, err
  assert_one_line(err, "distflow-jax train: error:", f"{data}:1", ": bad_json", "on_bad_row")


@pytest.mark.timeout(300)
def test_eval_bad_row_under_on_bad_row_error_names_file_and_line(tmp_path, capsys):
  data = _bad_data(tmp_path)
  code, err = run(capsys, "eval", f"--model={_tiny_model(tmp_path)}", f"--data={data}",
                  "--config.data.on_bad_row=error")
  assert code == 2, err
  assert_one_line(err, "distflow-jax eval: error:", f"{data}:10: bad_json")


@pytest.mark.timeout(120)
def test_train_with_a_missing_data_file(tmp_path, capsys):
  code, err = run(capsys, "train", "--config=grpo:tiny", f"--config.run_dir={tmp_path}/run",
                  f"--config.data.train={tmp_path}/nope.jsonl",
                  f"--config.model.path={_tiny_model(tmp_path)}")
  assert code == 2, err
  assert_one_line(err, "nope.jsonl")


@pytest.mark.timeout(120)
def test_generate_prompts_that_are_not_json(tmp_path, capsys):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text(json.dumps({"prompt": "hi"}) + "\n{oops\n")
  code, err = run(capsys, "generate", "--config=grpo:tiny", f"--prompts={prompts}",
                  f"--out={tmp_path}/out.jsonl")
  assert code == 2, err
  assert_one_line(err, f"{prompts}:2")


@pytest.mark.timeout(120)
def test_export_of_a_folder_without_checkpoints(tmp_path, capsys):
  (tmp_path / "run").mkdir()
  code, err = run(capsys, "export", "--checkpoint", str(tmp_path / "run"), "--out",
                  str(tmp_path / "hf"))
  assert code == 2, err
  assert_one_line(err, "distflow-jax export: error:", str(tmp_path / "run"))


@pytest.mark.timeout(120)
def test_report_of_a_folder_without_metrics(tmp_path, capsys):
  (tmp_path / "run").mkdir()
  code, err = run(capsys, "report", str(tmp_path / "run"))
  assert code == 2, err
  assert_one_line(err, "distflow-jax report: error:", "metrics.jsonl")


@pytest.mark.timeout(120)
def test_report_of_garbage_metrics(tmp_path, capsys):
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "metrics.jsonl").write_text("this is not json\n")
  code, err = run(capsys, "report", str(tmp_path / "run"))
  assert code == 2, err
  assert_one_line(err, "distflow-jax report: error:", "metrics.jsonl")


@pytest.mark.timeout(120)
def test_resume_without_a_checkpoint(tmp_path, capsys):
  code, err = run(capsys, "train", "--config=grpo:tiny", f"--config.run_dir={tmp_path}/run",
                  f"--config.model.path={_tiny_model(tmp_path)}", "--resume")
  assert code == 2, err
  assert_one_line(err, "distflow-jax train: error:", "resume")


@pytest.mark.timeout(300)
def test_plugin_reward_returning_nan_is_one_line_naming_it(tmp_path, capsys):
  config = config_file(tmp_path, """
      c.plugins = ("plugin_nan_reward",)
      c.dag[1]["fn"] = "reward.nan"
      """)
  code, err = run(capsys, "train", f"--config={config}", f"--config.run_dir={tmp_path}/run",
                  f"--config.model.path={_tiny_model(tmp_path)}",
                  "--config.data.train=builtin:arithmetic", "--config.data.eval=",
                  "--config.data.prompts_per_step=8", "--config.rollout.n=2",
                  "--config.rollout.max_new_tokens=8", "--config.actor.micro_batch_size=1",
                  "--config.trainer.eval_every=0", "--config.trainer.total_steps=1")
  assert code == 2, err
  assert_one_line(err, "distflow-jax train: error:", "reward function 'nan_reward' returned nan",
                  "sample id")
