"""The device a program is built for: the running backend, or a named target to lower for.

Choices made while tracing (which attention kernel, whether lengths are padded for it)
depend on the device the program will run on.  In a run that is the backend jax found;
``distflow-jax plan --lower=<target>`` lowers every program of a run for a named device
on a machine without it (an H100 from a CPU laptop or CI), so ``current()`` returns that
target while ``lowering_for(target)`` is active.

Lowering for CUDA without a GPU: jax's cuDNN attention asks the installed cuDNN for its
version and the local GPU for its compute capability before it builds the custom call;
``lowering_for`` answers those two questions with the target's figures (and restores
jax's functions on exit), so jax's own shape checks run exactly as on the device and
``jit(f).trace(...).lower(lowering_platforms=("cuda",))`` produces the device's program.
TPU and ROCm lower from a CPU with no such help.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import functools
from collections.abc import Iterator

import jax


class Platform(enum.Enum):
  """What XLA compiles for (``lowering_platforms`` takes ``.value``)."""
  CPU = "cpu"
  CUDA = "cuda"
  ROCM = "rocm"
  TPU = "tpu"


@dataclasses.dataclass(frozen=True)
class Target:
  """A device kind: platform, and for CUDA the compute capability and cuDNN version the
  attention kernels' rules depend on (jax's ``check_is_flash_attention``)."""
  name: str
  platform: Platform
  compute_capability: tuple[int, int] | None = None
  cudnn_version: int | None = None   # jax's encoding: 9.8.0 -> 90800
  # The device memory's datasheet bandwidth (bytes/s), the decode roofline's bound; None
  # where one figure does not fit the kind (a CPU is measured on the spot instead).
  memory_bytes_per_s: float | None = None

  @property
  def is_cuda(self) -> bool:
    return self.platform is Platform.CUDA


# What `plan --lower` and `--target` accept.  cuDNN 9.8 is what jax 0.10/0.11's CUDA
# wheels bring (the H100 of DESIGN.md's GPU facts reported 9.8 through jax 0.11.2).
TARGETS: dict[str, Target] = {
    "h100": Target("h100", Platform.CUDA, (9, 0), 90800, 3.35e12),   # SXM, HBM3
    "h200": Target("h200", Platform.CUDA, (9, 0), 90800, 4.8e12),
    "a100": Target("a100", Platform.CUDA, (8, 0), 90800, 2.039e12),  # 80 GB SXM
    "l4": Target("l4", Platform.CUDA, (8, 9), 90800, 3.0e11),
    "b200": Target("b200", Platform.CUDA, (10, 0), 90800, 8.0e12),
    "tpu": Target("tpu", Platform.TPU),
    "rocm": Target("rocm", Platform.ROCM, memory_bytes_per_s=5.3e12),  # MI300X
    "cpu": Target("cpu", Platform.CPU),
}
# Aliases a user may type for the same thing.
_ALIASES = {"cuda": "h100", "gpu": "h100", "mi300": "rocm"}


def parse(text: str) -> Target:
  """A target by name (``h100``, ``a100``, ``tpu``, ...; ``cuda``/``gpu`` mean an H100);
  ValueError naming the valid names otherwise."""
  key = _ALIASES.get(text.strip().lower(), text.strip().lower())
  if key not in TARGETS:
    raise ValueError(f"unknown target {text!r}; valid: {', '.join(sorted(TARGETS))} "
                     f"(cuda and gpu mean h100)")
  return TARGETS[key]


def memory_bandwidth(device_kind: str) -> float | None:
  """The table's memory bandwidth for a device kind as jax names it ("NVIDIA H100 80GB
  HBM3" -> the h100 entry's), None when no entry's name is in it."""
  kind = device_kind.lower()
  hits = [t for name, t in TARGETS.items() if name in kind and t.memory_bytes_per_s]
  return hits[0].memory_bytes_per_s if hits else None


_ACTIVE: contextvars.ContextVar[Target | None] = contextvars.ContextVar("distflow_target",
                                                                        default=None)


def current() -> Target:
  """The target being lowered for, else the device jax runs on."""
  active = _ACTIVE.get()
  return active if active is not None else detected()


@functools.cache
def detected() -> Target:
  """The running backend as a Target (its first device's compute capability and the
  installed cuDNN's version on a CUDA GPU)."""
  backend = jax.default_backend()
  if backend == "gpu":
    dev = jax.devices()[0]
    version = str(getattr(dev.client, "platform_version", "")).lower()
    if "rocm" in version:
      return Target(dev.device_kind, Platform.ROCM)
    cc = getattr(dev, "compute_capability", None)
    cc_t = tuple(int(x) for x in str(cc).split(".")[:2]) if cc else None
    return Target(dev.device_kind, Platform.CUDA, cc_t, _installed_cudnn())
  if backend == "tpu":
    return Target(jax.devices()[0].device_kind, Platform.TPU)
  return TARGETS["cpu"]


def _installed_cudnn() -> int | None:
  try:
    from jax._src.lib import cuda_versions
    return None if cuda_versions is None else int(cuda_versions.cudnn_get_version())
  except Exception:  # noqa: BLE001 - no cuDNN: the chooser then never picks it
    return None


@contextlib.contextmanager
def lowering_for(target: Target) -> Iterator[Target]:
  """``current()`` is ``target`` inside; for a CUDA target on a machine without that GPU,
  jax's cuDNN detection answers with the target's figures.  jax's trace caches are
  cleared on entry and exit, so no program traced for another device is reused."""
  jax.clear_caches()
  token = _ACTIVE.set(target)
  patched = _patch_cudnn_detection(target) if target.is_cuda and not _real_cuda() else {}
  try:
    yield target
  finally:
    _ACTIVE.reset(token)
    if patched:
      from jax._src.cudnn import fused_attention_stablehlo as fa
      for name, fn in patched.items():
        setattr(fa, name, fn)
    jax.clear_caches()


def _real_cuda() -> bool:
  return detected().is_cuda


def _patch_cudnn_detection(target: Target) -> dict:
  """Replaces jax's three cuDNN/GPU probes with the target's answers; returns the
  originals.  Nothing is patched when this jax has no such module (its cuDNN path is
  then never taken: the chooser sees ``cudnn_rules() is None``)."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa
  except ImportError:
    return {}
  names = ("check_cudnn_version", "check_compute_capability",
           "is_cuda_compute_capability_equal")
  if not all(hasattr(fa, n) for n in names):
    return {}
  originals = {n: getattr(fa, n) for n in names}
  cc = target.compute_capability or (0, 0)

  def cap(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))
  fa.check_cudnn_version = lambda: target.cudnn_version or 0
  fa.check_compute_capability = lambda c: cc >= cap(c)
  fa.is_cuda_compute_capability_equal = lambda c: cc == cap(c)
  return originals
