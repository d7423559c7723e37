"""`generate` and `eval` take a run directory or one of its checkpoints as --model (issue 17.2),
default to grpo:tiny, and `generate` refuses a random model unless --random_init asks."""

import json
import os
import sys

import pytest

from distflow_jax import cli as cli_main
from distflow_jax.commands import generate as generate_cmd
from distflow_jax.config.loading import ConfigError
from distflow_jax.run import model_source

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workflow_util import SMOKE, cli_in_process  # noqa: E402

pytestmark = pytest.mark.timeout(600)


# The real command line in this process: the file's commands share imports and programs.
cli = cli_in_process


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """One RL step of the micro model, checkpointed at step 1."""
  path = tmp_path_factory.mktemp("run") / "run"
  assert cli_main.main(["train", f"--config.run_dir={path}", "--config.trainer.total_steps=1",
                        *[f"--config.{o}" for o in SMOKE
                          if not o.startswith("trainer.total_steps")]]) == 0
  assert os.path.isdir(path / "checkpoints" / "1")
  return path


@pytest.fixture
def prompts(tmp_path):
  path = tmp_path / "p.jsonl"
  path.write_text(json.dumps({"prompt": "What is 2+3?"}) + "\n" +
                  json.dumps({"prompt": [{"role": "user", "content": "What is 4+4?"}]}) + "\n")
  return str(path)


def generate(capsys, model, prompts, out):
  code, _, err = cli(capsys, "generate", f"--model={model}", f"--prompts={prompts}",
                     f"--out={out}", "--n=1", "--max_new_tokens=6",
                     "--config.rollout.temperature=0", "--config.data.chat_template=True")
  assert code == 0, err[-3000:]
  return [json.loads(l) for l in open(out)], err


@pytest.mark.slow
def test_kind_tells_runs_from_model_folders(run_dir, tmp_path):
  assert model_source.kind(str(run_dir)) == "checkpoint"  # holds a config.json, the run's
  assert model_source.kind(str(run_dir / "checkpoints")) == "checkpoint"
  assert model_source.kind(str(run_dir / "checkpoints" / "1")) == "checkpoint"
  assert model_source.kind(str(tmp_path)) == "hf"  # left to the Hugging Face checks
  with pytest.raises(ConfigError, match=r"^--model='/no/such' does not exist; give a Hugging "
                     r"Face folder .*, a run directory, or RUN_DIR/checkpoints/<step>$"):
    model_source.kind("/no/such")


def test_generate_from_a_run_equals_generate_from_its_export(run_dir, prompts, tmp_path,
                                                              capsys):
  from distflow_jax.commands import export as export_cmd
  hf = tmp_path / "hf"
  assert export_cmd.export(str(run_dir), str(hf)) == 1
  want, _ = generate(capsys, hf, prompts, tmp_path / "a.jsonl")
  got, err = generate(capsys, run_dir, prompts, tmp_path / "b.jsonl")
  assert "the actor of step 1" in err
  step, _ = generate(capsys, run_dir / "checkpoints" / "1", prompts, tmp_path / "c.jsonl")
  assert [r["tokens"] for r in got] == [r["tokens"] for r in want] == [r["tokens"] for r in step]
  assert got[1]["prompt"] == [{"role": "user", "content": "What is 4+4?"}]


def test_eval_takes_a_run_or_a_checkpoint(run_dir, tmp_path, capsys):
  data = run_dir / "data"
  eval_file = next(str(data / f) for f in os.listdir(data) if f.endswith("_eval.jsonl"))
  results = []
  for flag in (f"--model={run_dir}", f"--checkpoint={run_dir / 'checkpoints' / '1'}"):
    out = tmp_path / f"{len(results)}.json"
    code, _, err = cli(capsys, "eval", flag, f"--data={eval_file}", f"--out={out}", "--limit=4",
                       "--config.data.chat_template=True", "--config.data.max_prompt_len=40",
                       "--config.rollout.prefill_buckets=(40,)",
                       "--config.rollout.max_new_tokens=8")
    assert code == 0, err[-3000:]
    results.append(json.loads(out.read_text()))
  assert results[0]["prompts"] == results[1]["prompts"] == 4
  assert results[0]["eval/accuracy"] == results[1]["eval/accuracy"]
  assert results[0]["eval/response_length"] == results[1]["eval/response_length"]


def test_generate_refuses_a_random_model_unless_asked(prompts, capsys):
  with pytest.raises(ConfigError, match=r"^generate has no model: give --model=HF_DIR .*"
                     r"--random_init"):
    generate_cmd.run([f"--prompts={prompts}"])  # the default config, grpo:tiny
  code, _, err = cli(capsys, "generate", f"--prompts={prompts}")
  assert code == 2
  assert err.strip().count("\n") == 0 and "generate has no model" in err


def test_generate_random_init_with_the_default_config(prompts, tmp_path, capsys):
  code, _, err = cli(capsys, "generate", f"--prompts={prompts}", "--random_init", "--n=1",
                     "--max_new_tokens=4", f"--out={tmp_path / 'o.jsonl'}")
  assert code == 0, err[-3000:]
  assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 2


def test_run_without_checkpoints_is_one_line(tmp_path, prompts, capsys):
  (tmp_path / "run" / "checkpoints").mkdir(parents=True)
  code, _, err = cli(capsys, "generate", f"--model={tmp_path / 'run'}", f"--prompts={prompts}")
  assert code == 2, err[-2000:]
  assert err.strip().count("\n") == 0 and "holds no complete checkpoint" in err
