"""Test set-up: an 8-device simulated CPU mesh, fixed before jax is imported."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split()
     if not f.startswith("--xla_force_host_platform_device_count")]
    + ["--xla_force_host_platform_device_count=8"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Spawned children must not inherit the parent's 8 devices by accident: the
# launcher sets their count explicitly.
