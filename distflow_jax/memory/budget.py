"""What jax can use of one device (``plan --memory --device_memory``'s budget).

On a GPU jax's allocator takes a fraction of the memory (``XLA_CLIENT_MEM_FRACTION`` or
the deprecated ``XLA_PYTHON_CLIENT_MEM_FRACTION``, else 0.75) and a reserve comes off it
for what the CPU-compiled figures do not hold (``GPU_RESERVE``); a TPU keeps
``TPU_RESERVE`` for its runtime; a CPU counts all of it.  This module owns those
allowances, :class:`Budget` (the usable bytes and the reasoning behind them) and
:func:`budget`, which reads the environment as jax would on the device.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from distflow_jax.config.errors import ConfigError
from distflow_jax.memory import analytic as an
from distflow_jax.models import target as target_lib

# What comes off jax's share of a device beside the compiled figures (stated allowances,
# not measured here).  GPU: XLA:GPU allocates cuBLAS/cuBLASLt workspaces (up to 32 MiB
# per GEMM on Hopper) and cuDNN's fused-attention workspaces as buffers of its own pool,
# which a CPU compile does not have, and the BFC pool fragments; NCCL's communicator
# buffers (NCCL_BUFFSIZE 4 MiB x channels x peers) and the CUDA context (~0.5 GB) live
# outside the pool, in the (1 - fraction) jax leaves.  TPU: the runtime keeps part of HBM
# (memory_stats()['bytes_limit'] is below the HBM size; check it on the device).
GPU_RESERVE = 1 << 30
TPU_RESERVE = 1 << 29
GPU_DEFAULT_FRACTION = 0.75  # jax's preallocated share when no fraction is set
# Outside jax's pool a GPU still needs the CUDA context, library handles and NCCL's
# buffers: a fraction that leaves less than this is flagged.
GPU_OUTSIDE_POOL = 2 * 10**9


@dataclasses.dataclass(frozen=True)
class Budget:
  """What jax can use of one device: ``device_memory x fraction - reserve``, and why."""
  target: str
  platform: str      # "gpu", "tpu" or "cpu"
  device_memory: int
  fraction: float
  reserve: int
  why: tuple[str, ...]

  @property
  def usable(self) -> int:
    return int(self.device_memory * self.fraction) - self.reserve

  def lines(self) -> list[str]:
    head = (f"device: {self.platform} {self.target}, {an.fmt(self.device_memory)}; usable by "
            f"jax {an.fmt(self.usable)}")
    if self.fraction != 1.0 or self.reserve:
      head += (f" = {an.fmt(self.device_memory)} x {self.fraction:g} - "
               f"{an.fmt(self.reserve)} reserve")
    return [head] + [f"  budget: {w}" for w in self.why]


def budget(device_memory: int, target: str | None = None,
           env: Mapping[str, str] | None = None) -> Budget:
  """The usable memory of ``device_memory`` on ``target`` (models/target.py's names:
  h100, a100, tpu, cpu, ...; default a GPU), read with this process's environment
  (``env``) as jax would read it on the device.  ConfigError (one line) on a bad name or
  setting."""
  env = os.environ if env is None else env
  name = target or "gpu"
  try:
    tgt = target_lib.parse(name)
  except ValueError as e:
    raise ConfigError(f"--target: {e}") from None
  shown = tgt.name + ("" if target else " (the default; --target=tpu|cpu|... names another)")
  if tgt.platform is target_lib.Platform.CPU:
    return Budget(shown, "cpu", device_memory, 1.0, 0, (
        "a CPU host: all of it (no allocator pool, no reserve)",))
  if tgt.platform is target_lib.Platform.TPU:
    return Budget(shown, "tpu", device_memory, 1.0, TPU_RESERVE, (
        f"{an.fmt(TPU_RESERVE)} (0.5 GiB) reserve for the TPU runtime and program code (no "
        f"preallocated fraction on TPU; memory_stats()['bytes_limit'] on the device is "
        f"the exact figure)",))
  new, old = env.get("XLA_CLIENT_MEM_FRACTION", ""), env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
  if new and old:
    raise ConfigError("XLA_CLIENT_MEM_FRACTION and XLA_PYTHON_CLIENT_MEM_FRACTION are both "
                      "set (jax refuses that too); keep XLA_CLIENT_MEM_FRACTION")
  var = "XLA_CLIENT_MEM_FRACTION" if new else "XLA_PYTHON_CLIENT_MEM_FRACTION"
  allocator = env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default").lower()
  why = []
  if allocator == "platform":
    fraction = 1.0
    why.append("XLA_PYTHON_CLIENT_ALLOCATOR=platform: no pool, jax allocates and frees on "
               "demand (slow); the whole device less the reserve")
  elif new or old:
    try:
      fraction = float(new or old)
    except ValueError:
      fraction = -1.0
    if not 0 < fraction <= 1:
      raise ConfigError(f"{var}={new or old!r} is not a fraction in (0, 1]; jax's default "
                        f"is {GPU_DEFAULT_FRACTION}")
    why.append(f"{var}={new or old}: jax's allocator pool is that share of the device")
  else:
    fraction = GPU_DEFAULT_FRACTION
    why.append(f"jax preallocates {GPU_DEFAULT_FRACTION:g} of a GPU for its allocator pool "
               f"(XLA_CLIENT_MEM_FRACTION unset; set it, e.g. =.9, to give jax more; newer "
               f"jax may grow the pool past {GPU_DEFAULT_FRACTION:g} when the memory is free, "
               f"{GPU_DEFAULT_FRACTION:g} is what it takes for sure)")
  if allocator != "platform":
    if env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() in ("false", "0"):
      why.append("XLA_PYTHON_CLIENT_PREALLOCATE=false: the pool grows on demand, still "
                 "capped at that share")
    outside = device_memory * (1 - fraction)
    if outside < GPU_OUTSIDE_POOL:
      why.append(f"only {an.fmt(outside)} is left outside jax's pool for the CUDA context, "
                 f"libraries and NCCL's buffers (about {an.fmt(GPU_OUTSIDE_POOL)}): expect "
                 f"out-of-memory at start-up; lower {var}")
  why.append(f"{an.fmt(GPU_RESERVE)} (1 GiB) reserve for cuBLAS/cuDNN workspaces XLA:GPU "
             f"allocates in its pool (not in figures compiled for CPU), allocator "
             f"fragmentation and NCCL buffers: a stated allowance (memory/budget.py "
             f"GPU_RESERVE)")
  return Budget(shown, "gpu", device_memory, fraction, GPU_RESERVE, tuple(why))


def as_budget(device_memory: "Budget | int | None") -> "Budget | None":
  """``device_memory`` as a Budget: a Budget as it is, a byte count taken whole
  (no fraction, no reserve), None as None."""
  if device_memory is None or isinstance(device_memory, Budget):
    return device_memory
  return Budget("as given", "any", int(device_memory), 1.0, 0, ())
