"""A run's ``metrics.jsonl`` read back: its rows, one metric's series, smoothing, and the
per-node time lines (what observe/report.py and observe/plots.py share; no jax, no
matplotlib).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
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


def compiling_steps(rows: Rows) -> set[int]:
  """The steps that compiled, whose seconds say nothing about a warm step's: the first step
  of every process start (the trainer marks it with ``compile/ahead_s``; a resumed run's
  first step is one), any step with backend compiles or persistent-cache loads, and the
  first training step of the file (a run from before these counters)."""
  out = {int(r["step"]) for r in rows
         if "compile/ahead_s" in r or _positive(r.get("compile/count"))
         or _positive(r.get("compile/cache_hits"))}
  first = next((int(r["step"]) for r in rows if int(r["step"]) > 0), None)
  return out | ({first} if first is not None else set())


def _positive(v: Any) -> bool:
  return isinstance(v, (int, float)) and v > 0


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
