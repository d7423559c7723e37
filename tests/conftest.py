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
# bitwise equal either way (docs/development.md "Tests").  DISTFLOW_TEST_XLA_DEFAULTS=1 keeps XLA's own
# emitters.  Every process a test starts inherits the flag.
if os.environ.get("DISTFLOW_TEST_XLA_DEFAULTS") != "1" and (
    "--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]):
  os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# LLVM at optimization level 0 instead of XLA's default: the same HLO programs, compiled
# without LLVM's optimization passes (the suite's tiny programs run in microseconds either
# way): the whole suite in about 70% of the CPU seconds it took at level 1, and level 1
# about 75% of the default level's (docs/development.md "Tests").  The code it emits may round
# differently in the last bit from the default level's, so the claims of bitwise equality
# across layouts and processes (marked ``reduction_order``, tests/isa.py) run their
# processes at XLA's default level, as users' runs do, and the in-process bitwise claims
# that differ by an ulp at level 0 (marked ``llvm_level1``) run in a pytest of their own at
# level 1 (below).  DISTFLOW_TEST_XLA_DEFAULTS=1 keeps the default level everywhere.
SUITE_LEVEL_FLAG = "--xla_backend_optimization_level=0"
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

# One cache of the built-in tasks' generated splits for the session (tasks/split_cache.py):
# every run of a built-in task draws the same 20,000 training rows, about 0.35 s a process
# (6.6% of the CPU of the multi-process files).  Never the home folder: a folder of the
# session's own, made by the controller and removed by it; DISTFLOW_JAX_DATA_CACHE="" (or
# any folder) set beforehand is kept.
if "DISTFLOW_JAX_DATA_CACHE" not in os.environ:
  import tempfile
  _DATA_CACHE = os.environ["DISTFLOW_JAX_DATA_CACHE"] = tempfile.mkdtemp(prefix="distflow-data-")
else:
  _DATA_CACHE = None

SHARED_CACHE_VARS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                     "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "DISTFLOW_TEST_SHARE_BINARIES",
                     "JAX_SHARE_BINARY_BETWEEN_HOSTS")


def suite_flags(env, devices: int | None = None, level: int | None = None) -> dict:
  """A copy of ``env`` whose XLA_FLAGS keep the suite's (its LLVM level, legacy emitters:
  far less CPU a compile) without its 8 simulated devices, or with ``devices`` of them: for a
  process that sets its own count, as a user's run does; ``level``: that LLVM level instead
  of the suite's."""
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")
           and (level is None or not f.startswith("--xla_backend_optimization_level"))]
  if devices:
    flags.append(f"--xla_force_host_platform_device_count={devices}")
  if level is not None:
    flags.append(f"--xla_backend_optimization_level={level}")
  env = dict(env, XLA_FLAGS=" ".join(flags))
  if not flags:
    env.pop("XLA_FLAGS")
  return env


def without_shared_cache(env) -> dict:
  """A copy of ``env`` without the suite's shared compilation cache: its processes compile."""
  return {k: v for k, v in env.items() if k not in SHARED_CACHE_VARS}


def pytest_unconfigure(config):
  if hasattr(config, "workerinput"):
    return
  import shutil
  if _OWNS_CACHE:
    shutil.rmtree(_SHARED_CACHE, ignore_errors=True)
  if _DATA_CACHE:
    shutil.rmtree(_DATA_CACHE, ignore_errors=True)


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


# A test marked ``llvm_level1`` claims bitwise equality that holds in code LLVM optimized
# (XLA's default level and level 1) and not at level 0, where the suite compiles (about half
# the CPU seconds of level 1 on its compile-bound tests): it runs in a pytest of its own at
# level 1, which is the result reported.  The flag is read when a process starts jax, so
# the test cannot switch in this worker.  The child has a SIGKILL deadline: the test's
# time limit.
LEVEL1_MARK = "llvm_level1"
_IN_CHILD = "DISTFLOW_TEST_LEVEL1_CHILD"


def _level1_env() -> dict:
  env = suite_flags(os.environ, level=1)  # the child's conftest sets its 8 devices again
  env[_IN_CHILD] = "1"
  for key in ("DISTFLOW_TEST_CPU_LOG", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT",
              "PYTEST_ADDOPTS"):
    env.pop(key, None)  # the parent records the child's CPU as its own test's
  return env


def _needs_child(item) -> bool:
  if item.get_closest_marker(LEVEL1_MARK) is None or os.environ.get(_IN_CHILD) == "1":
    return False
  levels = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if f.startswith("--xla_backend_optimization_level=")]
  return bool(levels) and levels[-1].split("=", 1)[1] == "0"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
  if not _needs_child(pyfuncitem):
    return None
  import signal
  import subprocess
  mark = pyfuncitem.get_closest_marker("timeout")
  limit = float(mark.args[0]) if mark and mark.args else float(
      pyfuncitem.config.getini("timeout") or 300)
  cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x",
         "-o", f"timeout={limit}", pyfuncitem.nodeid]
  child = subprocess.Popen(cmd, cwd=str(pyfuncitem.config.rootpath), env=_level1_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           stdin=subprocess.DEVNULL, start_new_session=True)
  try:  # a little under the test's own limit, so this deadline, not the parent's, ends it
    out, _ = child.communicate(timeout=max(limit - 10, 1))
  except subprocess.TimeoutExpired:
    os.killpg(child.pid, signal.SIGKILL)
    out, _ = child.communicate()
    pytest.fail(f"the level-1 run of {pyfuncitem.nodeid} ran past {limit - 10:.0f} s:\n"
                f"{out[-3000:]}")
  finally:  # interrupted (the parent's timeout, ^C): the child goes too
    if child.poll() is None:
      os.killpg(child.pid, signal.SIGKILL)
      child.wait()
  last = out.strip().splitlines()[-1] if out.strip() else ""
  if child.returncode == 0 and " skipped" in last and " passed" not in last:
    pytest.skip(f"at LLVM level 1: {last}")
  if child.returncode != 0 or " passed" not in last:
    pytest.fail(f"at LLVM level 1, in a pytest of its own (exit {child.returncode}):\n"
                f"{out[-6000:]}", pytrace=False)
  return True
