"""``distflow-jax report``: PNG plots and a report.md of a run's metrics.

  distflow-jax report RUN_DIR [--out DIR]

The plots and the summary are ``observe.report``; this parses the command
line and prints the first/last values and the written paths.  A missing or
empty metrics file, or no matplotlib, is one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from distflow_jax.observe import report
from distflow_jax.observe.metrics_file import METRICS_FILE


def _say_unread_tail(run_dir: str) -> None:
  """The metrics file's last line, when it is not JSON, is left out (a run may be writing
  it): say so, so a damaged file is not plotted without a word."""
  path = os.path.join(run_dir, METRICS_FILE) if os.path.isdir(run_dir) else run_dir
  lines = [l for l in open(path, encoding="utf-8", errors="replace").read().splitlines()
           if l.strip()]
  if not lines:
    return
  try:
    json.loads(lines[-1])
  except json.JSONDecodeError:
    print(f"distflow-jax report: note: the last line of {path} is not JSON and was left out "
          f"(a run still writing it, or a damaged file): {lines[-1][:60]!r}", file=sys.stderr)


def run(argv: Sequence[str]) -> int:
  """Entry point of ``distflow-jax report``; returns the exit code."""

  parser = argparse.ArgumentParser(prog="distflow-jax report",
                                   description="PNG plots + report.md of a run's metrics.")
  parser.add_argument("run_dir", help="the run directory (holds metrics.jsonl)")
  parser.add_argument("--out", default=None, help="where to write (default RUN_DIR/report)")
  args = parser.parse_args(list(argv))
  try:
    paths = report.report(args.run_dir, args.out)
  except (FileNotFoundError, ValueError) as e:
    print(f"distflow-jax report: error: {e}", file=sys.stderr)
    return 2
  except ImportError as e:
    print(f"distflow-jax report: error: {e}; plots need matplotlib (`pip install matplotlib`)",
          file=sys.stderr)
    return 2
  _say_unread_tail(args.run_dir)
  s = report.summary(report.read_metrics(args.run_dir))
  for k, m in s["metrics"].items():
    print(f"{k:>16}: {report.fmt(m['first'])} -> {report.fmt(m['last'])} "
          f"(max {report.fmt(m['max'])})")
  for p in paths:
    print(f"wrote {p}")
  return 0
