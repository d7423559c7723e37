"""Ctrl-C and SIGTERM held back while a checkpoint save starts.

A save's synchronous part (its checksums, the reference and tokenizer written once, the
loaders' state gathered, orbax's save issued) can take seconds, the first one longest.  A
Ctrl-C landing there raised inside it, so no save was in flight to let finish, and the step
just trained was lost ("no checkpoint was saved") though the docs promise that a save in
flight finishes.  Inside ``deferred()`` the first such signal is noted and takes effect
as the block ends, with the save then in flight (the train command's handler waits for
it); a second one takes effect at once, as a second Ctrl-C abandons a save.

    with deferred_signals.deferred():
      checkpointer.save(step, ...)

Handlers can be set only from the main thread; elsewhere the block runs as it is.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _deliver(signum: int, previous) -> None:
  """Has ``previous`` (the handler in place before the block) act on ``signum``."""
  if callable(previous):
    previous(signum, None)
  elif previous == signal.SIG_DFL:
    os.kill(os.getpid(), signum)  # its default action, now that the handler is back


@contextlib.contextmanager
def deferred(signums: tuple[int, ...] = SIGNALS) -> Iterator[None]:
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  came: list[int] = []
  previous = {s: signal.getsignal(s) for s in signums}

  def restore() -> None:
    for s, h in previous.items():
      signal.signal(s, h)

  def handler(signum, frame):  # pylint: disable=unused-argument
    came.append(signum)
    if len(came) > 1:  # the second: now, as it would have been without the block
      restore()
      _deliver(signum, previous[signum])

  for s in signums:
    signal.signal(s, handler)
  try:
    yield
  finally:
    restore()
  if came:
    _deliver(came[0], previous[came[0]])
