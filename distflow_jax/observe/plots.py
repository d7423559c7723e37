"""The run report's plots (matplotlib, Agg): reward with its band, accuracy, response
length, KL and entropy, per-node time with throughput, and the one-page summary; each
``plot_*`` returns False where the run has none of its metrics (observe/report.py).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from distflow_jax.observe.metrics_file import Rows, compiling_steps, ema, node_times, series

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
  drew |= _line(ax, rows, "eval/accuracy_strict", "held-out accuracy, strict ('#### N' or "
                "\\boxed anywhere)", smooth=False, marker="s")
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


def time_axis_top(totals: Sequence[float],
                  compiled: Sequence[bool] | None = None) -> tuple[float, bool]:
  """(top of the seconds axis, whether a bar is cut off): the warm steps set the scale; a
  step that compiled (``compiled``, default: the first one) over twice the warm steps'
  longest is drawn cut off instead of flattening them."""
  totals = [float(t) for t in totals]
  if compiled is None:
    compiled = [i == 0 for i in range(len(totals))]
  warm = [t for t, c in zip(totals, compiled) if not c]
  if not warm:
    return max(max(totals, default=0.0), 1e-3), False
  top = max(max(warm), 1e-3)
  kept = [t for t, c in zip(totals, compiled) if c and t <= 2 * top]
  top = max([top] + kept)
  return top, any(c and t > top for t, c in zip(totals, compiled))


def plot_time(ax, rows: Rows) -> bool:
  """Stacked per-node seconds per step; throughput (tokens/s) on the right axis.  Steps
  that compiled (``compiling_steps``: each process start's first, a recompile) are drawn
  but do not set the scale; one far above the warm steps is cut off and annotated."""
  names = node_times(rows)
  if not names:
    return False
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
  compiling = compiling_steps([by_step[s] for s in steps])
  compiled = [s in compiling for s in steps]
  top, _ = time_axis_top(bottom, compiled)
  ax.set_ylim(0, top * 1.5)  # headroom for the legend
  for s, total, c in zip(steps, bottom, compiled):
    if c and total > top:
      # A step that compiled: drawn to scale it would flatten the others.
      ax.annotate(f"step {s}: {total:.1f} s (compilation), off scale",
                  xy=(s, top * 1.02), xytext=(0, 4), textcoords="offset points",
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
