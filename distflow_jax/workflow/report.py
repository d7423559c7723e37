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

import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

METRICS_FILE = "metrics.jsonl"

Rows = list[dict[str, Any]]


def read_metrics(path: str) -> Rows:
  """The rows of a metrics.jsonl, by step; a resumed run's later rows win.

  A run still in progress may have a half-written last line: it is ignored.
  """
  if os.path.isdir(path):
    path = os.path.join(path, METRICS_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no {METRICS_FILE} at {path!r}: give the run directory of a "
                            f"`distflow-jax train` run (its config.run_dir)")
  by_step: dict[int, dict[str, Any]] = {}
  with open(path) as f:
    lines = f.read().splitlines()
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      if i == len(lines) - 1:
        continue  # being written right now
      raise ValueError(f"{path}: line {i + 1} is not JSON: {line[:80]!r}") from None
    if not isinstance(row, dict) or "step" not in row:
      raise ValueError(f"{path}: line {i + 1} has no 'step' field")
    by_step[int(row["step"])] = row
  return [by_step[s] for s in sorted(by_step)]


def series(rows: Rows, key: str) -> tuple[list[int], list[float]]:
  """(steps, values) of the rows that hold a finite ``key``."""
  xs, ys = [], []
  for r in rows:
    v = r.get(key)
    if isinstance(v, (int, float)) and math.isfinite(v):
      xs.append(int(r["step"]))
      ys.append(float(v))
  return xs, ys


def ema(values: Sequence[float], alpha: float = 0.2) -> list[float]:
  """Exponential moving average, debiased like TensorBoard's smoothing."""
  out, acc, weight = [], 0.0, 0.0
  for v in values:
    acc = (1 - alpha) * acc + alpha * v
    weight = (1 - alpha) * weight + alpha
    out.append(acc / weight)
  return out


def node_times(rows: Rows) -> list[str]:
  """Node ids with a ``time/<id>`` metric, the most expensive first (bottom of the stack).

  ``time/move_to/<id>`` (re-partition before a node) is listed as ``move_to/<id>``;
  ``time/step`` and ``time/compile`` (seconds inside the nodes' own) are not nodes.
  """
  totals: dict[str, float] = {}
  for r in rows:
    for k, v in r.items():
      if (k.startswith("time/") and k not in ("time/step", "time/compile")
          and isinstance(v, (int, float))):
        totals[k[len("time/"):]] = totals.get(k[len("time/"):], 0.0) + float(v)
  return sorted(totals, key=lambda n: (-totals[n], n))


# ---------------------------------------------------------------- plots


def _line(ax, rows: Rows, key: str, label: str | None = None, *, smooth: bool = True,
          marker: str | None = None) -> bool:
  xs, ys = series(rows, key)
  if not xs:
    return False
  label = label or key
  if smooth and len(xs) >= 10:
    line, = ax.plot(xs, ys, alpha=0.3, linewidth=1)
    ax.plot(xs, ema(ys), color=line.get_color(), label=f"{label} (smoothed)")
  else:
    ax.plot(xs, ys, label=label, marker=marker or ("o" if len(xs) < 30 else None),
            markersize=3)
  return True


def _integer_steps(ax) -> None:
  from matplotlib.ticker import MaxNLocator
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _finish(ax, title: str, ylabel: str) -> None:
  ax.set_title(title)
  ax.set_xlabel("step")
  _integer_steps(ax)
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7)


def reward_band(rows: Rows) -> tuple[list[int], list[float], list[float]] | None:
  """(steps, low, high) of the mean reward +- 1 std, clipped to each step's ``reward_min``
  / ``reward_max`` ([0, 1] for an older run without them whose means all lie in [0, 1]).
  Unclipped, 0/1 rewards with mean 0.1 and std 0.3 draw a band down to -0.2."""
  xs, ys = series(rows, "reward")
  std = dict(zip(*series(rows, "reward_std")))
  if not xs or not std:
    return None
  lows, highs = dict(zip(*series(rows, "reward_min"))), dict(zip(*series(rows, "reward_max")))
  unit, lo, hi = all(0.0 <= y <= 1.0 for y in ys), [], []
  for x, y in zip(xs, ys):
    d = std.get(x, 0.0)
    floor = lows.get(x, 0.0 if unit else -math.inf)
    ceil = highs.get(x, 1.0 if unit else math.inf)
    lo.append(max(y - d, min(floor, y)))
    hi.append(min(y + d, max(ceil, y)))
  return xs, lo, hi


def plot_reward(ax, rows: Rows) -> bool:
  xs, ys = series(rows, "reward")
  if not xs:
    return False
  _line(ax, rows, "reward")
  band = reward_band(rows)
  if band is not None:
    ax.fill_between(*band, alpha=0.15, label="+-1 std (within the rewards' range)")
  parts = sorted({k for r in rows for k in r if k.startswith("reward/")})
  if len(parts) > 1:  # one component is the same curve as the total
    for k in parts:
      _line(ax, rows, k)
  _finish(ax, "reward", "mean reward")
  return True


def plot_accuracy(ax, rows: Rows) -> bool:
  drew = _line(ax, rows, "accuracy", "train accuracy")
  drew |= _line(ax, rows, "eval/accuracy", "held-out accuracy", smooth=False, marker="o")
  drew |= _line(ax, rows, "eval/formatted", "held-out answers in '#### N' form", smooth=False,
                marker="^")
  for k in sorted({k for r in rows for k in r if k.startswith("eval/pass@")}):
    drew |= _line(ax, rows, k, f"held-out {k[5:]}", smooth=False, marker="s")
  if drew:
    ax.set_ylim(-0.02, 1.02)
    _finish(ax, "accuracy", "fraction correct")
  return drew


