"""The instruction sets a bitwise claim across layouts or processes is checked on.

XLA's CPU code may sum in another order on another instruction set (AVX-512 or not), so a
result that is bitwise equal across layouts on one CPU kind could differ on another.  The
tests that claim such equality (marked ``reduction_order``) take ``isa`` as a parameter and
run their processes once on the CPU's own instruction set and once with XLA's CPU code
capped at AVX2 (every side of the comparison under the same cap: the flag is read when a
process starts jax, so each side is a process of its own).  One pytest run holds both; the
cap has its own compilation-cache entries (XLA flags are part of the key).  Both run at
XLA's default LLVM optimization level, whatever level the rest of the suite compiles at."""

from __future__ import annotations

import functools
import os

import pytest

ISAS = ("native", "avx2")
_FLAGS = {"native": "", "avx2": "--xla_cpu_max_isa=AVX2"}


@functools.cache
def beyond_avx2() -> bool:
  """Whether this CPU has AVX-512 (Linux's /proc/cpuinfo; elsewhere assumed so): without
  it, XLA capped at AVX2 compiles the native code again."""
  try:
    with open("/proc/cpuinfo") as f:
      return any(line.startswith("flags") and " avx512f" in line for line in f)
  except OSError:
    return True


def params() -> list:
  """``ISAS`` as pytest params: the AVX2 run is skipped on a CPU without AVX-512, where
  it would repeat the native run exactly."""
  skip = pytest.mark.skipif(not beyond_avx2(), reason="no AVX-512 here: capped at AVX2 "
                            "XLA runs the native code again")
  return [pytest.param("native"), pytest.param("avx2", marks=skip)]


def isa_env(isa: str, base: dict[str, str] | None = None) -> dict[str, str]:
  """The environment for a test's processes on ``isa`` (the launcher adds the device count)."""
  env = dict(os.environ if base is None else base)
  # XLA's default LLVM level, not the suite's level 1 (tests/conftest.py): the claim is
  # checked on the code users' runs compile.
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith(("--xla_cpu_max_isa", "--xla_backend_optimization_level"))]
  env["XLA_FLAGS"] = " ".join(flags + ([_FLAGS[isa]] if _FLAGS[isa] else []))
  return env
