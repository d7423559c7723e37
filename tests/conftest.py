"""Test set-up: an 8-device simulated CPU mesh, fixed before jax is imported."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split()
     if not f.startswith("--xla_force_host_platform_device_count")]
    + ["--xla_force_host_platform_device_count=8"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Spawned children must not inherit the parent's 8 devices by accident: the
# launcher sets their count explicitly.

# No persistent compile cache in the suite (trainer.compile_cache_dir defaults to a folder in
# the home directory): runs compile as they always did and nothing is written outside
# tmp_path.  tests/test_compile_cache.py sets its own folder per run.
os.environ.setdefault("DISTFLOW_JAX_COMPILE_CACHE", "")


def pytest_collection_modifyitems(config, items):
  """Modules holding a test marked ``slow`` run first, each module's tests kept together and
  in order (module fixtures are built once): under ``-n 2 --dist worksteal`` a worker that
  runs out steals the other's queued tail, which is then short tests, so the two workers
  finish together instead of one running a two-minute test alone at the end."""
  slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
  items.sort(key=lambda item: item.module.__name__ not in slow)
