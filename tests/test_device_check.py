"""tools/device_check.py on CPU at --shape tiny: one table, the JSON's figures, bad flags."""

import json
import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPT = os.path.join(ROOT, "tools", "device_check.py")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import device_check  # noqa: E402


def _run(args, deadline_s):
  """The script in its own process group, SIGKILLed with its children at the deadline."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.Popen([sys.executable, SCRIPT, *args], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                       stdin=subprocess.DEVNULL, start_new_session=True)
  try:
    out, err = p.communicate(timeout=deadline_s)
  except subprocess.TimeoutExpired:
    os.killpg(p.pid, signal.SIGKILL)
    p.communicate()
    pytest.fail(f"device_check.py {' '.join(args)} ran past {deadline_s} s")
  return p.returncode, out, err


@pytest.mark.timeout(330)
def test_tiny_shape_on_cpu(tmp_path):
  out_json = tmp_path / "check.json"
  rc, out, err = _run(["--shape", "tiny", "--repeats", "2", "--out", str(out_json)], 300)
  assert rc == 0, f"stdout:\n{out}\nstderr:\n{err[-3000:]}"
  rows = [line for line in out.splitlines() if line.startswith("| ")]
  labels = [r.split("|")[1].strip() for r in rows]
  assert labels[0] == "measure"
  for start in ("bfloat16 matmul", "float32 matmul", "copy x + 1", "train step MFU",
                "decode tok/s", "GRPO step 1 (compiles)", "GRPO step 2 (warm)"):
    assert sum(label.startswith(start) for label in labels) == 1, (start, out)
  assert "measured" in out  # a CPU has no table entry: peak and bandwidth are measured

  res = json.loads(out_json.read_text())
  assert res["errors"] == []
  dev, train, dec, grpo = res["device"], res["train"], res["decode"], res["grpo"]
  assert dev["platform"] == "cpu" and dev["peak_source"] == "measured"
  assert dev["peak_flops"] == max(dev["matmul_flops"].values()) > 0
  assert dev["peak_bw"] == dev["copy_bw"] > 0
  assert res["settings"]["shape"] == "tiny"
  assert 0 < train["mfu"] <= 1
  assert train["flops"]["total"] > 0 and train["step_s"] > 0 and train["skipped"] == 0
  assert train["compiles"] == 1  # the timed steps did not recompile
  assert dec["tokens_per_s"] > 0
  assert dec["decode_tokens"] == dec["batch"] * (dec["new"] - 1)  # the first comes of prefill
  assert 0 < dec["roofline_share"] <= 1.5
  assert dec["bytes_per_step"] > dec["param_bytes"] > 0
  assert len(grpo["step_s"]) == 2 and all(t > 0 for t in grpo["step_s"])
  assert grpo["step_s"][0] > grpo["step_s"][1]  # the first step compiles
  # The table shows the JSON's figures.
  assert f"{train['mfu']:.1%}" in out and f"{dec['roofline_share']:.1%}" in out
  assert f"{grpo['step_s'][1]:.2f} s" in out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [["--shape", "huge"], ["--repeats", "0"],
                                  ["--decode-batch", "x"], ["--skip", "train,bogus"],
                                  ["--no-such-flag"]])
def test_bad_flag_is_one_line_and_exit_2(args):
  rc, out, err = _run(args, 50)
  assert rc == 2
  assert out == ""
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("device_check: error: "), err


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
