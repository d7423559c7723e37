"""Run report: metrics.jsonl reading, smoothing, summary maths, PNGs, TensorBoard events, CLI."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from distflow_jax.observe import metrics_file, report, tensorboard
from workflow_util import summary_values


def write_rows(path, rows, tail=""):
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
    f.write(tail)


def synthetic_rows(steps=12, kl=True):
  rows = [{"step": 0, "eval/accuracy": 0.1, "eval/response_length": 20.0}]
  for s in range(1, steps + 1):
    r = {"step": s, "reward": 0.05 * s, "reward_std": 0.2, "accuracy": 0.05 * s,
         "response_length": 30.0 - s, "time/generate": 2.0, "time/train_actor": 1.0,
         "time/move_to/train_actor": 0.5, "time/step": 3.5, "tokens_per_s": 100.0 + s}
    if kl:
      r["actor/kl"] = 0.001 * s
    if s % 4 == 0:
      r["eval/accuracy"] = 0.1 + 0.05 * s
    rows.append(r)
  return rows


def test_read_metrics_orders_by_step_later_rows_win_and_ignores_partial_last_line(tmp_path):
  # A resumed run re-writes step 2; a live run has a half-written last line.
  write_rows(tmp_path / "metrics.jsonl",
             [{"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.2}, {"step": 0, "x": 1},
              {"step": 2, "reward": 0.25}], tail='{"step": 3, "rew')
  rows = report.read_metrics(str(tmp_path))
  assert [r["step"] for r in rows] == [0, 1, 2]
  assert rows[2]["reward"] == 0.25


def test_read_metrics_errors_name_the_problem(tmp_path):
  with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
    report.read_metrics(str(tmp_path))
  write_rows(tmp_path / "metrics.jsonl", [{"step": 1}], tail='garbage\n{"step": 2}\n')
  with pytest.raises(ValueError, match="line 2 is not JSON"):
    report.read_metrics(str(tmp_path))


def test_series_skips_absent_and_non_finite():
  rows = [{"step": 0}, {"step": 1, "a": 1.0}, {"step": 2, "a": float("nan")}, {"step": 3, "a": 3}]
  assert report.series(rows, "a") == ([1, 3], [1.0, 3.0])


def test_ema_is_debiased_exponential_average():
  # Hand-computed: acc_t = 0.5 acc + 0.5 v, weight_t = 0.5 w + 0.5; out = acc / weight.
  out = report.ema([1.0, 0.0, 0.0], alpha=0.5)
  np.testing.assert_allclose(out, [1.0, 0.25 / 0.75, 0.125 / 0.875])
  # Against a numpy reference on random data.
  v = np.random.default_rng(0).normal(size=50)
  a = 0.2
  w = (1 - a) ** np.arange(50)[::-1]
  ref = [np.sum(v[:t + 1] * w[-(t + 1):]) / np.sum(w[-(t + 1):]) for t in range(50)]
  np.testing.assert_allclose(report.ema(v, a), ref, rtol=1e-12)


def test_summary_first_last_and_time_share():
  rows = synthetic_rows(4)
  rows[1].update({"time/generate": 30.0, "time/step": 31.5})  # step 1 compiles
  s = report.summary(rows)
  assert s["steps"] == 4
  assert s["metrics"]["reward"] == {"first": 0.05, "last": 0.2, "max": 0.2, "first_step": 1,
                                    "last_step": 4}
  assert s["metrics"]["eval/accuracy"]["first"] == 0.1 and s["metrics"]["eval/accuracy"][
      "last"] == pytest.approx(0.3)
  # Steps 2-4: generate 2 s, train_actor 1 s, move 0.5 s: shares 2/3.5, 1/3.5, 0.5/3.5.
  assert report.node_times(rows) == ["generate", "train_actor", "move_to/train_actor"]
  assert s["time_share"] == pytest.approx({"generate": 2 / 3.5, "train_actor": 1 / 3.5,
                                           "move_to/train_actor": 0.5 / 3.5})
  assert s["seconds_per_step"] == pytest.approx(3.5)
  assert s["timed_steps"] == [2, 3, 4]  # step 1 (compilation) left out of the split


def _png_pixels(path):
  import matplotlib.image
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  return matplotlib.image.imread(path)


def test_report_writes_pngs_for_present_metrics_only(tmp_path):
  write_rows(tmp_path / "metrics.jsonl", synthetic_rows(12, kl=False))
  paths = report.report(str(tmp_path))
  names = sorted(os.path.basename(p) for p in paths)
  assert names == ["accuracy.png", "report.md", "response_length.png", "reward.png",
                   "summary.png", "time.png"]  # no actor/kl in the run: no kl.png
  for p in paths:
    if p.endswith(".png"):
      px = _png_pixels(p)
      assert px.shape[0] > 200 and px.shape[1] > 400
      assert px[..., :3].std() > 0.05, f"{p} looks blank"
  md = open(tmp_path / "report" / "report.md").read()
  assert "| reward | 0.05 (step 1) | 0.6 (step 12) | 0.6 |" in md
  assert "![summary](summary.png)" in md


def test_plots_draw_the_series_values(tmp_path):
  """The reward axes hold exactly the reward values (and the EMA), not something else."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = synthetic_rows(12)
  fig, ax = plt.subplots()
  assert report.plot_reward(ax, rows)
  ys = [list(line.get_ydata()) for line in ax.get_lines()]
  want = [0.05 * s for s in range(1, 13)]
  assert any(np.allclose(y, want) for y in ys)
  assert any(np.allclose(y, report.ema(want)) for y in ys)
  fig2, ax2 = plt.subplots()
  assert report.plot_time(ax2, rows)
  heights = sorted({round(p.get_height(), 6) for p in ax2.patches})
  assert heights == [0.5, 1.0, 2.0]
  fig4, ax4 = plt.subplots()  # a lenient run's strict accuracy is drawn beside it
  assert report.plot_accuracy(ax4, rows + [{"step": 13, "eval/accuracy": 0.7,
                                            "eval/accuracy_strict": 0.4}])
  strict = [line for line in ax4.get_lines() if "strict" in line.get_label()]
  assert len(strict) == 1 and list(strict[0].get_ydata()) == [0.4]
  fig3, ax3 = plt.subplots()
  assert not report.plot_kl(ax3, [{"step": 1, "reward": 1.0}])
  plt.close("all")


