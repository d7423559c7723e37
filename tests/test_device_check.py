"""tools/device_check.py on CPU at --shape tiny: the table row by row, --out's records, a
section killed at its deadline, a check killed from outside, the versions and memory rows,
bad flags."""

import json
import os
import platform
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import without_shared_cache

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPT = os.path.join(ROOT, "tools", "device_check.py")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import device_check  # noqa: E402


def _popen(args, cold=False):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if cold:  # every section compiles
    env = without_shared_cache(env)
  return subprocess.Popen([sys.executable, SCRIPT, *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                          stdin=subprocess.DEVNULL, start_new_session=True)


def _run(args, deadline_s, cold=False):
  """The script in its own process group, SIGKILLed with its children at the deadline."""
  p = _popen(args, cold)
  try:
    out, err = p.communicate(timeout=deadline_s)
  except subprocess.TimeoutExpired:
    os.killpg(p.pid, signal.SIGKILL)
    p.communicate()
    pytest.fail(f"device_check.py {' '.join(args)} ran past {deadline_s} s")
  return p.returncode, out, err


def _labels(out):
  return [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]


def _row(out, start):
  """The cells of the one table row whose label starts with `start`."""
  rows = [line for line in out.splitlines()
          if line.startswith("| ") and line.split("|")[1].strip().startswith(start)]
  assert len(rows) == 1, (start, out)
  return [c.strip() for c in rows[0].split("|")[1:-1]]


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_tiny_shape_on_cpu(tmp_path):
  out_json = tmp_path / "check.jsonl"
  # Cold (no shared compile cache): it asserts that GRPO step 1 compiles, which a program
  # another test compiled first would otherwise answer from the cache.
  rc, out, err = _run(["--shape", "tiny", "--repeats", "2", "--out", str(out_json)], 300,
                      cold=True)
  assert rc == 0, f"stdout:\n{out}\nstderr:\n{err[-3000:]}"
  labels = _labels(out)
  assert labels[0] == "measure"
  order = ("versions: cpu x 1 (cpu)", "bfloat16 matmul", "float32 matmul", "copy x + 1",
           "train step MFU", "decode tok/s", "GRPO step 1 (compiles)", "GRPO step 2 (warm)",
           "peak memory of the GRPO run")
  assert [next(i for i, l in enumerate(labels) if l.startswith(o)) for o in order] == \
      sorted(range(1, len(order) + 1)), out  # each once, the versions row first
  assert "measured" in out  # a CPU has no table entry: peak and bandwidth are measured

  res = device_check.read_out(str(out_json))
  assert list(res) == ["versions", "settings", "device", "train", "decode", "grpo", "memory",
                       "summary"]
  assert res["summary"]["errors"] == []
  assert all(res[k]["status"] == "ok" for k in device_check.SECTIONS)
  ver, dev, train, dec, grpo, mem = (res[k] for k in device_check.SECTIONS)
  # The versions row: this interpreter and jax, no CUDA plugin and no cuDNN on a CPU.
  import jax  # pylint: disable=import-outside-toplevel
  assert ver["python"] == platform.python_version() and ver["jax"] == jax.__version__
  assert ver["jaxlib"] and ver["flax"] and ver["flax_imports"] is True
  assert ver["cudnn"] == "n/a" and ver["plugins"] == {}
  assert (ver["platform"], ver["device_kind"], ver["num_devices"]) == ("cpu", "cpu", 1)
  assert f"jax {jax.__version__}" in _row(out, "versions")[1]
  assert _row(out, "versions")[2] == "no plugin; cuDNN n/a"

  assert dev["platform"] == "cpu" and dev["peak_source"] == "measured"
  assert dev["peak_flops"] == max(dev["matmul_flops"].values()) > 0
  assert dev["peak_bw"] == dev["copy_bw"] > 0
  assert res["settings"]["shape"] == "tiny"
  assert res["settings"]["limits"] == device_check.LIMITS
  assert 0 < train["mfu"] <= 1
  assert train["flops"]["total"] > 0 and train["step_s"] > 0 and train["skipped"] == 0
  assert train["compiles"] == 1  # the timed steps did not recompile
  assert dec["tokens_per_s"] > 0
  assert dec["decode_tokens"] == dec["batch"] * (dec["new"] - 1)  # the first comes of prefill
  assert 0 < dec["roofline_share"] <= 1.5
  assert dec["bytes_per_step"] > dec["param_bytes"] > 0
  assert len(grpo["step_s"]) == 2 and all(t > 0 for t in grpo["step_s"])
  assert grpo["step_s"][0] > grpo["step_s"][1]  # the first step compiles
  assert grpo["compiles"][0] > 0 and grpo["compiles"][1] == 0  # cold, then nothing new
  # The memory row on a CPU: no memory_stats, the plan's figure all the same.
  assert grpo["memory"]["platform"] == "cpu" and grpo["memory"]["stats"] is None
  assert "measured_peak_bytes" not in mem and mem["plan_peak_bytes"] > 0
  assert mem["plan_node"] == "train_actor" and mem["plan_source"] == "analytic"
  cells = _row(out, "peak memory of the GRPO run")
  assert cells[1].startswith("n/a on this platform")
  assert cells[2].startswith("plan --memory (analytic): ") and "train_actor" in cells[2]
  # The table shows the JSON's figures.
  assert f"{train['mfu']:.1%}" in out and f"{dec['roofline_share']:.1%}" in out
  assert f"{grpo['step_s'][1]:.2f} s" in out


@pytest.mark.timeout(150)
def test_section_killed_at_its_limit_keeps_the_finished_rows(tmp_path):
  """train gets 2 s (importing jax and flax and compiling the step take longer; the run
  goes without the suite's shared compilation cache, where an earlier test's step could
  load in a second): its child is SIGKILLed, its row says so, the rows before it stay on
  stdout and in --out, and the next section still runs."""
  out_json = tmp_path / "check.jsonl"
  t0 = time.monotonic()
  rc, out, err = _run(["--shape", "tiny", "--skip", "decode,grpo", "--limit", "train=2",
                       "--out", str(out_json), "--workdir", str(tmp_path / "work")], 120,
                      cold=True)
  assert rc == 1, f"stdout:\n{out}\nstderr:\n{err[-3000:]}"
  labels = _labels(out)
  for start in ("versions", "bfloat16 matmul", "copy x + 1"):
    assert any(l.startswith(start) for l in labels), (start, out)
  assert _row(out, "train step MFU")[1] == "timed out: killed at its 2 s limit"
  assert labels.index(_row(out, "train step MFU")[0]) < labels.index(
      _row(out, "peak memory")[0])  # the section after the killed one ran
  assert _row(out, "decode tok/s")[1] == "skipped"
  assert _row(out, "peak memory")[1] == "n/a: grpo section skipped"
  assert "error: train: timed out: killed at its 2 s limit" in out

  res = device_check.read_out(str(out_json))
  assert [res[k]["status"] for k in device_check.SECTIONS] == \
      ["ok", "ok", "timeout", "skipped", "skipped", "ok"]
  assert res["device"]["peak_flops"] > 0 and res["memory"]["plan_peak_bytes"] > 0
  assert 2 <= res["train"]["wall_s"] < 15  # SIGKILLed at the deadline, not run to the end
  assert res["summary"]["errors"] == ["train: timed out: killed at its 2 s limit"]
  assert time.monotonic() - t0 < 120


@pytest.mark.timeout(120)
def test_check_killed_from_outside_keeps_rows_and_leaves_no_child(tmp_path):
  """The loan ends: the script is SIGKILLed mid-section.  Every row printed and every
  record written before stays, and the section's child dies with it (PDEATHSIG)."""
  out_json = tmp_path / "check.jsonl"
  p = _popen(["--shape", "tiny", "--skip", "grpo", "--out", str(out_json),
              "--workdir", str(tmp_path / "work")])
  try:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
      if (out_json.exists() and '"section": "device"' in out_json.read_text()
          and psutil.Process(p.pid).children()):
        break
      assert p.poll() is None, p.communicate()
      time.sleep(0.2)
    else:
      pytest.fail("no device record within 90 s")
    children = psutil.Process(p.pid).children()
    os.kill(p.pid, signal.SIGKILL)  # the script only: its children are in their own sessions
    out, _ = p.communicate(timeout=30)
  finally:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
      p.communicate()
  assert children, "the next section's child was not running"
  gone, alive = psutil.wait_procs(children, timeout=10)
  alive = [c for c in alive if c.status() != psutil.STATUS_ZOMBIE]
  for c in alive:
    c.kill()
  assert not alive, "a section's child outlived the script"
  res = device_check.read_out(str(out_json))
  assert res["versions"]["status"] == res["device"]["status"] == "ok"
  assert "summary" not in res
  assert _row(out, "versions")[1].startswith("python ")
  assert _row(out, "copy x + 1")[1].endswith("B/s")


def test_versions_record_in_process():
  rec = device_check.measure_versions()
  assert rec["python"] == platform.python_version()
  assert rec["platform"] == "cpu" and rec["device_kind"] == "cpu" and rec["num_devices"] >= 1
  assert rec["cudnn"] == "n/a" and rec["plugins"] == {} and rec["flax_imports"] is True


def test_memory_row_with_and_without_memory_stats():
  s = device_check.resolve(device_check._args(["--shape", "tiny"]), "tiny")  # pylint: disable=protected-access
  plan = dict(status="ok", plan_source="analytic", plan_peak_bytes=2.0e9, plan_node="train_actor")
  gpu = dict(status="ok", memory=dict(platform="gpu", stats=dict(peak_bytes_in_use=2.5e9)))
  rec = dict(plan)
  device_check.merge_memory(rec, gpu)
  assert device_check.rows("memory", rec, {}, s) == [
      ("peak memory of the GRPO run (peak_bytes_in_use)", "2.50 GB",
       "plan --memory (analytic): 2.00 GB, while train_actor runs", "125%")]
  rec = dict(plan)
  device_check.merge_memory(rec, dict(status="timeout", memory=gpu["memory"]))
  assert rec["measured_note"] == "at the GRPO run's kill" and rec["measured_peak_bytes"] == 2.5e9
  rec = dict(plan)
  device_check.merge_memory(rec, dict(status="ok", memory=dict(platform="cpu", stats=None)))
  assert device_check.rows("memory", rec, {}, s)[0][1].startswith("n/a on this platform")
  rec = dict(status="error", error="distflow-jax plan exit 2")
  device_check.merge_memory(rec, None)
  assert device_check.rows("memory", rec, {}, s)[0][1:3] == (
      "n/a: grpo section skipped", "plan --memory: distflow-jax plan exit 2")


def test_grpo_record_reads_what_a_killed_run_left(tmp_path):
  s = device_check.resolve(device_check._args(["--shape", "tiny"]), "tiny")  # pylint: disable=protected-access
  (tmp_path / "run").mkdir()
  step1 = {"step": 1, "time/step": 20.5, "compile/count": 41.0, "time/compile": 15.0,
           "tokens": 100, "time/generate": 4.0}
  (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps(step1) + "\n{\"step\": 2, \"ti")
  (tmp_path / device_check.MEMORY_FILE).write_text(json.dumps(
      {"platform": "gpu", "polls": 3, "stats": {"peak_bytes_in_use": 123}}))
  rec = device_check.grpo_record(s, str(tmp_path))
  assert rec["step_s"] == [20.5] and rec["compiles"] == [41.0]
  assert rec["memory"]["stats"]["peak_bytes_in_use"] == 123
  table = device_check.rows("grpo", dict(rec, status="timeout",
                                         error="timed out: killed at its 210 s limit"), {}, s)
  assert [r[:2] for r in table] == [
      ("GRPO step 1 (compiles), 2 prompts x 2, <= 64 + 16 tokens", "20.50 s"),
      ("GRPO step 2, 2 prompts x 2, <= 64 + 16 tokens", "timed out: killed at its 210 s limit")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [["--shape", "huge"], ["--repeats", "0"],
                                  ["--decode-batch", "x"], ["--skip", "train,bogus"],
                                  ["--skip", "versions"], ["--limit", "grpo=0"],
                                  ["--limit", "bogus=3"], ["--limit", "grpo"],
                                  ["--no-such-flag"]])
def test_bad_flag_is_one_line_and_exit_2(args):
  rc, out, err = _run(args, 50)
  assert rc == 2
  assert out == ""
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("device_check: error: "), err


def test_limits():
  args = device_check._args(["--limit", "grpo=300,train=5", "--timeout", "40"])  # pylint: disable=protected-access
  assert {n: device_check.section_limit(args, n) for n in device_check.SECTIONS} == dict(
      versions=40, device=40, train=5, decode=40, grpo=300, memory=40)
  args = device_check._args([])  # pylint: disable=protected-access
  assert {n: device_check.section_limit(args, n) for n in device_check.SECTIONS} == \
      device_check.LIMITS


def test_peak_table_matches_device_kinds():
  assert device_check.peak_for("NVIDIA H100 80GB HBM3")[:2] == ("H100 SXM", 989e12)
  assert device_check.peak_for("NVIDIA H100 80GB HBM3")[2] == 3.35e12
  assert device_check.peak_for("NVIDIA H200")[1:] == (989e12, 4.8e12)
  assert device_check.peak_for("NVIDIA H100 PCIe")[0] == "H100 PCIe"
  assert device_check.peak_for("NVIDIA A100-SXM4-80GB")[2] == 2.04e12
  assert device_check.peak_for("TPU v4")[1:] == (275e12, 1.23e12)
  assert device_check.peak_for("TPU v5 lite")[0] == "TPU v5e"
  assert device_check.peak_for("TPU v5")[0] == "TPU v5p"
  assert device_check.peak_for("TPU v5p")[0] == "TPU v5p"
  assert device_check.peak_for("TPU v6 lite")[1:] == (918e12, 1.64e12)
  assert device_check.peak_for("cpu") is None
  assert device_check.peak_for("Some New Accelerator") is None


def test_flop_count_is_the_documented_formula():
  s = device_check._model_cfg_light("qwen0.5b")  # pylint: disable=protected-access
  f = device_check.bc.train_flops(s, 16, 256, 256)
  t, d, q = 256 + 256 - 1, 896, 14 * 64
  n_nonemb = 24 * (d * (2 * q + 2 * 2 * 64) + 3 * d * 4864)
  assert f["blocks"] == 6 * n_nonemb * 16 * t
  assert f["unembed"] == 6 * 151936 * d * 16 * 256
  assert f["attention"] == 12 * 24 * 16 * t * t * q


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_model_flag_runs_the_grpo_and_memory_rows_on_that_folder(tmp_path):
  """--model: the folder's own shape and weights (a real model's, on a lent device); here a
  tiny folder written as the check writes its own, kept as it was."""
  import make_random_model as mrm  # pylint: disable=import-outside-toplevel
  from pathlib import Path  # pylint: disable=import-outside-toplevel
  folder = tmp_path / "real"
  mrm.write(Path(folder), device_check._hf_config("tiny"))  # pylint: disable=protected-access
  before = sorted(os.listdir(folder))
  out_json = tmp_path / "check.jsonl"
  rc, out, err = _run(["--model", str(folder), "--shape", "tiny", "--skip", "train,decode",
                       "--repeats", "2", "--out", str(out_json)], 300)
  assert rc == 0, f"stdout:\n{out}\nstderr:\n{err[-3000:]}"
  res = device_check.read_out(str(out_json))
  assert res["grpo"]["status"] == "ok" and res["memory"]["status"] == "ok"
  assert f"--config.model.path={folder}" in res["grpo"]["command"]
  assert f"--config.model.path={folder}" in res["memory"]["plan_command"]
  assert sorted(os.listdir(folder)) == before  # the folder is read, never rewritten
  rc, _, err = _run(["--model", str(tmp_path / "none"), "--skip", "grpo"], 60)
  assert rc == 2 and "has no config.json" in err
