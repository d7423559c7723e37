"""A line every few seconds while a long, silent phase runs (compiling, a first chunk).

    with heartbeat(log, "compile and first step", every_s=15):
      metrics = executor.run_step(...)     # 286 s of compiling: a line every 15 s
    # [  45.2s] compile and first step: still running, 45 s

A background thread prints while the main thread is inside the ``with``; leaving it stops
the thread before the block's result goes on, and no line is printed after the phase ends
(the thread checks and prints under the same lock that ending the phase takes).
``every_s <= 0`` prints nothing; ``log`` is any ``str -> None`` (a progress Logger,
print to stderr).  ``logging.heartbeat_s`` sets the interval for train, eval and generate.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator


class Heartbeat:
  """The thread behind ``heartbeat``; ``stop`` returns once it can print no more."""

  def __init__(self, log: Callable[[str], None], name: str, every_s: float):
    self.log, self.name, self.every_s = log, name, every_s
    self.start = time.perf_counter()
    self.beats = 0
    self._lock = threading.Lock()
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._run, name=f"heartbeat: {name}", daemon=True)

  def _run(self) -> None:
    while not self._done.wait(self.every_s):
      with self._lock:
        if self._done.is_set():
          return
        self.beats += 1
        self.log(f"{self.name}: still running, {time.perf_counter() - self.start:.0f} s")

  def begin(self) -> "Heartbeat":
    self._thread.start()
    return self

  def stop(self) -> None:
    with self._lock:  # a beat being printed finishes first; none starts after this
      self._done.set()
    self._thread.join()


@contextlib.contextmanager
def heartbeat(log: Callable[[str], None] | None, name: str,
              every_s: float) -> Iterator[Heartbeat | None]:
  """Prints ``<name>: still running, <s> s`` every ``every_s`` seconds while the block runs
  (nothing with no ``log`` or ``every_s <= 0``)."""
  if log is None or every_s <= 0:
    yield None
    return
  beat = Heartbeat(log, name, every_s).begin()
  try:
    yield beat
  finally:
    beat.stop()


def interval(cfg) -> float:
  """``logging.heartbeat_s`` of a config (the default where a config has none)."""
  logging_cfg = cfg.get("logging") if hasattr(cfg, "get") else None
  value = logging_cfg.get("heartbeat_s") if logging_cfg is not None else None
  return float(DEFAULT_S if value is None else value)


DEFAULT_S = 15.0
