"""Held-out sample completions at each evaluation: samples.jsonl, TensorBoard text, config."""

import json
import os

import pytest

from distflow_jax.config import declare, loading, values
from distflow_jax.config.run_sections import Trainer
from distflow_jax.observe import samples, tensorboard
from workflow_util import summary_values, tiny_model_folder, tiny_train_argv


def _read_text_events(logdir):
  """(tag, step, text) of TensorBoard text summaries."""
  return [(tag, step, v.tensor.string_val[0].decode()) for tag, step, v in summary_values(logdir)
          if v.HasField("tensor") and v.tensor.string_val]


class _Tok:
  def decode(self, ids):
    return "".join(chr(ord("a") + i) for i in ids)


def test_sample_records_take_each_prompt_s_first_completion():
  fields = [{"prompt_text": "1+1=", "answer": "2"}, {"prompt_text": None, "answer": "5"},
            {"prompt_text": "3+3=", "answer": "6"}]
  texts = ["#### 2", "#### 3", "#### 4", "#### 5", "x", "y"]  # k=2 per prompt
  recs = samples.sample_records(_Tok(), fields, [[0], [1, 2], [3]], texts,
                                ["2", "2", "5", "5", "6", "6"], [1.0, 1.0, 0.0, 1.0, 0, 0],
                                k=2, n=2)
  assert recs == [
      {"index": 0, "prompt": "1+1=", "response": "#### 2", "reward": 1.0, "correct": True,
       "answer": "2"},
      {"index": 1, "prompt": "bc", "response": "#### 4", "reward": 0.0, "correct": False,
       "answer": "5"}]  # no prompt text kept: the ids are decoded


def test_sample_writer_appends_jsonl_and_tensorboard_text(tmp_path):
  board = tensorboard.TensorBoardWriter(str(tmp_path / "tb"), enabled=True)
  w = samples.SampleWriter(str(tmp_path), board, 2, enabled=True)
  rec = {"index": 0, "prompt": "p", "response": "r", "reward": 1.0, "correct": True,
         "answer": "7"}
  w.write(3, [rec])
  w.write(5, [dict(rec, correct=False, reward=0.0)])
  board.close()
  rows = [json.loads(l) for l in open(tmp_path / "samples.jsonl")]
  assert [(r["step"], r["correct"]) for r in rows] == [(3, True), (5, False)]
  text = _read_text_events(str(tmp_path / "tb"))
  assert [(t[0].split("/text_summary")[0], t[1]) for t in text] == [
      ("eval/samples", 3), ("eval/samples", 5)]
  assert "ground truth `7`" in text[0][2] and "correct" in text[0][2]
  off = samples.SampleWriter(str(tmp_path / "off"), None, 4, enabled=False)  # process > 0
  off.write(1, [rec])
  assert not off.enabled and not os.path.exists(tmp_path / "off")


@pytest.mark.parametrize("value", [-1, 2.0, True])
def test_log_samples_must_be_a_count(value):
  import ml_collections
  cfg = loading.load("grpo:tiny")
  assert cfg.trainer.log_samples == 4
  values.check_values(cfg)
  # The type-safe config refuses a float flag itself; a plain dict (a config file) does not:
  # the key's own check (declared beside it, config/run_sections.py) refuses it there.
  trainer = ml_collections.ConfigDict(dict(cfg.trainer.to_dict(), log_samples=value))
  with pytest.raises(loading.ConfigError, match=r"^trainer\.log_samples=.* must be .*>= 0"):
    declare.check_fields(Trainer, trainer, "trainer.")


@pytest.mark.timeout(300)
def test_train_writes_samples_at_each_evaluation(tmp_path, capsys):
  """eval_every=1, total_steps=2: evaluations at steps 0, 1 and 2, three samples each."""
  from distflow_jax import cli

  tiny_model_folder(tmp_path)
  run_dir = tmp_path / "run"
  code = cli.main(tiny_train_argv(tmp_path, run_dir, "--config.data.eval_size=8",
                                  "--config.trainer.eval_every=1",
                                  "--config.trainer.total_steps=2",
                                  "--config.trainer.log_samples=3"))
  _, err = capsys.readouterr()
  assert code == 0, err
  rows = [json.loads(l) for l in open(run_dir / "samples.jsonl")]
  assert [r["step"] for r in rows] == [0] * 3 + [1] * 3 + [2] * 3
  assert [r["index"] for r in rows] == [0, 1, 2] * 3
  for r in rows:
    assert set(r) == {"step", "index", "prompt", "response", "reward", "correct", "answer"}
    assert r["prompt"] and r["answer"] and isinstance(r["response"], str)
    assert r["correct"] == (r["reward"] > 0)
  # The same prompts at every evaluation (the held-out batch is fixed).
  assert [r["prompt"] for r in rows[:3]] == [r["prompt"] for r in rows[3:6]]
  # Each step logs its rewards' range (the report's reward band is clipped to it).
  metrics = [json.loads(l) for l in open(run_dir / "metrics.jsonl")]
  for m in metrics[1:]:
    assert 0.0 <= m["reward_min"] <= m["reward"] <= m["reward_max"] <= 1.0
    assert "reward_min_neg" not in m
  text = _read_text_events(str(run_dir / tensorboard.SUBDIR))
  assert sorted(step for _, step, _ in text) == [0, 1, 2]
  assert all(rows[0]["answer"] in t for _, s, t in text if s == 0)
