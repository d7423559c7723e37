"""Test set-up: an 8-device simulated CPU mesh, fixed before jax is imported."""

import os
import sys

# Python's bytecode cache, for this process and every process the suite starts: where
# PYTHONDONTWRITEBYTECODE is set (it is on this project's machines and CI) and the install
# is ``--no-compile``, each of the hundreds of processes the suite starts compiled the
# sources of jax, flax, orbax, torch and this package anew: 3.9 of a tiny 3-step train
# run's 10.5 CPU seconds.  The first process to import a module writes its .pyc (atomically,
# beside the source) and the others read it.  DISTFLOW_TEST_KEEP_BYTECODE_ENV=1 leaves the
# setting as it is.
if os.environ.get("DISTFLOW_TEST_KEEP_BYTECODE_ENV") != "1":
  os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
  sys.dont_write_bytecode = False

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split()
     if not f.startswith("--xla_force_host_platform_device_count")]
    + ["--xla_force_host_platform_device_count=8"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Spawned children must not inherit the parent's 8 devices by accident: the
# launcher sets their count explicitly.
# XLA's CPU backend emits each fusion straight to LLVM IR (its legacy emitters) instead of
# through its MLIR fusion emitters: the same HLO programs, about 15-20% less CPU to compile
# each (compiling is most of the suite's time), and a grpo:tiny run's metrics and samples
# bitwise equal either way (README "Tests").  DISTFLOW_TEST_XLA_DEFAULTS=1 keeps XLA's own
# emitters.  Every process a test starts inherits the flag.
if os.environ.get("DISTFLOW_TEST_XLA_DEFAULTS") != "1" and (
    "--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]):
  os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# LLVM at optimization level 1 instead of XLA's default: the same HLO programs, the whole
# suite in about three quarters of the CPU seconds (README "Tests"); the code it emits may round
# differently in the last bit from the default level's, so the claims of bitwise equality
# across layouts and processes (marked ``reduction_order``, tests/isa.py) run their
# processes at XLA's default level, as users' runs do.  DISTFLOW_TEST_XLA_DEFAULTS=1 keeps
# the default level everywhere.
SUITE_LEVEL_FLAG = "--xla_backend_optimization_level=1"
if os.environ.get("DISTFLOW_TEST_XLA_DEFAULTS") != "1" and (
    "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]):
  os.environ["XLA_FLAGS"] += " " + SUITE_LEVEL_FLAG

# No persistent compile cache in the suite (trainer.compile_cache_dir defaults to a folder in
# the home directory): runs compile as they always did and nothing is written outside
# tmp_path.  tests/test_compile_cache.py sets its own folder per run.
os.environ.setdefault("DISTFLOW_JAX_COMPILE_CACHE", "")

# One persistent XLA compilation cache for the whole pytest session, shared by the xdist
# workers and every process a test starts (they inherit these variables): many tests build
# the same tiny models and compile the same programs, and a program compiled once is then
# loaded.  It is jax's own setting (read from the environment when jax is imported), not
# the run's ``trainer.compile_cache_dir``, so compile_cache.active() stays False and
# ``compile_ahead=auto`` behaves as with no cache; tests of the run's cache give their
# runs their own folder and drop these variables.  DISTFLOW_TEST_XLA_CACHE="" turns it
# off (a run of the suite as before); a folder that is set is used as it is.
_SHARED_CACHE = os.environ.get("DISTFLOW_TEST_XLA_CACHE")
if _SHARED_CACHE is None and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import tempfile
  _SHARED_CACHE = os.environ["DISTFLOW_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="distflow-xla-")
  _OWNS_CACHE = True  # the process that made it (the xdist controller) removes it
else:
  _OWNS_CACHE = False
if _SHARED_CACHE:
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _SHARED_CACHE)
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
  # With it, a multi-process run's programs are compiled once, by the process holding their
  # first device, and handed to the others (tests/share_site/sitecustomize.py says how);
  # without, each process of a run compiles every program itself.
  # DISTFLOW_TEST_SHARE_BINARIES=0 turns the sharing off.
  if os.environ.setdefault("DISTFLOW_TEST_SHARE_BINARIES", "1") == "1":
    os.environ.setdefault("JAX_SHARE_BINARY_BETWEEN_HOSTS", "true")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(os.path.dirname(os.path.abspath(__file__)), "share_site")]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

SHARED_CACHE_VARS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                     "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "DISTFLOW_TEST_SHARE_BINARIES",
                     "JAX_SHARE_BINARY_BETWEEN_HOSTS")


def suite_flags(env, devices: int | None = None) -> dict:
  """A copy of ``env`` whose XLA_FLAGS keep the suite's (level 1, legacy emitters: about a
  quarter less CPU a compile) without its 8 simulated devices, or with ``devices`` of them:
  for a process that sets its own count, as a user's run does."""
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  if devices:
    flags.append(f"--xla_force_host_platform_device_count={devices}")
  env = dict(env, XLA_FLAGS=" ".join(flags))
  if not flags:
    env.pop("XLA_FLAGS")
  return env


def without_shared_cache(env) -> dict:
  """A copy of ``env`` without the suite's shared compilation cache: its processes compile."""
  return {k: v for k, v in env.items() if k not in SHARED_CACHE_VARS}


def pytest_unconfigure(config):
  if _OWNS_CACHE and not hasattr(config, "workerinput"):
    import shutil
    shutil.rmtree(_SHARED_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
  """Modules holding a test marked ``slow`` or ``multiprocess`` run first, each module's tests
  kept together and in order (module fixtures are built once): under ``-n 2 --dist
  worksteal`` a worker that runs out steals the other's queued tail, which is then short
  in-process tests, so the two workers finish together instead of one running a two-minute
  test alone at the end.  A multi-process test starts 1 to 4 processes of its own; begun
  early, they overlap the other worker's long queue."""
  first = {item.module.__name__ for item in items
           if item.get_closest_marker("slow") or item.get_closest_marker("multiprocess")}
  items.sort(key=lambda item: item.module.__name__ not in first)


# DISTFLOW_TEST_CPU_LOG=FILE: each test's CPU seconds, wall seconds and XLA compiles, one JSON
# line each (tests/cpu_profile.py; tools/test_cpu_report.py sums them).
import pytest  # noqa: E402

import cpu_profile  # noqa: E402


def pytest_configure(config):
  if cpu_profile.enabled():
    cpu_profile.listen()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  if not cpu_profile.enabled():
    yield
    return
  started = cpu_profile.start()
  yield
  cpu_profile.record(item.nodeid, started)
