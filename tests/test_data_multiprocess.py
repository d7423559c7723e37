"""Cross-process data coordinator checks: 2 processes x 2 CPU devices."""

import json
import os
import sys

import pytest

from distflow_jax import launcher

MP = os.path.join(os.path.dirname(__file__), "mp")


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_cross_process_repartition_distributed_and_centralized():
  result = launcher.launch(2, 2, [sys.executable, os.path.join(MP, "data_redistribute.py")],
                           timeout_s=120)
  assert result.ok, result.describe() + "\n" + "\n".join(sum(result.outputs, []))
  for lines in result.outputs:
    assert any(line.startswith("OK process") for line in lines), lines


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_cross_process_loader_shards_and_state(tmp_path):
  path = tmp_path / "prompts.jsonl"
  num_records = 12
  with open(path, "w") as f:
    for i in range(num_records):
      f.write(json.dumps({"prompt": f"what is {i}+1", "answer": str(i + 1)}) + "\n")
  result = launcher.launch(2, 2, [sys.executable, os.path.join(MP, "data_loader.py"),
                                  str(path), str(num_records)], timeout_s=120)
  assert result.ok, result.describe() + "\n" + "\n".join(sum(result.outputs, []))
  for lines in result.outputs:
    assert any(line.startswith("OK process") for line in lines), lines
