"""A line every few seconds while a long, silent phase runs (compiling, a first chunk).

    with heartbeat(log, "compile and first step", every_s=15):
      metrics = executor.run_step(...)     # 286 s of compiling: a line every 15 s
    # [  45.2s] compile and first step: still running, 45 s

Who prints.  A compile can hold Python's GIL for minutes (XLA's passes, MLIR's), and a
thread of this process then prints nothing: a 5.5-minute silence was seen in a first step.
So where the log writes to a file descriptor (a progress ``Logger`` on a terminal, a pipe,
a file: ``Logger.heartbeat_sink``), a small child process prints the lines, with the log's
own ``[   t s]`` prefix; nothing this process does can stop it.  The child is ``python -S
-I`` with a few lines of standard library (``CHILD``); it ends when the phase ends, when
this process dies (its stdin closes), or after ``MAX_LIFE_S``.  A plain callable
(``print`` to stderr, a test's list) gets a thread instead.

Leaving the ``with`` stops the printer before the block's result goes on, and no line is
printed after the phase ends: the thread checks and prints under the same lock that ending
the phase takes; the child is waited for (killed after ``STOP_WAIT_S``).
``every_s <= 0`` prints nothing; ``logging.heartbeat_s`` sets the interval for train, eval
and generate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

MAX_LIFE_S = 24 * 3600.0  # a child outliving any phase is killed by its own deadline
STOP_WAIT_S = 5.0


@dataclasses.dataclass(frozen=True)
class Sink:
  """Where a child process writes a log's heartbeat lines: the descriptor, the clock origin
  of the log's ``[   t s]`` prefix (a ``time.perf_counter()`` value: the same clock in
  every process of the machine), and whether it is a terminal (lines clear the one drawn
  in place first)."""
  fd: int
  start: float
  tty: bool


# What a long compile's heartbeat says once, past SLOW_COMPILE_AFTER_S: XLA's own timer
# prints "Very slow compile? If you want to file a bug, ..." at error level (from its
# slow_operation_alarm.cc) during such a compile, which reads as a failure and is not one.
SLOW_COMPILE_NOTE = ("XLA may print 'Very slow compile? If you want to file a bug...' meanwhile: "
                     "its own timer, not an error; the run goes on")
SLOW_COMPILE_AFTER_S = 60.0

# The child: argv fd, log start, phase start, every_s, tty, deadline, note_after_s, note,
# name.  It prints a line every every_s (the note on the first at or past note_after_s)
# until its stdin says anything or closes.
CHILD = r"""
import os, select, sys, time
fd, start, began, every = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
tty, deadline, name = sys.argv[5] == "1", time.perf_counter() + float(sys.argv[6]), sys.argv[9]
note_after, note = float(sys.argv[7]), sys.argv[8]
due = began + every
while True:
  now = time.perf_counter()
  if now >= deadline or select.select([0], [], [], max(0.0, min(due, deadline) - now))[0]:
    break
  now = time.perf_counter()
  if now >= due:
    line = "[%7.1fs] %s: still running, %.0f s" % (now - start, name, now - began)
    if note and now - began >= note_after:
      line, note = line + " (" + note + ")", ""
    line += "\n"
    os.write(fd, (("\r\x1b[K" if tty else "") + line).encode())
    due += every
"""


class Heartbeat:
  """The thread behind ``heartbeat`` (a plain callable); ``stop`` returns once it can print
  no more."""

  def __init__(self, log: Callable[[str], None], name: str, every_s: float,
               note: str = "", note_after_s: float = 0.0):
    self.log, self.name, self.every_s = log, name, every_s
    self.note, self.note_after_s = note, note_after_s
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
        took = time.perf_counter() - self.start
        line = f"{self.name}: still running, {took:.0f} s"
        if self.note and took >= self.note_after_s:
          line, self.note = f"{line} ({self.note})", ""
        self.log(line)

  def begin(self) -> "Heartbeat":
    self._thread.start()
    return self

  def stop(self) -> None:
    with self._lock:  # a beat being printed finishes first; none starts after this
      self._done.set()
    self._thread.join()


class ChildHeartbeat:
  """The child process behind ``heartbeat`` (a log with a ``Sink``)."""

  def __init__(self, sink: Sink, name: str, every_s: float, note: str = "",
               note_after_s: float = 0.0):
    self.sink, self.name, self.every_s = sink, name, every_s
    self.note, self.note_after_s = note, note_after_s
    self.start = time.perf_counter()
    self.proc: subprocess.Popen | None = None

  def begin(self) -> "ChildHeartbeat":
    fd = os.dup(self.sink.fd)  # a number of its own: the child's 0-2 are its pipes
    try:
      self.proc = subprocess.Popen(
          [sys.executable, "-S", "-I", "-c", CHILD, str(fd), repr(self.sink.start),
           repr(self.start), repr(self.every_s), "1" if self.sink.tty else "0",
           repr(MAX_LIFE_S), repr(self.note_after_s), self.note, self.name],
          stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
          pass_fds=(fd,), close_fds=True)
    finally:
      os.close(fd)
    return self

  def stop(self) -> None:
    proc, self.proc = self.proc, None
    if proc is None:
      return
    try:
      proc.stdin.write(b"stop\n")
      proc.stdin.close()
    except OSError:  # it has gone already
      pass
    try:
      proc.wait(timeout=STOP_WAIT_S)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()


def _sink(log: Callable[[str], None]) -> Sink | None:
  get = getattr(log, "heartbeat_sink", None)
  return get() if callable(get) else None


@contextlib.contextmanager
def heartbeat(log: Callable[[str], None] | None, name: str, every_s: float,
              compiles: bool = False) -> Iterator[Heartbeat | ChildHeartbeat | None]:
  """Prints ``<name>: still running, <s> s`` every ``every_s`` seconds while the block runs
  (nothing with no ``log`` or ``every_s <= 0``); ``compiles``: the block compiles, and a
  beat past ``SLOW_COMPILE_AFTER_S`` says once what XLA's slow-compile line means."""
  if log is None or every_s <= 0:
    yield None
    return
  sink = _sink(log)
  note = (SLOW_COMPILE_NOTE, SLOW_COMPILE_AFTER_S) if compiles else ("", 0.0)
  beat = (ChildHeartbeat(sink, name, every_s, *note) if sink is not None
          else Heartbeat(log, name, every_s, *note)).begin()
  try:
    yield beat
  finally:
    beat.stop()


def interval(cfg) -> float:
  """``logging.heartbeat_s`` of a run config."""
  return float(cfg.logging.heartbeat_s)