def plot_length(ax, rows: Rows) -> bool:
  drew = _line(ax, rows, "response_length", "response length")
  drew |= _line(ax, rows, "eval/response_length", "held-out response length", smooth=False)
  drew |= _line(ax, rows, "prompt_length", "prompt length")
  if drew:
    _finish(ax, "lengths", "tokens")
  return drew


def plot_kl(ax, rows: Rows) -> bool:
  drew = _line(ax, rows, "actor/kl", "KL(actor || reference)")
  drew |= _line(ax, rows, "actor/entropy", "entropy")
  if drew:
    _finish(ax, "KL / entropy", "nats per token")
  return drew


def time_axis_top(totals: Sequence[float]) -> tuple[float, bool]:
  """(top of the seconds axis, whether the first bar is cut off): a first step (which
  compiles every node) over twice the later steps' longest does not set the scale."""
  totals = [float(t) for t in totals]
  if len(totals) >= 2 and totals[0] > 2 * max(totals[1:]):
    return max(max(totals[1:]), 1e-3), True
  return max(max(totals, default=0.0), 1e-3), False


def plot_time(ax, rows: Rows) -> bool:
  """Stacked per-node seconds per step; throughput (tokens/s) on the right axis."""
  names = node_times(rows)
  if not names:
    return False
  import numpy as np
  steps = [int(r["step"]) for r in rows if any(f"time/{n}" in r for n in names)]
  bottom = np.zeros(len(steps))
  by_step = {int(r["step"]): r for r in rows}
  for n in names:
    vals = np.array([float(by_step[s].get(f"time/{n}", 0.0)) for s in steps])
    ax.bar(steps, vals, bottom=bottom, label=n, width=0.8)
    bottom += vals
  ax.set_title("time per step, by node")
  ax.set_xlabel("step")
  _integer_steps(ax)
  ax.set_ylabel("seconds")
  ax.grid(alpha=0.3, axis="y")
  top, off_scale = time_axis_top(bottom)
  ax.set_ylim(0, top * 1.5)  # headroom for the legend
  if off_scale:
    # The first step compiles every node: drawn to scale it would flatten the others.
    ax.annotate(f"step {steps[0]}: {bottom[0]:.1f} s (compilation), off scale",
                xy=(steps[0], top * 1.02), xytext=(0, 4), textcoords="offset points",
                fontsize=7, ha="left", va="bottom",
                bbox=dict(facecolor="white", alpha=0.8, linewidth=0))
  ax.legend(fontsize=6, ncol=4, loc="upper left")
  xs, ys = series(rows, "tokens_per_s")
  if xs:
    ax2 = ax.twinx()
    ax2.plot(xs, ys, color="black", linewidth=1, marker=".", label="tokens/s")
    ax2.set_ylim(0, max(max(ys), 1e-3) * 1.5)
    ax2.set_ylabel("tokens/s (prompt + response)")
    ax2.legend(fontsize=6, loc="upper right")
  return True


PLOTS: dict[str, Callable[[Any, Rows], bool]] = {
    "reward": plot_reward,
    "accuracy": plot_accuracy,
    "response_length": plot_length,
    "kl": plot_kl,
    "time": plot_time,
}


def summary_layout(count: int, grid: Any) -> list[Any]:
  """Grid cells for ``count`` panels on a 2-column ``grid``: with an odd count the last
  panel (the time plot when present) spans the whole last row, so no cell stays empty."""
  cols = grid.get_geometry()[1]
  cells = [grid[i // cols, i % cols] for i in range(count)]
  if cols > 1 and count % cols:
    cells[-1] = grid[(count - 1) // cols, :]
  return cells


def write_plots(rows: Rows, out_dir: str, title: str = "") -> list[str]:
  """One PNG per plot that has data, plus ``summary.png``; returns the paths."""
  import matplotlib
  matplotlib.use("Agg")  # files only, never a window
  import matplotlib.pyplot as plt

  os.makedirs(out_dir, exist_ok=True)
  written, drawn = [], []
  for name, fn in PLOTS.items():
    fig, ax = plt.subplots(figsize=(7, 4))
    if fn(ax, rows):
      fig.tight_layout()
      path = os.path.join(out_dir, f"{name}.png")
      fig.savefig(path, dpi=100)
      written.append(path)
      drawn.append(name)
    plt.close(fig)
  if drawn:
    cols = 2 if len(drawn) > 1 else 1
    nrows = (len(drawn) + cols - 1) // cols
    fig = plt.figure(figsize=(7 * cols, 3.6 * nrows))
    for ax_spec, name in zip(summary_layout(len(drawn), fig.add_gridspec(nrows, cols)), drawn):
      PLOTS[name](fig.add_subplot(ax_spec), rows)
    if title:
      fig.suptitle(title)
    fig.tight_layout()
    path = os.path.join(out_dir, "summary.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    written.append(path)
  return written


# ---------------------------------------------------------------- summary


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
  rows = read_metrics(run_dir)
  if not rows:
    raise ValueError(f"{os.path.join(run_dir, METRICS_FILE)} holds no rows yet")
  out_dir = out_dir or os.path.join(run_dir, "report")
  title = os.path.basename(os.path.abspath(run_dir))
  images = write_plots(rows, out_dir, title)
  md = os.path.join(out_dir, "report.md")
  write_markdown(rows, images, md, title)
  return images + [md]
