"""JAX's persistent compilation cache, and compile time counted apart from step time.

    directory = enable(cfg, log)           # train / sft, before the first compile
    counter = CompileCounter()             # listens to jax.monitoring from now on
    before = counter.snapshot(); ...; counter.since(before)   # {"compile/count": ...}

``trainer.compile_cache_dir`` (default ``~/.cache/distflow-jax/jax-<jax version>``,
``""`` = off) is where XLA keeps the executables it compiled, keyed by the program,
the devices and the jax/XLA versions: a second run of the same config loads them
instead of compiling.  The environment variable ``DISTFLOW_JAX_COMPILE_CACHE``, when
set, takes the place of the config's value (``""`` = off), for CI and tests that must
not write into a home folder; it is not part of the resolved config.  Every executable
is cached, however small or fast to compile (XLA:CPU ones included).  A folder that
cannot be written costs one line and the run goes on without the cache: the cache
only saves time, so a read-only home (a CI runner, a container) must not stop a run.

Compile time: jax reports each backend compile (``BACKEND_COMPILE_EVENT``, which also
wraps a persistent-cache load) and each cache hit; ``CompileCounter`` tallies, per
thread, real compiles (count and seconds) apart from cache loads.  It also counts the
run's programs (``Tally.programs``: executables compiled or loaded, eager operations
aside), the number ``plan --programs`` predicts: a program is a function defined outside
jax that was jitted (``is_program``); an eager ``jnp`` or ``lax`` operation compiles a
function jax defines.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

ENV = "DISTFLOW_JAX_COMPILE_CACHE"

# jax.monitoring event names (jax/_src/dispatch.py and jax/_src/compiler.py).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def configured_dir(cfg) -> str:
  """The cache folder this process uses: ``$DISTFLOW_JAX_COMPILE_CACHE`` when set, else
  ``trainer.compile_cache_dir``; ``~`` expanded; "" = off."""
  value = os.environ.get(ENV)
  if value is None:
    value = cfg.trainer.compile_cache_dir
  return os.path.expanduser(value) if value else ""


def _writable(directory: str) -> str | None:
  """None when ``directory`` can be created and written, else why not."""
  try:
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-"):
      pass
  except OSError as e:
    return e.strerror or type(e).__name__
  return None


def enable(cfg, log: Callable[[str], None] | None = None) -> str:
  """Points jax's persistent compilation cache at the configured folder (call it before
  anything compiles: jax decides once per process whether it uses a cache).  Returns the
  folder, or "" when the cache is off or the folder cannot be written (then one line
  goes to ``log`` and the run goes on without it)."""
  directory = configured_dir(cfg)
  if not directory:
    return ""
  why = _writable(directory)
  if why is not None:
    if log is not None:
      log(f"compile cache off: cannot write {directory} ({why}); set "
          f"--config.trainer.compile_cache_dir=DIR or {ENV}=DIR (\"\" = off)")
    return ""
  import jax
  jax.config.update("jax_compilation_cache_dir", directory)
  # Cache every executable: the defaults skip those compiled in under a second, which are
  # most of a small model's on CPU (and many small ones add up).
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  # XLA:GPU's per-fusion autotune results beside the executables (jax's companion cache,
  # in <folder>/xla_gpu_per_fusion_autotune_cache_dir): a second run skips autotuning too.
  # Said here rather than left to jax's default; JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES,
  # when set, is the user's choice and stays.
  if "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES" not in os.environ:
    jax.config.update("jax_persistent_cache_enable_xla_caches",
                      "xla_gpu_per_fusion_autotune_cache_dir")
  _enabled.append(directory)
  return directory


_enabled: list[str] = []  # the folders enable() set in this process


def active() -> bool:
  """Whether this process turned the run's cache on (``enable`` set a folder).  A cache
  set through jax's own settings alone (``JAX_COMPILATION_CACHE_DIR``) is used for every
  compile but does not count here: ``compile_ahead=auto`` follows the run's setting."""
  return bool(_enabled)


def _jax_dirs() -> tuple[str, ...]:
  import jax
  import jaxlib
  return tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (jax, jaxlib))


def is_program(frame: Any, jax_dirs: tuple[str, ...]) -> bool:
  """Whether the backend compile running under ``frame`` builds a program of the run
  rather than an eager operation: the jitted function's source (the ``jaxpr`` a jit
  call compiles, found up the stack) lies outside jax.  A compile with no such jaxpr
  up the stack is an explicit ``lower(...).compile()``: a program."""
  while frame is not None:
    jaxpr = frame.f_locals.get("jaxpr") if frame.f_code.co_filename.startswith(jax_dirs) \
        else None
    info = getattr(getattr(jaxpr, "jaxpr", None), "debug_info", None)
    src = getattr(info, "func_src_info", None)
    if isinstance(src, str):
      path = src.rpartition(" at ")[2]
      return not os.path.abspath(path).startswith(jax_dirs)
    frame = frame.f_back
  return True


@dataclasses.dataclass(frozen=True)
class Tally:
  compiles: int = 0          # backend compiles that were not persistent-cache hits
  compile_s: float = 0.0
  cache_hits: int = 0        # executables loaded from the persistent cache
  cache_load_s: float = 0.0
  programs: int = 0          # of both, those of the run's programs (not eager operations)

  def __sub__(self, other: "Tally") -> "Tally":
    return Tally(self.compiles - other.compiles, self.compile_s - other.compile_s,
                 self.cache_hits - other.cache_hits, self.cache_load_s - other.cache_load_s,
                 self.programs - other.programs)

  def metrics(self) -> dict[str, float]:
    return {"compile/count": float(self.compiles), "time/compile": self.compile_s,
            "compile/cache_hits": float(self.cache_hits),
            "compile/cache_load_s": self.cache_load_s}


class CompileCounter:
  """Counts this process's backend compiles and persistent-cache loads from its creation
  on (jax.monitoring listeners, registered once per process and shared)."""

  _lock = threading.Lock()
  _total = Tally()
  _registered = False
  _local = threading.local()
  _jax_dirs: tuple[str, ...] = ()

  def __init__(self):
    cls = type(self)
    with cls._lock:
      if not cls._registered:
        from jax import monitoring
        monitoring.register_event_listener(cls._on_event)
        monitoring.register_event_duration_secs_listener(cls._on_duration)
        cls._jax_dirs = _jax_dirs()
        cls._registered = True

  @classmethod
  def _on_event(cls, event: str, **kwargs) -> None:
    if event == CACHE_HIT_EVENT:  # fired inside the backend-compile span it ends
      cls._local.hit = True

  @classmethod
  def _on_duration(cls, event: str, duration: float, **kwargs) -> None:
    if event != BACKEND_COMPILE_EVENT:
      return
    hit = getattr(cls._local, "hit", False)
    cls._local.hit = False
    program = int(is_program(sys._getframe(1), cls._jax_dirs))
    with cls._lock:
      t = cls._total
      cls._total = (Tally(t.compiles, t.compile_s, t.cache_hits + 1, t.cache_load_s + duration,
                          t.programs + program)
                    if hit else
                    Tally(t.compiles + 1, t.compile_s + duration, t.cache_hits, t.cache_load_s,
                          t.programs + program))

  def snapshot(self) -> Tally:
    with self._lock:
      return type(self)._total

  def since(self, before: Tally) -> Tally:
    return self.snapshot() - before
