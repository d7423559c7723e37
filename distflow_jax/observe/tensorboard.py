"""TensorBoard event files for a run's metrics (``tensorboard --logdir RUN_DIR``).

Written with ``tensorboardX``, which needs neither TensorFlow nor PyTorch.
Only process 0 writes, in ``run_dir/tensorboard``; every numeric metric of a
row becomes a scalar at that row's ``step``, and held-out samples
(observe/samples.py) are text entries.  Where tensorboardX is not installed
the run goes on with metrics.jsonl only, after one warning.

Events are written in the calling thread (tensorboardX's ``EventsWriter``), not through
``SummaryWriter``'s background thread: that thread, on a full disk, died with its own
traceback on stderr beside the command's one line, and dropped every later event.  Here
a failed write raises in the run's thread, where the command names the file.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Any

log = logging.getLogger(__name__)

SUBDIR = "tensorboard"


def _import_tensorboardx():
  """tensorboardX's modules for scalars, text and event files, imported with torch hidden.

  Its package ``__init__`` imports its ``SummaryWriter``, which imports torch where torch is
  installed (the ``hf`` extra), only to accept torch tensors, which no run passes: 1.5 s of
  every run's start with torch's bytecode cached, about 3 s without.  ``None`` in
  ``sys.modules`` makes that ``import torch`` fail as if torch were absent (tensorboardX
  catches the ImportError); a process that has already loaded torch keeps it."""
  hide = "torch" not in sys.modules
  if hide:
    sys.modules["torch"] = None  # type: ignore[assignment]
  try:
    from tensorboardX import summary
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto import event_pb2
  finally:
    if hide and sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return summary, EventsWriter, event_pb2


class TensorBoardWriter:
  """``write(row)`` like JsonlWriter; flushes every row so a crash loses nothing."""

  def __init__(self, logdir: str, enabled: bool):
    self.logdir = logdir
    self._writer = None
    if not enabled:
      return
    try:
      summary, EventsWriter, event_pb2 = _import_tensorboardx()
    except ImportError:
      log.warning("tensorboardX is not installed: no TensorBoard event files (metrics.jsonl "
                  "is still written); `pip install tensorboardX` to get them")
      return
    os.makedirs(logdir, exist_ok=True)
    self._summary, self._event = summary, event_pb2.Event
    # "events" + ".out.tfevents.<time>.<host>": the file name SummaryWriter gives.
    self._writer = EventsWriter(os.path.join(logdir, "events"))

  def _add(self, value, step: int) -> None:
    self._writer.write_event(self._event(summary=value, step=step, wall_time=time.time()))

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
        self._add(self._summary.scalar(key, float(value)), step)
    self._writer.flush()

  def add_text(self, tag: str, text: str, step: int) -> None:
    """A markdown text entry at ``step`` (held-out samples, observe/samples.py)."""
    if self._writer is None:
      return
    self._add(self._summary.text(tag, text), int(step))
    self._writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None
