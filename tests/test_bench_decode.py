"""tools/bench_decode.py at a tiny size (tokens/s, bytes per step, roofline share, compile
seconds and the decode program's counts), its bad inputs, and the pieces it reads: the
device table's bandwidth and the compiled-HLO counts."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import bench_decode  # noqa: E402

from distflow_jax.lowering.gate import compiled_counts  # noqa: E402
from distflow_jax.models import target  # noqa: E402


@pytest.mark.timeout(120)
def test_bench_decode_smoke(tmp_path, capsys):
  out_json = tmp_path / "rows.json"
  # --prompt 8 --new 5 as test_bench_decode_alternates_fusions: batch 2's programs are
  # compiled once for the file (the persistent cache).
  rc = bench_decode.main(["--batch", "2,4", "--prompt", "8", "--new", "5", "--decode-steps",
                          "4", "--rounds", "1", "--json", str(out_json)])
  out = capsys.readouterr().out
  assert rc == 0, out
  assert "roofline share" in out and "measured (sum over 512 MiB)" in out
  rows = json.loads(out_json.read_text())
  assert [r["batch"] for r in rows] == [2, 4]
  for r in rows:
    assert r["decode_programs"] == 1 and r["conditionals"] == 0, r
    assert r["data_dependent_whiles"] == 0 and r["cases"] == 0, r
    assert r["compile_s"] > 0 and r["fusions"] > 0 and r["stablehlo_ops"] > 0, r
    assert 0 < r["roofline_share"] and r["tokens_per_s"] > 0, r
    assert r["kv_whole_bytes"] > r["kv_bytes"] > 0 and r["param_bytes"] > 0, r


@pytest.mark.timeout(180)
def test_bench_decode_alternates_fusions(tmp_path, capsys):
  """--fuse: each batch size once per fusion of the engine's projections, fewer fusions in
  the decode program where q/k/v and gate/up are one matmul each."""
  out_json = tmp_path / "rows.json"
  rc = bench_decode.main(["--batch", "2", "--prompt", "8", "--new", "5", "--decode-steps",
                          "4", "--rounds", "1", "--fuse", "none,all", "--json", str(out_json)])
  assert rc == 0, capsys.readouterr().out
  rows = json.loads(out_json.read_text())
  assert [(r["batch"], r["fuse"]) for r in rows] == [(2, "none"), (2, "all")]
  assert rows[1]["fusions"] < rows[0]["fusions"], rows


@pytest.mark.parametrize("argv, culprit", [
    (["--shape", "qwen9"], "--shape='qwen9'"),
    (["--batch", "16,x"], "--batch='16,x'"),
    (["--batch", "0"], "--batch='0'"),
    (["--new", "1"], "--new=1"),
    (["--dtype", "fp8"], "--dtype='fp8'"),
    (["--fuse", "none,qkv"], "--fuse='none,qkv'"),
])
@pytest.mark.timeout(60)
def test_bench_decode_bad_input_is_one_line(argv, culprit, capsys):
  assert bench_decode.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and culprit in err, err


def test_device_table_bandwidth_by_device_kind():
  assert target.memory_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
  assert target.memory_bandwidth("NVIDIA A100-SXM4-80GB") == 2.039e12
  assert target.memory_bandwidth("cpu") is None


def test_compiled_counts_flags_conditionals_and_unproven_loops():
  text = "\n".join([
      '%w.1 = (s32[]) while(%t), condition=%c, body=%b, backend_config={"known_trip_count":{"n":"4"}}',
      "%w.2 = (s32[], pred[]) while(%t2), condition=%c2, body=%b2",
      "%x = f32[] conditional(%p, %a, %b), true_computation=%t, false_computation=%f"])
  assert compiled_counts(text) == (1, 2, 1)
