"""Plots and a summary of a run from its ``metrics.jsonl``.

  distflow-jax report RUN_DIR [--out DIR]      (commands/report.py)
  paths = report(run_dir, out_dir)

Writes PNGs next to the metrics (or to ``--out``): ``reward.png`` (mean reward
with a +-1 std band clipped to the rewards' range, per-reward components),
``accuracy.png`` (train and held-out accuracy, pass@k), ``response_length.png``,
``kl.png`` (KL to the reference, entropy), ``time.png`` (per-node seconds per
step, stacked, with throughput; a first step slowed by compilation is marked off
scale), ``summary.png`` (all of them on one page, no empty cell) and ``report.md``
(first/last values and where the time goes).  A plot whose metrics are absent
from the run is skipped.  Needs only matplotlib (Agg), no jax: it runs on a
laptop against a copied run directory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from distflow_jax.observe.metrics_file import (  # noqa: F401 (re-exported)
    METRICS_FILE, Rows, ema, node_times, read_metrics, series)
from distflow_jax.observe.plots import (  # noqa: F401 (re-exported)
    plot_accuracy, plot_kl, plot_length, plot_reward, plot_time, reward_band, summary_layout,
    time_axis_top, write_plots)


def fmt(v: float | None) -> str:
  """A metric value for text: 4 significant digits, '-' when the run has none."""
  if v is None:
    return "-"
  return f"{v:.4g}"


def summary(rows: Rows) -> dict[str, Any]:
  """First/last/best values of the headline metrics and the mean time share of each node."""
  out: dict[str, Any] = {"steps": max((int(r["step"]) for r in rows), default=0), "metrics": {}}
  for key in ("reward", "accuracy", "eval/accuracy", "response_length", "actor/kl",
              "tokens_per_s"):
    xs, ys = series(rows, key)
    if xs:
      out["metrics"][key] = {"first": ys[0], "last": ys[-1], "max": max(ys),
                             "first_step": xs[0], "last_step": xs[-1]}
  # Step 1 compiles everything; leave it out of the time split once there is more.
  timed = [r for r in rows if "time/step" in r]
  steady = [r for r in timed if int(r["step"]) > 1]
  out["timed_steps"] = steady if len(steady) >= 2 else timed
  totals = {n: sum(series(out["timed_steps"], f"time/{n}")[1]) for n in node_times(rows)}
  grand = sum(totals.values())
  out["time_share"] = {n: (v / grand if grand else 0.0) for n, v in totals.items()}
  step_s = series(out["timed_steps"], "time/step")[1]
  out["seconds_per_step"] = sum(step_s) / max(len(step_s), 1)
  out["timed_steps"] = [int(r["step"]) for r in out["timed_steps"]]
  return out


def write_markdown(rows: Rows, images: Sequence[str], path: str, title: str = "") -> None:
  s = summary(rows)
  timed = s["timed_steps"]
  which = (f"steps {timed[0]}-{timed[-1]}" if timed and timed[0] > 1 else "all steps")
  lines = [f"# {title or 'run report'}", "", f"Steps: {s['steps']}, "
           f"{s['seconds_per_step']:.2f} s per step on average over {which} (step 1 "
           f"includes compilation).", "",
           "| metric | first | last | max |", "|---|---|---|---|"]
  for k, m in s["metrics"].items():
    lines.append(f"| {k} | {fmt(m['first'])} (step {m['first_step']}) | "
                 f"{fmt(m['last'])} (step {m['last_step']}) | {fmt(m['max'])} |")
  if s["time_share"]:
    lines += ["", "| node | share of step time |", "|---|---|"]
    for n, share in sorted(s["time_share"].items(), key=lambda kv: -kv[1]):
      lines.append(f"| {n} | {100 * share:.1f}% |")
  lines += [""] + [f"![{os.path.basename(p)[:-4]}]({os.path.basename(p)})" for p in images]
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


def report(run_dir: str, out_dir: str | None = None) -> list[str]:
  """Writes the PNGs and report.md for ``run_dir``; returns the written paths."""
  if os.path.isfile(run_dir):
    raise ValueError(f"{run_dir} is a file: give the run dir that holds {METRICS_FILE}")
  rows = read_metrics(run_dir)
  if not rows:
    raise ValueError(f"{os.path.join(run_dir, METRICS_FILE)} holds no rows yet")
  out_dir = out_dir or os.path.join(run_dir, "report")
  title = os.path.basename(os.path.abspath(run_dir))
  images = write_plots(rows, out_dir, title)
  md = os.path.join(out_dir, "report.md")
  write_markdown(rows, images, md, title)
  return images + [md]
