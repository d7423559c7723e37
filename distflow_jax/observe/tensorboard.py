"""TensorBoard event files for a run's metrics (``tensorboard --logdir RUN_DIR``).

Written with ``tensorboardX``, which needs neither TensorFlow nor PyTorch.
Only process 0 writes, in ``run_dir/tensorboard``; every numeric metric of a
row becomes a scalar at that row's ``step``, and held-out samples
(observe/samples.py) are text entries.  Where tensorboardX is not installed
the run goes on with metrics.jsonl only, after one warning.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

log = logging.getLogger(__name__)

SUBDIR = "tensorboard"


class TensorBoardWriter:
  """``write(row)`` like JsonlWriter; flushes every row so a crash loses nothing."""

  def __init__(self, logdir: str, enabled: bool):
    self.logdir = logdir
    self._writer = None
    if not enabled:
      return
    try:
      from tensorboardX import SummaryWriter
    except ImportError:
      log.warning("tensorboardX is not installed: no TensorBoard event files (metrics.jsonl "
                  "is still written); `pip install tensorboardX` to get them")
      return
    os.makedirs(logdir, exist_ok=True)
    self._writer = SummaryWriter(logdir=logdir, flush_secs=10)

  @property
  def enabled(self) -> bool:
    return self._writer is not None

  def write(self, record: dict[str, Any]) -> None:
    if self._writer is None:
      return
    step = int(record["step"])
    for key, value in sorted(record.items()):
      if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
        continue
      if math.isfinite(value):
        self._writer.add_scalar(key, float(value), global_step=step)
    self._writer.flush()

  def add_text(self, tag: str, text: str, step: int) -> None:
    """A markdown text entry at ``step`` (held-out samples, observe/samples.py)."""
    if self._writer is None:
      return
    self._writer.add_text(tag, text, global_step=int(step))
    self._writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None
