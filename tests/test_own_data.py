"""Data as users have it (issue 17.4): dotted keys into nested rows, chat-message prompts,
verl's GSM8K Parquet layout as it is, and size / length mismatches named by their setting."""

import json
import os
import subprocess
import sys

import pytest

from distflow_jax.config.loading import ConfigError
from distflow_jax.data.loader import PromptLoader, TooFewRowsError
from distflow_jax.data.sources import field_value
from distflow_jax.models.tokenizer import Tokenizer
from distflow_jax.observe import hints

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHRINK = ["--config.rollout.max_new_tokens=16", "--config.data.max_prompt_len=128",
          "--config.rollout.prefill_buckets=(128,)", "--config.model.dtype=float32",
          "--config.rollout.max_concurrent_decodes=8", "--config.cluster.devices_per_process=1"]
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def verl_gsm8k_parquet(path, answers):
  """verl's examples/data_preprocess/gsm8k.py layout, written with pyarrow."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  rows = [{"data_source": "openai/gsm8k",
           "prompt": [{"role": "user", "content": f"What is {a - 1}+1? {INSTRUCTION}"}],
           "ability": "math",
           "reward_model": {"style": "rule", "ground_truth": str(a)},
           "extra_info": {"split": "test", "index": i, "answer": f"1+{a - 1}={a}\n#### {a}",
                          "question": f"What is {a - 1}+1?"}}
          for i, a in enumerate(answers)]
  pq.write_table(pa.Table.from_pylist(rows), str(path))
  return str(path)


def test_field_value_follows_dotted_paths():
  row = {"a": {"b": {"c": "x"}}, "d.e": 1, "f": None, "g": [1]}
  assert field_value(row, "a.b.c") == "x"
  assert field_value(row, "d.e") == 1  # a column whose name has dots wins
  assert field_value(row, "a.b") == {"c": "x"}
  for missing in ("a.x", "a.b.c.d", "f", "f.g", "g.0", "nope"):
    assert field_value(row, missing) is None


def test_verl_parquet_loads_as_it_is(tmp_path):
  path = verl_gsm8k_parquet(tmp_path / "test.parquet", [72, 5, 13])
  tok = Tokenizer.builtin()
  loader = PromptLoader(path, tok, batch_size=3, max_prompt_len=200, shuffle=False,
                        num_epochs=1, process_index=0, process_count=1,
                        answer_key="reward_model.ground_truth", use_chat_template=False)
  batch = next(loader)
  want = tok.apply_chat_template([{"role": "user", "content": f"What is 71+1? {INSTRUCTION}"}])
  assert want.startswith("<|user|>What is 71+1?") and want.endswith("<|assistant|>")
  # Messages are rendered with the chat template even with data.chat_template off.
  n = int(batch.data["prompt_len"][0])
  assert tok.decode(batch.data["prompt_ids"][0, :n].tolist(), skip_special_tokens=False) == want
  host = [batch.host[int(s)] for s in batch.data["sample_id"]]
  assert [h["answer"] for h in host] == ["72", "5", "13"]
  assert host[0]["data_source"] == "openai/gsm8k" and host[0]["prompt_text"] == want
  assert loader.counts["ok"] == 3
  # The dataset check understands the dotted key, and suggests it for verl files.
  hints.check_dataset_fields(path, "prompt", "reward_model.ground_truth", "data.eval")
  with pytest.raises(ConfigError, match=r"rows have no 'answer' field.*set "
                     r"--config\.data\.answer_key=reward_model\.ground_truth$"):
    hints.check_dataset_fields(path, "prompt", "answer", "data.eval")


def test_nested_answer_that_is_not_text_is_a_bad_row_naming_the_key(tmp_path):
  path = verl_gsm8k_parquet(tmp_path / "t.parquet", [3, 4])
  loader = PromptLoader(path, Tokenizer.builtin(), batch_size=1, max_prompt_len=200,
                        shuffle=False, num_epochs=1, process_index=0, process_count=1,
                        answer_key="reward_model", on_bad_row="error")
  with pytest.raises(ConfigError, match=r"row 0: missing_field: field 'reward_model' must be "
                     r"text or a number, got dict .*reward_model\.ground_truth"):
    next(loader)


def test_numeric_answers_become_text(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text(json.dumps({"q": {"text": "1+1?"}, "meta": {"gt": 2}}) + "\n")
  loader = PromptLoader(str(path), Tokenizer.builtin(), batch_size=1, max_prompt_len=64,
                        num_epochs=1, process_index=0, process_count=1, prompt_key="q.text",
                        answer_key="meta.gt")
  batch = next(loader)
  assert list(batch.host.values())[0]["answer"] == "2"


def test_eval_set_smaller_than_eval_size_names_the_setting(tmp_path):
  """The trainer's eval loader (batch data.eval_size // processes, one pass)."""
  path = tmp_path / "eval.jsonl"
  path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n"
                          for p in ["ok"] * 5 + ["x" * 80] * 5))
  kw = dict(tokenizer=Tokenizer.builtin(), max_prompt_len=64, shuffle=False, num_epochs=1,
            process_index=0, process_count=1)
  with pytest.raises(TooFewRowsError, match=r"has 10 records .*data\.eval_size"):
    PromptLoader(str(path), batch_size=16, **kw)
  with pytest.raises(TooFewRowsError, match=r"gave 5 valid prompt\(s\).*too_long.*lower "
                     r"data\.eval_size so that each of the 1 process\(es\) needs at most 5"):
    next(PromptLoader(str(path), batch_size=8, **kw))


def run_cli(*args, timeout=240):
  return subprocess.run([sys.executable, "-m", "distflow_jax.cli", *args], capture_output=True,
                        text=True, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def model_says_7(tmp_path_factory):
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from fixtures import tiny_hf
  path = str(tmp_path_factory.mktemp("m7") / "model")
  return tiny_hf.make_answering_hf_dir(path, "\\boxed{7}")


@pytest.mark.timeout(300)
def test_eval_runs_on_verl_parquet(model_says_7, tmp_path):
  answers = [7, 3, 7, 7, 9]
  data = verl_gsm8k_parquet(tmp_path / "test.parquet", answers)
  out = tmp_path / "eval.json"
  r = run_cli("eval", "--config=configs/grpo.py:qwen0.5b", f"--model={model_says_7}",
              f"--data={data}", "--config.data.prompt_key=prompt",
              "--config.data.answer_key=reward_model.ground_truth", f"--out={out}",
              "--config.reward.match=exact", *SHRINK)
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads(out.read_text())
  assert res["prompts"] == 5 and res["skipped_rows"] == 0
  assert res["eval/accuracy"] == pytest.approx(0.6, abs=1e-12)


@pytest.mark.timeout(300)
def test_eval_rows_too_long_name_max_prompt_len(model_says_7, tmp_path):
  data = tmp_path / "d.jsonl"
  data.write_text("".join(json.dumps({"question": q, "answer": "7"}) + "\n"
                          for q in ["What is 3+4?"] + ["x" * 200] * 3))
  r = run_cli("eval", "--config=configs/grpo.py:qwen0.5b", f"--model={model_says_7}",
              f"--data={data}", "--batch_size=1", *SHRINK)
  assert r.returncode == 2, r.stderr[-3000:]
  last = r.stderr.strip().splitlines()[-1]
  assert "data.max_prompt_len" in last and "--batch_size" in last and "too_long" in last, last
  assert "Traceback" not in r.stderr
