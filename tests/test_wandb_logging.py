"""Weights & Biases logging (logging.wandb, observe/wandb_log.py): the config, the missing
extra, and a tiny offline run read back from the files wandb wrote."""

import glob
import json
import os
import struct

import pytest

from distflow_jax import cli
from distflow_jax.config import loading, values
from distflow_jax.observe import wandb_log
from workflow_util import tiny_model_folder, tiny_train_argv


def test_wandb_is_off_by_default_and_its_keys_are_checked():
  cfg = loading.load("grpo:tiny")
  assert cfg.logging.wandb.to_dict() == dict(enabled=False, project="distflow-jax", name="",
                                             mode="")
  values.check_values(cfg)
  assert not wandb_log.WandbWriter(cfg, enabled=True).enabled  # off: nothing started
  cfg = loading.load("grpo:tiny", ["logging.wandb.mode=cloud"])
  with pytest.raises(loading.ConfigError, match=r"^logging\.wandb\.mode='cloud' must be one "
                     r"of \['', 'online', 'offline'\]"):
    values.check_values(cfg)
  cfg = loading.load("grpo:tiny", ["logging.wandb.enabled=True", "logging.wandb.project="])
  with pytest.raises(loading.ConfigError, match=r"^logging\.wandb\.project is empty"):
    wandb_log.check(cfg)


def test_wandb_without_the_package_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(wandb_log, "has_wandb", lambda: False)
  run_dir = tmp_path / "run"
  code = cli.main(["train", f"--config.run_dir={run_dir}", "--config.logging.wandb.enabled=True"])
  out, err = capsys.readouterr()
  assert code == 2
  lines = err.strip().splitlines()
  assert len(lines) == 1, err
  assert "logging.wandb.enabled=True needs the wandb package" in lines[0]
  assert "pip install 'distflow-jax[wandb]'" in lines[0]
  assert not run_dir.exists() and "train" not in out  # before any work


def wandb_records(path):
  """The protobuf records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version),
  then LevelDB-log framing (32 KiB blocks of checksum, length, type, data chunks)."""
  from wandb.proto import wandb_internal_pb2
  block = 32768
  data = open(path, "rb").read()
  assert data[:4] == b":W&B", path
  pos, chunk, out = 7, b"", []
  while pos + 7 <= len(data):
    left = block - pos % block
    if left < 7:  # a block's tail too short for a record header is padding
      pos += left
      continue
    _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if kind == 0 and n == 0:  # zero padding up to the block's end
      pos += left
      continue
    chunk += data[pos + 7:pos + 7 + n]
    pos += 7 + n
    if kind in (1, 4):  # FULL, or the LAST chunk of FIRST/MIDDLE/.../LAST
      record = wandb_internal_pb2.Record()
      record.ParseFromString(chunk)
      out.append(record)
      chunk = b""
  return out


def history(path):
  """Each history row of a ``.wandb`` file as {key: JSON value}."""
  rows = []
  for r in wandb_records(path):
    if r.WhichOneof("record_type") == "history":
      rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                   for i in r.history.item})
  return rows


@pytest.mark.timeout(300)
def test_train_logs_metrics_and_sample_tables_to_wandb_offline(tmp_path, monkeypatch, capsys):
  """eval_every=1, total_steps=2, offline: the metrics.jsonl keys at steps 0..2 and a samples
  table at each evaluation, read back from the run's .wandb file and media folder."""
  pytest.importorskip("wandb", reason="wandb is not installed (pip install "
                      "'distflow-jax[wandb]'); logging.wandb is untested here")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
  monkeypatch.setenv("WANDB_SILENT", "true")
  (tmp_path / "wb").mkdir()
  tiny_model_folder(tmp_path)
  run_dir = tmp_path / "run"
  code = cli.main(tiny_train_argv(tmp_path, run_dir, "--config.data.eval_size=8",
                                  "--config.trainer.eval_every=1",
                                  "--config.trainer.total_steps=2",
                                  "--config.trainer.log_samples=2",
                                  "--config.logging.wandb.enabled=True",
                                  "--config.logging.wandb.project=distflow-test",
                                  "--config.logging.wandb.name=tiny-offline"))
  _, err = capsys.readouterr()
  assert code == 0, err
  runs = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*"))
  assert len(runs) == 1, runs
  run_id = open(run_dir / wandb_log.ID_FILE).read().strip()
  wandb_file = os.path.join(runs[0], f"run-{run_id}.wandb")
  assert os.path.isfile(wandb_file)

  records = wandb_records(wandb_file)
  run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
  assert (run.project, run.display_name, run.run_id) == ("distflow-test", "tiny-offline", run_id)
  config = {i.key: json.loads(i.value_json) for i in run.config.update}
  assert config["trainer"]["total_steps"] == 2 and config["logging"]["wandb"]["enabled"]

  rows = history(wandb_file)
  metrics = [json.loads(l) for l in open(run_dir / "metrics.jsonl")]
  assert [r["_step"] for r in rows] == [m["step"] for m in metrics] == [0, 1, 2]
  for row, m in zip(rows, metrics):
    logged = {k: v for k, v in row.items() if not k.startswith(("_", "eval/samples/"))}
    assert set(logged) == {k for k, v in m.items() if k != "step"
                           and isinstance(v, (int, float)) and v == v}
    for k, v in logged.items():
      assert v == pytest.approx(m[k])
    assert row["eval/samples/_type"] == "table-file" and row["eval/samples/nrows"] == 2
  assert rows[-1]["reward"] == pytest.approx(metrics[-1]["reward"])

  # The tables hold what samples.jsonl holds, a row per sample.
  tables = sorted(glob.glob(os.path.join(runs[0], "files", "media", "table", "eval",
                                         "samples_*.table.json")))
  assert len(tables) == 3
  samples = [json.loads(l) for l in open(run_dir / "samples.jsonl")]
  got = []
  for path in tables:
    t = json.load(open(path))
    assert t["columns"] == list(wandb_log.SAMPLE_COLUMNS)
    got.extend(dict(zip(t["columns"], row)) for row in t["data"])
  key = lambda r: (r["step"], r["index"])
  assert sorted(got, key=key) == sorted(samples, key=key)
