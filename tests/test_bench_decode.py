"""tools/bench_decode.py at a tiny size (tokens/s, bytes per step, roofline share, compile
seconds and the decode program's counts; the whole greedy generate, with Tunix's sampler
skipped: CI has no Tunix venv), its bad inputs, and the pieces it reads: the device table's
bandwidth, the compiled-HLO counts, and the Tunix rounds' handling of a batch Tunix cannot
run."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import bench_decode  # noqa: E402

from distflow_jax.lowering.gate import compiled_counts  # noqa: E402
from distflow_jax.models import target  # noqa: E402


@pytest.mark.timeout(180)
def test_bench_decode_smoke(tmp_path, capsys):
  """--no-tunix: the one-line note, and the engine's rows all the same (decode-only per
  round with its roofline, the whole greedy generate beside an empty Tunix column)."""
  out_json = tmp_path / "rows.json"
  # --prompt 8 --new 5 as test_bench_decode_alternates_fusions: batch 2's programs are
  # compiled once for the file (the persistent cache).
  rc = bench_decode.main(["--batch", "2,4", "--prompt", "8", "--new", "5", "--decode-steps",
                          "4", "--rounds", "1", "--no-tunix", "--json", str(out_json)])
  out = capsys.readouterr().out
  assert rc == 0, out
  assert "roofline share" in out and "measured (sum over 512 MiB)" in out
  lines = out.splitlines()
  assert lines.count("# Tunix's sampler skipped (--no-tunix)") == 1, out
  for b in ("2", "4"):
    assert any(line.split()[1:4] == [b, "engine", "decode-only"] for line in lines), out
    assert any(line.split()[1:4] == [b, "engine", "generate"] for line in lines), out
    assert any(line.split()[:1] == [b] and line.endswith("Tunix not run") for line in lines)
  assert not any("Tunix generate" in line for line in lines), out
  rows = json.loads(out_json.read_text())
  assert [r["batch"] for r in rows] == [2, 4]
  for r in rows:
    assert r["decode_programs"] == 1 and r["conditionals"] == 0, r
    assert r["data_dependent_whiles"] == 0 and r["cases"] == 0, r
    assert r["compile_s"] > 0 and r["fusions"] > 0 and r["stablehlo_ops"] > 0, r
    assert 0 < r["roofline_share"] and r["tokens_per_s"] > 0, r
    assert r["kv_whole_bytes"] > r["kv_bytes"] > 0 and r["param_bytes"] > 0, r
    assert r["generate_tokens_per_s"] > 0 and len(r["generate_tokens_per_s_rounds"]) == 1, r
    assert r["tunix_tokens_per_s_rounds"] == [] and "tunix_tokens_per_s" not in r, r
    assert r["tunix_note"] == "Tunix's sampler skipped (--no-tunix)", r


class _FakeSampler:
  """Tunix's side as bench_decode sees it: batch 4 it cannot run; after ``die`` calls the
  worker is gone."""

  def __init__(self, die: int):
    self.keys, self.calls, self.die = [2, 4, 8], 0, die

  def run(self, b):
    self.calls += 1
    if self.calls > self.die:
      raise BrokenPipeError(32, "Broken pipe")
    if b == 4:
      raise bench_decode.ts.SamplerError("ValueError: cache too small")
    return bench_decode.bc.Measured([[1]], 0.5)


def test_tunix_rounds_leave_out_what_tunix_cannot_run(capsys):
  rounds = bench_decode.TunixRounds(_FakeSampler(die=3))
  assert rounds.call(2) == ([[1]], 0.5)
  value, secs = rounds.call(4)
  assert value is None and secs != secs  # NaN: on_time leaves it out
  assert rounds.failed == {4: "Tunix's sampler cannot run batch 4: ValueError: cache too small"}
  assert rounds.call(8).seconds == 0.5
  assert rounds.call(2).value is None  # the worker has died: every batch is out from now on
  assert set(rounds.failed) == {2, 4, 8}
  assert rounds.failed[4].startswith("Tunix's sampler cannot run")
  assert rounds.failed[8] == "Tunix's sampler stopped: [Errno 32] Broken pipe"
  assert capsys.readouterr().out.splitlines() == [
      "# Tunix's sampler cannot run batch 4: ValueError: cache too small",
      "# Tunix's sampler stopped: [Errno 32] Broken pipe"]


@pytest.mark.timeout(180)
def test_bench_decode_alternates_fusions(tmp_path, capsys):
  """--fuse: each batch size once per fusion of the engine's projections, fewer fusions in
  the decode program where q/k/v and gate/up are one matmul each."""
  out_json = tmp_path / "rows.json"
  rc = bench_decode.main(["--batch", "2", "--prompt", "8", "--new", "5", "--decode-steps",
                          "4", "--rounds", "1", "--fuse", "none,all", "--no-tunix", "--json",
                          str(out_json)])
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
