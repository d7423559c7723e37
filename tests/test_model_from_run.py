"""`generate` and `eval` take a run directory or one of its checkpoints as --model (issue 17.2),
default to grpo:tiny, and `generate` refuses a random model unless --random_init asks."""

import json
import os
import subprocess
import sys

import pytest

from distflow_jax.commands import generate as generate_cmd
from distflow_jax.config.loading import ConfigError
from distflow_jax.run import model_source

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workflow_util import SMOKE  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def cli(*args):
  return subprocess.run([sys.executable, "-m", "distflow_jax.cli", *args], capture_output=True,
                        text=True, timeout=300, cwd=REPO)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """One RL step of the micro model, checkpointed at step 1."""
  path = tmp_path_factory.mktemp("run") / "run"
  r = cli("train", f"--config.run_dir={path}", "--config.trainer.total_steps=1",
          *[f"--config.{o}" for o in SMOKE if not o.startswith("trainer.total_steps")])
  assert r.returncode == 0, r.stderr[-3000:]
  assert os.path.isdir(path / "checkpoints" / "1")
  return path


@pytest.fixture
def prompts(tmp_path):
  path = tmp_path / "p.jsonl"
  path.write_text(json.dumps({"prompt": "What is 2+3?"}) + "\n" +
                  json.dumps({"prompt": [{"role": "user", "content": "What is 4+4?"}]}) + "\n")
  return str(path)


def generate(model, prompts, out):
  r = cli("generate", f"--model={model}", f"--prompts={prompts}", f"--out={out}", "--n=1",
          "--max_new_tokens=6", "--config.rollout.temperature=0", "--config.data.chat_template=True")
  assert r.returncode == 0, r.stderr[-3000:]
  return [json.loads(l) for l in open(out)], r.stderr


@pytest.mark.slow
def test_kind_tells_runs_from_model_folders(run_dir, tmp_path):
  assert model_source.kind(str(run_dir)) == "checkpoint"  # holds a config.json, the run's
  assert model_source.kind(str(run_dir / "checkpoints")) == "checkpoint"
  assert model_source.kind(str(run_dir / "checkpoints" / "1")) == "checkpoint"
  assert model_source.kind(str(tmp_path)) == "hf"  # left to the Hugging Face checks
  with pytest.raises(ConfigError, match=r"^--model='/no/such' does not exist; give a Hugging "
                     r"Face folder .*, a run directory, or RUN_DIR/checkpoints/<step>$"):
    model_source.kind("/no/such")


def test_generate_from_a_run_equals_generate_from_its_export(run_dir, prompts, tmp_path):
  from distflow_jax.commands import export as export_cmd
  hf = tmp_path / "hf"
  assert export_cmd.export(str(run_dir), str(hf)) == 1
  want, _ = generate(hf, prompts, tmp_path / "a.jsonl")
  got, err = generate(run_dir, prompts, tmp_path / "b.jsonl")
  assert "the actor of step 1" in err
  step, _ = generate(run_dir / "checkpoints" / "1", prompts, tmp_path / "c.jsonl")
  assert [r["tokens"] for r in got] == [r["tokens"] for r in want] == [r["tokens"] for r in step]
  assert got[1]["prompt"] == [{"role": "user", "content": "What is 4+4?"}]


def test_eval_takes_a_run_or_a_checkpoint(run_dir, tmp_path):
  data = run_dir / "data"
  eval_file = next(str(data / f) for f in os.listdir(data) if f.endswith("_eval.jsonl"))
  results = []
  for flag in (f"--model={run_dir}", f"--checkpoint={run_dir / 'checkpoints' / '1'}"):
    out = tmp_path / f"{len(results)}.json"
    r = cli("eval", flag, f"--data={eval_file}", f"--out={out}", "--limit=4",
            "--config.data.chat_template=True", "--config.data.max_prompt_len=40",
            "--config.rollout.prefill_buckets=(40,)", "--config.rollout.max_new_tokens=8")
    assert r.returncode == 0, r.stderr[-3000:]
    results.append(json.loads(out.read_text()))
  assert results[0]["prompts"] == results[1]["prompts"] == 4
  assert results[0]["eval/accuracy"] == results[1]["eval/accuracy"]
  assert results[0]["eval/response_length"] == results[1]["eval/response_length"]


def test_generate_refuses_a_random_model_unless_asked(prompts):
  with pytest.raises(ConfigError, match=r"^generate has no model: give --model=HF_DIR .*"
                     r"--random_init"):
    generate_cmd.run([f"--prompts={prompts}"])  # the default config, grpo:tiny
  r = cli("generate", f"--prompts={prompts}")
  assert r.returncode == 2
  assert r.stderr.strip().count("\n") == 0 and "generate has no model" in r.stderr


def test_generate_random_init_with_the_default_config(prompts, tmp_path):
  r = cli("generate", f"--prompts={prompts}", "--random_init", "--n=1", "--max_new_tokens=4",
          f"--out={tmp_path / 'o.jsonl'}")
  assert r.returncode == 0, r.stderr[-3000:]
  assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 2


def test_run_without_checkpoints_is_one_line(tmp_path, prompts):
  (tmp_path / "run" / "checkpoints").mkdir(parents=True)
  r = cli("generate", f"--model={tmp_path / 'run'}", f"--prompts={prompts}")
  assert r.returncode == 2, r.stderr[-2000:]
  assert r.stderr.strip().count("\n") == 0 and "holds no complete checkpoint" in r.stderr