def _read_events(logdir):
  """(tag, step, value) of TensorBoard scalar summaries."""
  return [(tag, step, v.simple_value) for tag, step, v in summary_values(logdir)]


def test_tensorboard_writer_writes_scalars_per_step(tmp_path):
  w = tensorboard.TensorBoardWriter(str(tmp_path / "tb"), enabled=True)
  w.write({"step": 1, "reward": 0.5, "time/generate": 2.0, "note": "text", "bad": math.nan})
  w.write({"step": 2, "reward": 0.75})
  w.close()
  events = sorted(_read_events(str(tmp_path / "tb")))
  assert events == [("reward", 1, 0.5), ("reward", 2, 0.75), ("time/generate", 1, 2.0)]
  off = tensorboard.TensorBoardWriter(str(tmp_path / "off"), enabled=False)
  off.write({"step": 1, "reward": 1.0})
  assert not os.path.exists(tmp_path / "off")


@pytest.mark.timeout(120)
def test_tensorboard_writer_does_not_import_torch_and_leaves_it_importable(tmp_path):
  """tensorboardX's package imports torch where it is installed, only to accept torch
  tensors: 1.5-3 s of every run's start.  The writer imports it with torch hidden, and
  torch stays importable after (this venv has torch, from the ``hf`` extra)."""
  pytest.importorskip("torch")
  code = ("import sys\n"
          "from distflow_jax.observe import tensorboard\n"
          f"w = tensorboard.TensorBoardWriter({str(tmp_path / 'tb')!r}, enabled=True)\n"
          "w.write({'step': 1, 'reward': 0.5}); w.close()\n"
          "assert w is not None and 'torch' not in sys.modules, 'torch was imported'\n"
          "import torch\n"
          "print(torch.tensor([1.0, 2.0]).sum().item())\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
  assert out.returncode == 0 and out.stdout.strip() == "3.0", out.stderr[-2000:]
  assert _read_events(str(tmp_path / "tb")) == [("reward", 1, 0.5)]


@pytest.mark.timeout(120)
def test_report_cli(tmp_path):
  write_rows(tmp_path / "metrics.jsonl", synthetic_rows(3))
  r = subprocess.run([sys.executable, "-m", "distflow_jax.cli", "report", str(tmp_path),
                      "--out", str(tmp_path / "plots")], capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 0, r.stderr
  assert "reward: 0.05 -> 0.15" in r.stdout
  assert sorted(os.listdir(tmp_path / "plots")) == [
      "accuracy.png", "kl.png", "report.md", "response_length.png", "reward.png",
      "summary.png", "time.png"]
  bad = subprocess.run([sys.executable, "-m", "distflow_jax.cli", "report",
                        str(tmp_path / "nope")], capture_output=True, text=True, timeout=120)
  assert bad.returncode == 2
  assert "no metrics.jsonl" in bad.stderr and "Traceback" not in bad.stderr


def _bernoulli_rows(steps=12, logged_range=True):
  """0/1 rewards: a low mean with its std reaches below 0 unless the band is clipped."""
  rows = []
  for s in range(1, steps + 1):
    m = 0.02 * s
    r = {"step": s, "reward": m, "reward_std": math.sqrt(m * (1 - m))}
    if logged_range:
      r.update({"reward_min": 0.0, "reward_max": 1.0})
    rows.append(r)
  return rows


@pytest.mark.parametrize("logged_range", [True, False])
def test_reward_band_stays_within_the_rewards_range(logged_range):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = _bernoulli_rows(logged_range=logged_range)
  xs, lo, hi = report.reward_band(rows)
  assert xs == list(range(1, 13))
  assert min(lo) == 0.0 and max(hi) <= 1.0
  # Where mean - std is above 0 the band is untouched.
  rows2 = [{"step": 1, "reward": 0.5, "reward_std": 0.1, "reward_min": 0.0, "reward_max": 1.0}]
  assert report.reward_band(rows2) == ([1], [0.4], [0.6])
  # A reward not in [0, 1] (a reward model) is clipped only by its logged range.
  rows3 = [{"step": 1, "reward": -2.0, "reward_std": 1.5, "reward_min": -3.0, "reward_max": 0.5}]
  assert report.reward_band(rows3) == ([1], [-3.0], [-0.5])
  fig, ax = plt.subplots()
  assert report.plot_reward(ax, rows)
  (band,) = ax.collections
  ys = np.concatenate([p.vertices[:, 1] for p in band.get_paths()])
  assert ys.min() >= 0.0 and ys.max() <= 1.0
  plt.close("all")


def test_time_plot_is_not_scaled_by_the_first_step():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = synthetic_rows(6)
  rows[1].update({"time/generate": 60.0, "time/step": 61.5})  # step 1 compiles
  fig, ax = plt.subplots()
  assert report.plot_time(ax, rows)
  top = ax.get_ylim()[1]
  assert 3.5 <= top < 10.0  # the later steps' 3.5 s sets the scale, not step 1's 61.5 s
  notes = [t.get_text() for t in ax.texts]
  assert any("step 1: 61.5 s (compilation), off scale" in t for t in notes), notes
  # Without a slow first step nothing is cut off.
  assert report.time_axis_top([3.0, 3.5, 3.2]) == (3.5, False)
  assert report.time_axis_top([40.0, 3.5, 3.2]) == (3.5, True)
  assert report.time_axis_top([5.0]) == (5.0, False)
  fig2, ax2 = plt.subplots()
  assert report.plot_time(ax2, synthetic_rows(6))
  assert not ax2.texts
  plt.close("all")


@pytest.mark.parametrize("kl, eval_rows, want", [
    (True, True, ["reward", "accuracy", "response_length", "kl", "time"]),  # 5: last spans
    (False, True, ["reward", "accuracy", "response_length", "time"]),
    (False, False, ["reward", "accuracy", "response_length", "time"]),
])
def test_summary_has_no_empty_panel(tmp_path, monkeypatch, kl, eval_rows, want):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = synthetic_rows(12, kl=kl)
  if not eval_rows:
    rows = [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in rows[1:]]
  figs = []
  savefig = plt.Figure.savefig

  def keep(fig, path, **kw):
    if os.path.basename(str(path)) == "summary.png":
      figs.append(fig)
    return savefig(fig, path, **kw)
  monkeypatch.setattr(plt.Figure, "savefig", keep)
  report.write_plots(rows, str(tmp_path))
  (fig,) = figs
  axes = [a for a in fig.axes if a.get_title()]  # twin axes (tokens/s) have no title
  assert [a.get_title() for a in axes] == [
      {"reward": "reward", "accuracy": "accuracy", "response_length": "lengths",
       "kl": "KL / entropy", "time": "time per step, by node"}[n] for n in want]
  assert all(a.axison and (a.lines or a.patches) for a in axes)  # every panel holds data
  # The panels tile the grid: no cell is left empty.
  cells = {(r, c) for a in axes for spec in [a.get_subplotspec()]
           for r in range(spec.rowspan.start, spec.rowspan.stop)
           for c in range(spec.colspan.start, spec.colspan.stop)}
  nrows, ncols = axes[0].get_subplotspec().get_gridspec().get_geometry()
  assert cells == {(r, c) for r in range(nrows) for c in range(ncols)}
  plt.close("all")


def test_time_plot_after_a_resume_is_scaled_by_warm_steps(tmp_path):
  """A resumed run's first step compiles again: it must not set time.png's scale either."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = synthetic_rows(10)
  rows[1].update({"time/generate": 60.0, "time/step": 61.5, "compile/count": 40.0,
                  "compile/ahead_s": 1.0})
  # Resumed at step 6: that start compiles again (cache loads, the compile-ahead mark).
  rows[6].update({"time/generate": 90.0, "time/step": 91.5, "compile/count": 0.0,
                  "compile/cache_hits": 30.0, "compile/ahead_s": 2.0})
  write_rows(tmp_path / "metrics.jsonl", rows)
  rows = report.read_metrics(str(tmp_path))
  fig, ax = plt.subplots()
  assert report.plot_time(ax, rows)
  assert 3.5 <= ax.get_ylim()[1] < 10.0  # the warm steps' 3.5 s sets the scale
  notes = [t.get_text() for t in ax.texts]
  assert any("step 6: 91.5 s (compilation), off scale" in t for t in notes), notes
  assert any("step 1: 61.5 s (compilation), off scale" in t for t in notes), notes
  plt.close("all")
  assert metrics_file.compiling_steps(rows) == {1, 6}
