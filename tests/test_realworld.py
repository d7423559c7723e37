"""The real-world path: the qwen0.5b / llama1b configs on a local HF directory + GSM8K JSONL.

The training test runs the qwen0.5b config itself, shrunk by overrides but on
the same code path (model.path, data.train/eval, prompt_key="question", chat
template), against a Qwen2-shaped model built to answer every chat prompt with
``\\boxed{24}`` (fixtures/tiny_hf.py), so exact values are known: one of the
first 8 fixture rows has the answer 24, and every response is 10 tokens + EOS.
Then `distflow-jax report` plots the run.
"""

import glob
import json
import os
import subprocess
import sys

import pytest
from fixtures import tiny_hf
from workflow_util import cli_in_process

from distflow_jax.config import loading
from distflow_jax.observe import hints

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHRINK = ["--config.cluster.devices_per_process=2", "--config.trainer.total_steps=2",
          "--config.trainer.eval_every=2", "--config.data.eval_size=8",
          "--config.data.prompts_per_step=4", "--config.rollout.n=2",
          "--config.rollout.max_new_tokens=16", "--config.data.max_prompt_len=128",
          "--config.rollout.prefill_buckets=(128,)", "--config.model.max_seq_len=256",
          "--config.model.dtype=float32", "--config.actor.mini_batches=1",
          "--config.rollout.max_concurrent_decodes=8"]


def run_cli(*args, timeout=400):
  return subprocess.run([sys.executable, "-m", "distflow_jax.cli", *args], capture_output=True,
                        text=True, timeout=timeout, cwd=REPO)


def read_rows(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(l) for l in f]


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_qwen_config_trains_on_gsm8k_fixture_then_report(tmp_path, capsys):
  model = tiny_hf.make_answering_hf_dir(str(tmp_path / "qwen"), "\\boxed{24}", arch="qwen2")
  run_dir = str(tmp_path / "run")
  r = run_cli("train", "--config=configs/grpo.py:qwen0.5b", f"--config.model.path={model}",
              f"--config.data.train={tiny_hf.GSM8K_TINY}",
              f"--config.data.eval={tiny_hf.GSM8K_TINY}", f"--config.run_dir={run_dir}",
              *SHRINK)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  assert any(l.startswith("step 2/2 ") for l in r.stdout.splitlines()), r.stdout[-2000:]

  rows = read_rows(run_dir)
  assert [row["step"] for row in rows] == [0, 1, 2]
  assert rows[0]["eval/accuracy"] == pytest.approx(1 / 8, abs=1e-12)
  assert rows[2]["eval/accuracy"] == pytest.approx(1 / 8, abs=1e-12)
  for row in rows[1:]:
    # Chat template + prompt_key=question reached the model: every answer is "\boxed{24}".
    assert row["response_length"] == pytest.approx(11.0)
    assert row["data/bad_rows"] == 0
    assert row["accuracy"] == row["reward"]
    assert (row["reward"] * 4) == pytest.approx(round(row["reward"] * 4))  # whole prompts
    for node in ("generate", "reward", "advantage", "old_logprob", "ref_logprob",
                 "train_actor"):
      assert row[f"time/{node}"] > 0

  # TensorBoard events next to metrics.jsonl.
  events = glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*"))
  assert len(events) == 1 and os.path.getsize(events[0]) > 200

  # report reads files only: the real command line in this process.
  code, rep_out, rep_err = cli_in_process(capsys, "report", run_dir)
  assert code == 0, rep_err
  pngs = sorted(os.path.basename(p) for p in glob.glob(os.path.join(run_dir, "report", "*.png")))
  assert pngs == ["accuracy.png", "kl.png", "response_length.png", "reward.png",
                  "summary.png", "time.png"]
  assert "eval/accuracy: 0.125 -> 0.125" in rep_out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["qwen0.5b", "llama1b"])
def test_realworld_configs_load_and_plan(variant, capsys):
  cfg = loading.load(f"configs/grpo.py:{variant}")
  assert cfg.data.prompt_key == "question" and cfg.data.chat_template
  assert cfg.model.path == "" and cfg.data.train == ""  # set by the user, never downloaded
  # plan builds no array: the real command line in this process.
  code, out, err = cli_in_process(capsys, "plan", f"--config=configs/grpo.py:{variant}",
                                  "--num_processes=2", "--devices_per_process=8")
  assert code == 0, err
  assert "train_actor" in out


# ---------------------------------------------------------------- first errors


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
  return tiny_hf.make_tiny_hf_dir(str(tmp_path_factory.mktemp("q") / "qwen"))


