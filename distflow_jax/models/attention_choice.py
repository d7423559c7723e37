"""Which kernel a multi-token attention call takes, decided in Python before anything runs.

``choose`` picks from the setting (``model.attention_impl``), the dtype, the head dim,
the query and key lengths and the target device (``target.current()``):

* ``auto`` on a CUDA GPU takes cuDNN's fused kernel wherever cuDNN can serve the call
  (16-bit, head dim a multiple of 8 up to 128, 256 from Hopper on), with T and S padded
  to a multiple of ``CUDNN_MULTIPLE`` (padding queries sliced off, padding keys masked):
  jax's cuDNN attention refuses odd T or S in training with a mask, and its refusal can
  come while the layer scan is differentiated, outside any try/except around the
  forward call.  Elsewhere (or where cuDNN cannot serve), rows of at least
  ``BLOCKWISE_AUTO_PAIRS`` query x key pairs take blockwise attention (memory linear in
  the length), shorter ones XLA's fused ``dot_product_attention``.
* a named kernel is taken as named; ``cudnn`` on a target it cannot serve is refused
  with one line (``AttentionUnservable``) naming the setting to change.

``cudnn_refusal`` mirrors jax's ``check_is_flash_attention`` / ``check_layout`` rules for
bf16/fp16 (tests/test_attention_choice.py checks the mirror against the installed jax).
``recording()`` collects every choice made while it is active: ``plan --lower`` names
the kernels of each program with it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
from collections.abc import Iterator

import jax.numpy as jnp

from distflow_jax.models.target import Target

# `auto` takes blockwise attention (off cuDNN) from this many query x key pairs per row:
# 2048 x 2048, where the [T, S] float32 scores reach 16 MiB per head and row (plus their
# gradient).  On this 2-core CPU the tiny model's train step was already faster blockwise
# at 1024 tokens (0.51-0.58 s vs XLA's 0.83-0.86 s) and slower at 512 (0.21 vs 0.11 s, one
# block: nothing to skip); the threshold keeps short RL rows on XLA's single fused call,
# GPU float32 included, where the blocks' sequential loop costs more.
BLOCKWISE_AUTO_PAIRS = 2048 * 2048
# cuDNN's lengths are padded to this multiple: even (its rule with a mask in training)
# and a whole number of its 64-row tiles.
CUDNN_MULTIPLE = 64


class Impl(enum.Enum):
  EINSUM = "einsum"
  XLA = "xla"
  CUDNN = "cudnn"
  BLOCKWISE = "blockwise"


class AttentionUnservable(ValueError):
  """A named attention kernel that cannot serve a call on the target (one line)."""


@dataclasses.dataclass(frozen=True)
class Choice:
  impl: Impl
  t: int            # query length as called
  s: int            # key length as called
  pad_to: int = 1   # lengths are padded up to a multiple of this
  why: str = ""

  @property
  def padded(self) -> tuple[int, int]:
    return round_up(self.t, self.pad_to), round_up(self.s, self.pad_to)

  def describe(self) -> str:
    tp, sp = self.padded
    pad = f" padded to {tp}x{sp}" if (tp, sp) != (self.t, self.s) else ""
    return f"{self.impl.value} T={self.t} S={self.s}{pad}" + (f" ({self.why})" if self.why
                                                               else "")


def round_up(x: int, m: int) -> int:
  """``x`` rounded up to a multiple of ``m``."""
  return -(-x // m) * m


def cudnn_refusal(dtype, head_dim: int, target: Target) -> str | None:
  """Why cuDNN's fused attention cannot serve this call on ``target`` (None: it can,
  with lengths padded to ``CUDNN_MULTIPLE``)."""
  if not target.is_cuda:
    return f"target {target.name} is not a CUDA GPU"
  if not target.cudnn_version:
    return "no cuDNN found"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"cuDNN attention takes bfloat16/float16, the model runs {jnp.dtype(dtype).name}"
  cc = target.compute_capability or (0, 0)
  h_max = 256 if cc >= (9, 0) else 128
  if head_dim % 8 or head_dim > h_max:
    return f"head dim {head_dim} is not a multiple of 8 up to {h_max} on compute capability " \
           f"{cc[0]}.{cc[1]}"
  if cc == (10, 3) and target.cudnn_version < 91100:
    return "compute capability 10.3 needs cuDNN >= 9.11"
  return None


def choose(setting: str, dtype, head_dim: int, t: int, s: int, target: Target) -> Choice:
  """The kernel of one attention call (see the module docstring)."""
  if setting == "cudnn":
    why = cudnn_refusal(dtype, head_dim, target)
    if why is not None:
      raise AttentionUnservable(f"model.attention_impl=cudnn cannot serve attention with "
                                f"T={t}, S={s}: {why}; set model.attention_impl=auto")
    return _record(Choice(Impl.CUDNN, t, s, CUDNN_MULTIPLE, "as set"))
  if setting in ("einsum", "xla", "blockwise"):
    return _record(Choice(Impl(setting), t, s, why="as set"))
  if setting != "auto":
    raise ValueError(f"model.attention_impl={setting!r} is unknown; valid: auto, xla, "
                     f"cudnn, einsum, blockwise")
  why = cudnn_refusal(dtype, head_dim, target)
  if why is None:
    return _record(Choice(Impl.CUDNN, t, s, CUDNN_MULTIPLE, "auto"))
  if t * s >= BLOCKWISE_AUTO_PAIRS:
    return _record(Choice(Impl.BLOCKWISE, t, s, why=f"auto, long row; {why}"))
  return _record(Choice(Impl.XLA, t, s, why=f"auto; {why}"))


_RECORD: contextvars.ContextVar[list | None] = contextvars.ContextVar("attention_choices",
                                                                      default=None)


def _record(choice: Choice) -> Choice:
  seen = _RECORD.get()
  if seen is not None:
    seen.append(choice)
  return choice


@contextlib.contextmanager
def recording() -> Iterator[list[Choice]]:
  """Every ``choose`` result while active, in call order (traced calls included)."""
  seen: list[Choice] = []
  token = _RECORD.set(seen)
  try:
    yield seen
  finally:
    _RECORD.reset(token)
