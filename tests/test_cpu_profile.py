"""DISTFLOW_TEST_CPU_LOG: a real pytest run records each test's CPU seconds (its own and its
started processes'), wall seconds and XLA compiles; tools/test_cpu_report.py sums them."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))

SAMPLE = '''
import subprocess, sys, time
import jax, jax.numpy as jnp

def test_burns_cpu_in_a_child():
  subprocess.run([sys.executable, "-c", "t = __import__('time').process_time()\\nwhile __import__('time').process_time() - t < 0.5: pass"], check=True)

def test_compiles_one_program():
  assert int(jax.jit(lambda x: x * 3 + 1)(jnp.int32(2))) == 7
'''


@pytest.mark.timeout(240)
def test_a_run_logs_cpu_children_and_compiles_and_the_report_sums_them(tmp_path):
  import test_cpu_report
  folder = tmp_path / "tests"
  folder.mkdir()
  for name in ("conftest.py", "cpu_profile.py"):
    (folder / name).write_text(open(os.path.join(REPO, "tests", name)).read())
  (folder / "test_sample.py").write_text(SAMPLE)
  log = tmp_path / "cpu.jsonl"
  env = dict(os.environ, DISTFLOW_TEST_CPU_LOG=str(log), DISTFLOW_TEST_XLA_CACHE="")
  for key in ("JAX_COMPILATION_CACHE_DIR", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS"):
    env.pop(key, None)
  proc = subprocess.run(["timeout", "-s", "KILL", "200", sys.executable, "-m", "pytest", "-q",
                         "-p", "no:cacheprovider", str(folder)], cwd=tmp_path, env=env,
                        capture_output=True, text=True)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = {r["id"].split("::")[1]: r for r in map(json.loads, log.read_text().splitlines())}
  child, jit = rows["test_burns_cpu_in_a_child"], rows["test_compiles_one_program"]
  assert child["children_cpu_s"] >= 0.4 and child["compiles"] == 0, child
  assert jit["compiles"] >= 1 and jit["compile_s"] > 0 and jit["children_cpu_s"] == 0, jit
  text = test_cpu_report.report(test_cpu_report.load(str(log)), cores=2, top=5)
  assert text.startswith("2 tests: ") and "on 2 cores" in text
  assert "test_sample.py" in text and "test_burns_cpu_in_a_child" in text


@pytest.mark.timeout(30)
def test_report_refuses_a_missing_or_empty_log_in_one_line(tmp_path, capsys):
  import test_cpu_report
  assert test_cpu_report.main([str(tmp_path / "none.jsonl")]) == 2
  (tmp_path / "empty.jsonl").write_text("")
  assert test_cpu_report.main([str(tmp_path / "empty.jsonl")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 2 and "cannot read" in err[0] and "holds no test" in err[1]
