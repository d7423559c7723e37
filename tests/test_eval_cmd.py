"""`distflow-jax eval`: accuracy / pass@k of a local HF model on a JSONL dataset.

The model under evaluation is built to answer every chat prompt with a fixed
string (see fixtures/tiny_hf.py), so the exact accuracy of a dataset is known
by construction: the fraction of rows whose ground truth is that answer.
"""

import json
import os
import subprocess
import sys

import pytest
from fixtures import tiny_hf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Keep decoding tiny: the real-world configs default to 512-token prompts, 1024 new tokens.
SHRINK = ["--config.rollout.max_new_tokens=16", "--config.data.max_prompt_len=128",
          "--config.rollout.prefill_buckets=(128,)", "--config.model.dtype=float32",
          "--config.rollout.max_concurrent_decodes=8", "--config.cluster.devices_per_process=1"]


def run_cli(*args, timeout=240):
  return subprocess.run([sys.executable, "-m", "distflow_jax.cli", *args], capture_output=True,
                        text=True, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def model_says_7(tmp_path_factory):
  return tiny_hf.make_answering_hf_dir(str(tmp_path_factory.mktemp("m7") / "model"), "\\boxed{7}")


def test_answering_model_fixture_is_what_the_tests_assume(model_says_7):
  """Teacher-forced: after the chat prompt, the argmax is each next token of the answer, then EOS."""
  import jax.numpy as jnp
  import numpy as np
  from distflow_jax.models import hf_io
  from distflow_jax.models.tokenizer import Tokenizer
  tok = Tokenizer.builtin()
  model = hf_io.load_pretrained(model_says_7)
  prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is 3+4?"}]))
  want = tok.encode("\\boxed{7}") + [tok.eos_id]
  ids = prompt + want[:-1]
  logits, _ = model(jnp.asarray([ids]), jnp.arange(len(ids))[None])
  got = np.asarray(jnp.argmax(logits[0, len(prompt) - 1:], axis=-1)).tolist()
  assert got == want
  # Margins large enough that temperature-1 sampling follows the chain too.
  lp = np.asarray(logits[0, len(prompt) - 1:], np.float64)
  lp = lp - np.log(np.exp(lp - lp.max(-1, keepdims=True)).sum(-1, keepdims=True)) - lp.max(-1, keepdims=True)
  assert np.exp(lp[np.arange(len(want)), want]).min() > 1 - 1e-9


def write_answers(path, answers):
  """GSM8K-style rows 'What is a-1+1?' -> '#### a', one per answer."""
  path.write_text("".join(json.dumps({"question": f"What is {a - 1}+1?", "answer": f"#### {a}"})
                          + "\n" for a in answers))
  return path


@pytest.mark.timeout(300)
def test_eval_pass_at_k_over_uneven_chunks(model_says_7, tmp_path):
  # 4 of 10 rows have the answer 7, placed so that chunks of 3 prompts (3,3,2,2) have
  # accuracies 1, 0, 0, 1/2: a plain mean of chunk means would give 0.375, not 0.4.
  answers = [7, 7, 7, 4, 6, 2, 8, 9, 5, 7]
  data = write_answers(tmp_path / "d.jsonl", answers)
  out = tmp_path / "res" / "eval.json"
  r = run_cli("eval", "--config=configs/grpo.py:qwen0.5b", f"--model={model_says_7}",
              f"--data={data}", "--k=2", "--batch_size=3", f"--out={out}", *SHRINK)
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads(out.read_text())
  assert res["prompts"] == 10 and res["skipped_rows"] == 0 and res["k"] == 2
  # k samples: pass@k and the samples' mean accuracy, each under its own key; greedy
  # accuracy's key is not reused for the sampled mean.
  assert "eval/accuracy" not in res
  assert res["eval/mean_accuracy@2"] == pytest.approx(0.4, abs=1e-12)
  assert res["eval/pass@2"] == pytest.approx(0.4, abs=1e-12)
  assert res["eval/response_length"] == pytest.approx(10.0)  # 9 answer tokens + EOS
  assert "eval chunk 4/4" in r.stdout and "eval/pass@2: 0.4000" in r.stdout


@pytest.mark.timeout(300)
def test_eval_greedy_gsm8k_fixture_with_llama_config(tmp_path):
  # Rows 0..11 of the fixture: one has the answer 24 (row 1).
  model = tiny_hf.make_answering_hf_dir(str(tmp_path / "llama"), "\\boxed{24}", arch="llama")
  r = run_cli("eval", "--config=configs/grpo.py:llama1b", f"--model={model}",
              f"--data={tiny_hf.GSM8K_TINY}", "--limit=12", *SHRINK)
  assert r.returncode == 0, r.stderr[-3000:]
  lines = dict(l.split(": ", 1) for l in r.stdout.splitlines() if ": " in l and "[" not in l)
  assert float(lines["eval/accuracy"]) == pytest.approx(1 / 12, abs=1e-4)
  assert float(lines["prompts"]) == 12


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, pattern", [
    (["--model=MODEL", "--data=tests/fixtures/gsm8k_tiny.jsonl"],
     "set --config.data.prompt_key=question"),
    (["--config=configs/grpo.py:qwen0.5b", "--model=MODEL",
      "--data=tests/fixtures/gsm8k_tiny.jsonl", "--config.data.answer_key=solution"],
     "rows have no 'solution' field"),
    (["--data=tests/fixtures/gsm8k_tiny.jsonl", "--model=tests/fixtures"],
     "--model='tests/fixtures' has no config.json"),
    (["--data=tests/fixtures/gsm8k_tiny.jsonl", "--model=/no/such/dir"], "does not exist"),
    (["--checkpoint=runs/x/ckpt", "--data=tests/fixtures/gsm8k_tiny.jsonl"],
     "--checkpoint='runs/x/ckpt' does not exist; give a Hugging Face folder"),
    (["--data=tests/fixtures/gsm8k_tiny.jsonl"], "eval needs --model"),
    (["--model=MODEL", "--data=tests/fixtures/gsm8k_tiny.jsonl", "--reward=mth"],
     "--reward='mth' is unknown"),
])
def test_eval_errors_are_one_clean_line(model_says_7, args, pattern):
  r = run_cli("eval", *[a.replace("MODEL", model_says_7) for a in args], timeout=120)
  assert r.returncode == 2, (r.stdout, r.stderr[-2000:])
  assert pattern in r.stderr
  assert "Traceback" not in r.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_eval_two_processes_reduce_exactly(model_says_7, tmp_path):
  """Each process evaluates its shard; chunk sizes differ (4, 4, 2 prompts over both)."""
  from distflow_jax import launcher
  # Shards [7,7,8,6,5] and [7,4,2,9,7], chunks of (2,2,1) rows each: chunk accuracies
  # 3/4, 0/4, 1/2 over both processes; weighted 0.4 (a plain mean would be 0.4167).
  answers = [7, 7, 7, 4, 8, 2, 6, 9, 5, 7]
  data = write_answers(tmp_path / "d.jsonl", answers)
  out = tmp_path / "eval.json"
  result = launcher.launch(2, 1, [
      sys.executable, "-m", "distflow_jax.cli", "eval",
      f"--config={REPO}/configs/grpo.py:qwen0.5b", f"--model={model_says_7}", f"--data={data}",
      "--batch_size=2", f"--out={out}", *SHRINK], timeout_s=240)
  assert result.ok, result.describe() + "\n" + "\n".join(sum(result.outputs, []))
  res = json.loads(out.read_text())
  assert res["prompts"] == 10 and res["skipped_rows"] == 0
  assert res["eval/accuracy"] == pytest.approx(0.4, abs=1e-12)
  assert any("eval chunk 3/3" in line for line in result.outputs[0])
