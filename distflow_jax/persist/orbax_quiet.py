"""A failed orbax save as one error, not pages of tracebacks from its threads.

orbax's background threads log every failed save as an ERROR with a traceback (absl
logging), once per thread that saw it: a full disk printed 14 of them before the command's
own line.  The same error is raised again in the main thread (``wait_until_finished``),
where the command turns it into one line naming the path (distflow_jax/io_errors.py), so
those records are dropped here; the last one is kept (``last_dropped``).

And when one write of a save fails, ``asyncio.gather`` gives up at once, orbax closes the
save's event loop, and every other TensorStore write still in flight then posts its result
to the closed loop from a C++ thread, which prints ``RuntimeError: Event loop is closed``
(up to 30 tracebacks, straight to stderr).  ``install`` has orbax's private loop runner
(``asyncio_utils._run_sync_via_new_loop``) let those writes finish (``DRAIN_S`` at most)
before it closes the loop; where orbax no longer has that function nothing is patched.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

DRAIN_S = 30.0
_state: dict[str, Any] = {"last": None, "patched": False}


class _DropOrbaxErrors(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno >= logging.ERROR and "/orbax/" in record.pathname.replace("\\", "/"):
      _state["last"] = record.getMessage()
      return False
    return True


_FILTER = _DropOrbaxErrors()


def run_draining(coro):
  """orbax's ``_run_sync_via_new_loop`` (a fresh loop, no asyncio.run teardown), except
  that a failure first waits for the loop's other tasks, so none outlives the loop."""
  loop = asyncio.new_event_loop()
  try:
    asyncio.set_event_loop(loop)
    try:
      return loop.run_until_complete(coro)
    except BaseException:
      pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
      if pending:
        loop.run_until_complete(asyncio.wait(pending, timeout=DRAIN_S))
      for t in pending:  # their errors are the same disk's: retrieved, not logged again
        if t.done() and not t.cancelled():
          t.exception()
      raise
  finally:
    asyncio.set_event_loop(None)
    loop.close()


def install() -> None:
  """Drops orbax's ERROR records from the ``absl`` logger and has orbax's loop runner drain
  a failed save's writes (idempotent)."""
  logger = logging.getLogger("absl")
  if _FILTER not in logger.filters:
    logger.addFilter(_FILTER)
  if not _state["patched"]:
    from orbax.checkpoint._src import asyncio_utils  # pylint: disable=import-outside-toplevel
    if callable(getattr(asyncio_utils, "_run_sync_via_new_loop", None)):
      asyncio_utils._run_sync_via_new_loop = run_draining  # pylint: disable=protected-access
    _state["patched"] = True


def last_dropped() -> str | None:
  return _state["last"]