def train_args(model, run_dir, *extra):
  """A run refused before step 1 (``run_dir`` a test's own: the run writes its config there
  first, and one folder shared by tests on two workers would be locked by the other)."""
  return ["train", "--config=configs/grpo.py:qwen0.5b", f"--config.model.path={model}",
          f"--config.data.train={tiny_hf.GSM8K_TINY}", f"--config.data.eval={tiny_hf.GSM8K_TINY}",
          f"--config.run_dir={run_dir}", *SHRINK, *extra]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra, pattern", [
    (["--config.data.prompt_key=prompt"],
     "rows have no 'prompt' field (data.prompt_key='prompt'); the first row has "
     "['answer', 'question']; set --config.data.prompt_key=question"),
    (["--config.placement.actor.mesh.fsdp=3"], "has 3 devices but the role has 2"),
    (["--config.cluster.devices_per_process=3"], "does not divide over the 3"),
])
def test_train_first_errors_are_one_clean_line(tiny_qwen, extra, pattern, tmp_path):
  r = run_cli(*train_args(tiny_qwen, tmp_path / "run", *extra), timeout=120)
  assert r.returncode == 2, r.stdout[-1000:] + r.stderr[-2000:]
  assert pattern in r.stderr
  assert "Traceback" not in r.stderr


@pytest.mark.timeout(120)
def test_train_model_path_without_config_json(tmp_path):
  (tmp_path / "weights.bin").write_bytes(b"x")
  r = run_cli(*train_args(str(tmp_path), tmp_path / "run"), timeout=120)
  assert r.returncode == 2
  assert f"model.path='{tmp_path}' has no config.json" in r.stderr
  assert "Traceback" not in r.stderr


def test_check_model_dir_messages(tmp_path, tiny_qwen):
  hints.check_model_dir(tiny_qwen)  # a complete directory passes
  with pytest.raises(loading.ConfigError, match="does not exist; nothing is downloaded"):
    hints.check_model_dir(str(tmp_path / "missing"))
  # The user pointed at the parent of the model folder.
  parent = os.path.dirname(tiny_qwen)
  with pytest.raises(loading.ConfigError, match=f"did you mean '{tiny_qwen}'"):
    hints.check_model_dir(parent)
  pick = tmp_path / "pickled"
  pick.mkdir()
  (pick / "config.json").write_text("{}")
  (pick / "pytorch_model.bin").write_bytes(b"x")
  with pytest.raises(loading.ConfigError, match="pickle checkpoints, which are refused"):
    hints.check_model_dir(str(pick))
  notok = tmp_path / "notok"
  notok.mkdir()
  for f in ("config.json", "model.safetensors"):
    (notok / f).write_bytes(open(os.path.join(tiny_qwen, f), "rb").read())
  with pytest.raises(loading.ConfigError, match="has no tokenizer.json"):
    hints.check_model_dir(str(notok))


def test_unsupported_architecture_option_is_named(tmp_path, tiny_qwen):
  # YaRN-scaled checkpoints (some Qwen long-context ones) are not supported yet.
  d = tmp_path / "yarn"
  d.mkdir()
  for f in os.listdir(tiny_qwen):
    (d / f).write_bytes(open(os.path.join(tiny_qwen, f), "rb").read())
  cfg = json.loads((d / "config.json").read_text())
  cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
  (d / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(loading.ConfigError, match="RoPE scaling 'yarn' is not supported"):
    hints.check_model_dir(str(d))


def test_check_dataset_fields(tmp_path):
  hints.check_dataset_fields(tiny_hf.GSM8K_TINY, "question", "answer")
  with pytest.raises(loading.ConfigError, match="set --config.data.prompt_key=question"):
    hints.check_dataset_fields(tiny_hf.GSM8K_TINY, "prompt", "answer")
  p = tmp_path / "d.jsonl"
  p.write_text(json.dumps({"problem": "1+1?", "solution": "2"}) + "\n")
  with pytest.raises(loading.ConfigError, match="set --config.data.answer_key=solution"):
    hints.check_dataset_fields(str(p), "problem", "answer", "data.eval")
  with pytest.raises(loading.ConfigError, match=r"^data.eval="):
    hints.check_dataset_fields(str(p), "problem", "answer", "data.eval")


def test_oom_hint():
  from jax.errors import JaxRuntimeError
  cfg = loading.load("configs/grpo.py:qwen0.5b")
  err = JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                        "4294967296 bytes.")
  hint = hints.oom_hint(err, cfg)
  assert hint.startswith("out of memory: RESOURCE_EXHAUSTED")
  assert "--config.rollout.max_concurrent_decodes=128" in hint
  assert "--config.actor.micro_batch_size=4" in hint
  assert "model.dtype=bfloat16" not in hint  # already bf16
  tiny = loading.load("configs/grpo.py:tiny")
  assert "--config.model.dtype=bfloat16" in hints.oom_hint(MemoryError(), tiny)
  assert hints.oom_hint(ValueError("shapes do not match"), cfg) is None
