"""Where the suite's time goes, measured so that a busy machine does not blur it: with
``DISTFLOW_TEST_CPU_LOG=FILE`` set, tests/conftest.py records one JSON line per test: the
CPU seconds of the test's process (all its threads) and of the processes it started and
waited for, its wall seconds, and the XLA compiles of its own process (count, seconds) and
persistent-cache hits.  CPU seconds hardly change with load where wall seconds do; on a
machine of N cores the suite cannot take less than the sum of CPU seconds over N.
``python tools/test_cpu_report.py FILE`` sums the lines by file and test."""

from __future__ import annotations

import collections
import json
import os
import resource
import time

ENV = "DISTFLOW_TEST_CPU_LOG"
_EVENTS: collections.Counter = collections.Counter()
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
HIT_EVENT = "/jax/compilation_cache/cache_hits"


def enabled() -> bool:
  return bool(os.environ.get(ENV))


def listen() -> None:
  """Counts this process's XLA compiles and cache hits (jax's monitoring events)."""
  from jax._src import monitoring  # pylint: disable=import-outside-toplevel

  def on_duration(event, duration, **_):
    if event == COMPILE_EVENT:
      _EVENTS["compiles"] += 1
      _EVENTS["compile_s"] += duration

  def on_event(event, **_):
    if event == HIT_EVENT:
      _EVENTS["hits"] += 1
  monitoring.register_event_duration_secs_listener(on_duration)
  monitoring.register_event_listener(on_event)


def _cpu() -> tuple[float, float]:
  own = resource.getrusage(resource.RUSAGE_SELF)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def start() -> tuple:
  return _cpu(), time.monotonic(), dict(_EVENTS)


def record(nodeid: str, started: tuple) -> None:
  (own0, kids0), t0, events0 = started
  own, kids = _cpu()
  row = {"id": nodeid, "cpu_s": round(own - own0, 2), "children_cpu_s": round(kids - kids0, 2),
         "wall_s": round(time.monotonic() - t0, 2),
         **{k: round(_EVENTS[k] - events0.get(k, 0), 2) for k in ("compiles", "compile_s", "hits")}}
  with open(os.environ[ENV], "a", encoding="utf-8") as f:  # one short line: xdist-safe
    f.write(json.dumps(row) + "\n")
