"""tools/bench_long_context.py at toy sizes: parts (a) packing vs padding and (b) memory vs
length through its main(), the JSON well-formed, equal work on both sides of (a), and the
ratio refused when the two sides' results differ."""

import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import bench_long_context as blc  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_packing_and_memory_parts_at_toy_lengths(tmp_path, capsys):
  out = tmp_path / "blc.json"
  # One response maximum: a row's logic is the same at every length, and each costs two
  # train-step and two pass compiles.
  rc = blc.main(["--part", "packing", "--max-lengths", "64", "--repeats", "1",
                 "--samples", "4", "--prompt", "4", "--json", str(out)])
  assert rc == 0
  text = capsys.readouterr().out
  assert "start: " in text and "load average" in text and "end: " in text
  result = json.loads(out.read_text())
  rows = result["packing"]
  assert [r["max_new_tokens"] for r in rows] == [64]
  for r in rows:
    assert len(r["lengths"]) == 4 and 1 <= min(r["lengths"]) <= max(r["lengths"]) <= r[
        "max_new_tokens"]
    # Equal work: the same useful tokens on both sides, fewer slots packed, the same numbers.
    assert r["useful_tokens"] == sum(4 + n - 1 for n in r["lengths"])
    assert r["packed_slots"] < r["padded_slots"] == 4 * (4 + r["max_new_tokens"] - 1)
    assert r["padded_fits"] and r["packed_fits"]
    assert r["loss_abs_diff"] <= blc.LOSS_TOL and r["logprob_max_abs_diff"] <= blc.LOSS_TOL
    assert math.isfinite(r["padded_loss"]) and r["padded_loss"] == pytest.approx(
        r["packed_loss"], abs=blc.LOSS_TOL)
    assert r["step_ratio"] > 0 and r["logprob_ratio"] > 0
    for side in ("padded", "packed"):
      assert len(r[f"{side}_step_s"]) == 1 and r[f"{side}_tokens_per_s"] > 0
      assert r[f"{side}_step_bytes"] > 0 and r[f"{side}_logprob_bytes"] > 0
    assert r["compiles_while_timed"] == 0
    assert f"packed/padded: step {r['step_ratio']:.2f}x" in text

  out_b = tmp_path / "blc_b.json"
  assert blc.main(["--part", "memory", "--lengths", "64,128", "--impls", "xla",
                   "--own-memory", "--json", str(out_b)]) == 0
  mem = json.loads(out_b.read_text())["memory"]
  assert [m["attention_impl"] for m in mem] == ["xla"]
  for m in mem:
    assert m["lengths"] == [64, 128] and all(b > 0 for b in m["temp_bytes"])
    assert m["growth_per_doubling"][0] is None and m["growth_per_doubling"][1] > 0


def test_ratio_refused_when_the_sides_differ():
  assert blc.ratio_if_equal(0.0, 100.0, 250.0) == 2.5
  assert blc.ratio_if_equal(blc.LOSS_TOL / 2, 100.0, 250.0) == 2.5
  assert blc.ratio_if_equal(1e-3, 100.0, 250.0) is None
  assert blc.ratio_if_equal(float("nan"), 100.0, 250.0) is None


def test_long_tailed_lengths_mean_a_quarter_of_the_maximum():
  for max_len in (1024, 4096, 16384):
    lengths = blc.long_tailed_lengths(8, max_len, seed=0)
    assert lengths.min() >= 1 and lengths.max() <= max_len
    assert abs(lengths.mean() / max_len - 0.25) < 0.01
    assert lengths.max() > 2 * lengths.mean()  # a long tail, not a uniform spread


def test_growth_per_doubling():
  assert blc.growth_per_doubling([1, 2, 4, 16], [10, 20, 80, 1280]) == [None, 2.0, 4.0, 4.0]
  assert blc.growth_per_doubling([1, 2], [None, 5]) == [None, None]
