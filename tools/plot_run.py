"""Plots a run's metrics.jsonl as PNGs (same as `distflow-jax report`).

    python tools/plot_run.py runs/grpo_tiny [--out DIR]

Writes reward.png, accuracy.png, response_length.png, kl.png, time.png,
summary.png and report.md to RUN_DIR/report (or --out).  Needs matplotlib.
"""

import sys

from distflow_jax.commands import report

if __name__ == "__main__":
  sys.exit(report.run(sys.argv[1:]))
