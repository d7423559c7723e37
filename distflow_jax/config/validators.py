"""Checks of one config value, each failing with one ``ConfigError`` line naming the key,
the bad value and what is valid: an option name (``option``, ``one_of``), a count
(``positive``), a number in a range (``in_range``).

The valid options of each key are the enum (or tuple) of the code that consumes
them (``train.optim``, ``algos.losses``, ``algos.kl``, ``models.config``,
``data.loader``, ``data.redistribute``), see ``option_types``; a value is looked
up in the enum as the consumer parses it.  They are imported when a check runs,
so importing this module does not import jax.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Iterable

from distflow_jax.config.errors import ConfigError
from distflow_jax.rewards.math_answer import MATCH_MODES
from distflow_jax.tasks import registry as tasks


@functools.cache
def option_types() -> dict[str, type[enum.Enum] | tuple[str, ...]]:
  """The valid values of each option key: the enum (or tuple of names) of the module that
  uses them, so a new member there is valid here with no edit."""
  from distflow_jax.algos.kl import KLEstimator
  from distflow_jax.algos.losses import LossAggMode, RatioLevel
  from distflow_jax.algos.off_policy import OffPolicyCorrection
  from distflow_jax.data.loader import OnBadRow
  from distflow_jax.data.redistribute import Mode
  from distflow_jax.models.config import ATTENTION_IMPLS, DTYPES, PRESETS, REMATS
  from distflow_jax.rollout.backend import BACKENDS
  from distflow_jax.rollout.engine.config import CpuCompute, FuseProjections, LoraSync
  from distflow_jax.train.optim import Optimizer, Schedule
  from distflow_jax.state.warm_shapes import CompileAhead
  return {
      "loss_agg": LossAggMode, "ratio_level": RatioLevel, "kl_estimator": KLEstimator,
      "off_policy": OffPolicyCorrection,
      "on_bad_row": OnBadRow, "redistribute": Mode, "dtype": tuple(DTYPES),
      "optimizer": Optimizer, "schedule": Schedule, "match": MATCH_MODES,
      "remat": REMATS, "attention_impl": ATTENTION_IMPLS, "compile_ahead": CompileAhead,
      "backend": tuple(BACKENDS), "preset": tuple(PRESETS), "lora_sync": LoraSync,
      "fuse_projections": FuseProjections, "cpu_compute": CpuCompute,
  }


def options() -> dict[str, tuple[str, ...]]:
  """The valid names of each option key, as the config spells them."""
  return {key: _names(valid) for key, valid in option_types().items()}


def _names(valid: type[enum.Enum] | Iterable[str]) -> tuple[str, ...]:
  if isinstance(valid, type) and issubclass(valid, enum.Enum):
    return tuple(member.value for member in valid)
  return tuple(valid)


def one_of(value, valid: type[enum.Enum] | Iterable, key: str) -> None:
  """``value`` is one of ``valid``: names a member of an option enum (looked up as the
  enum parses it, not by comparing name strings), or is in a tuple."""
  if isinstance(valid, type) and issubclass(valid, enum.Enum):
    try:
      valid(value)
      return
    except ValueError:
      pass
  elif value in list(valid):
    return
  raise ConfigError(f"{key}={value!r} is not valid; choose one of {list(_names(valid))}")


def option(value, key: str, name: str) -> None:
  """``value`` of config key ``key`` is valid for option ``name`` of ``option_types``."""
  one_of(value, option_types()[name], key)


def positive(value, key: str, allow_zero: bool = False, note: str = "") -> None:
  """An integer count (or a number) that must be > 0 (>= 0 with ``allow_zero``)."""
  ok = value >= 0 if allow_zero else value > 0
  if not ok:
    raise ConfigError(f"{key}={value!r} must be {'>= 0' if allow_zero else '> 0'}{note}")


def in_range(value, key: str, lo: float | None = None, hi: float | None = None, *,
             lo_open: bool = False, hi_open: bool = False, note: str = "") -> None:
  """A finite number within [lo, hi] (an open end excludes the bound; None: unbounded)."""
  if lo is not None and hi is not None:
    rule = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
  elif lo is not None:
    rule = f"{'>' if lo_open else '>='} {lo:g}"
  elif hi is not None:
    rule = f"{'<' if hi_open else '<='} {hi:g}"
  else:
    rule = "a finite number"
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise ConfigError(f"{key}={value!r} must be "
                      + (rule if lo is None and hi is None else f"finite and {rule}") + note)
  if ((lo is not None and (value <= lo if lo_open else value < lo))
      or (hi is not None and (value >= hi if hi_open else value > hi))):
    raise ConfigError(f"{key}={value!r} must be {rule}{note}")


# The checks a key declares beside its default (config/sections.py): each is called with the
# key's value and its dotted name, and says in a few words what it accepts (`config --keys`).

@dataclasses.dataclass(frozen=True)
class Positive:
  """``positive``: > 0, or >= 0 with ``allow_zero``."""
  allow_zero: bool = False
  note: str = ""

  def __call__(self, value, key: str) -> None:
    positive(value, key, self.allow_zero, self.note)

  def __str__(self) -> str:
    return (">= 0" if self.allow_zero else "> 0") + self.note


@dataclasses.dataclass(frozen=True)
class InRange:
  """``in_range``: a finite number within [lo, hi] (open ends exclude the bound)."""
  lo: float | None = None
  hi: float | None = None
  lo_open: bool = False
  hi_open: bool = False
  note: str = ""

  def __call__(self, value, key: str) -> None:
    in_range(value, key, self.lo, self.hi, lo_open=self.lo_open, hi_open=self.hi_open,
             note=self.note)

  def __str__(self) -> str:
    if self.lo is not None and self.hi is not None:
      rule = (f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}"
              f"{')' if self.hi_open else ']'}")
    elif self.lo is not None:
      rule = f"{'>' if self.lo_open else '>='} {self.lo:g}"
    elif self.hi is not None:
      rule = f"{'<' if self.hi_open else '<='} {self.hi:g}"
    else:
      rule = "finite"
    return rule + self.note


@dataclasses.dataclass(frozen=True)
class Option:
  """``option``: one of the names of option ``name`` of ``option_types``."""
  name: str

  def __call__(self, value, key: str) -> None:
    option(value, key, self.name)

  def __str__(self) -> str:
    return "one of " + " | ".join(options()[self.name])


@dataclasses.dataclass(frozen=True)
class Flag:
  """True or False (a 0/1 or a string is refused: it would read as a truth value)."""

  def __call__(self, value, key: str) -> None:
    if not isinstance(value, bool):
      raise ConfigError(f"{key}={value!r} must be true or false")

  def __str__(self) -> str:
    return "true | false"


@dataclasses.dataclass(frozen=True)
class Whole:
  """A whole number (not a bool) > 0, or >= 0 with ``allow_zero``; ``what`` says of what."""
  allow_zero: bool = False
  what: str = ""

  def __call__(self, value, key: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"{key}={value!r} must be a whole number "
                        f"{'>= 0' if self.allow_zero else '> 0'}{self.what}")
    positive(value, key, self.allow_zero, self.what)

  def __str__(self) -> str:
    return f"a whole number {'>= 0' if self.allow_zero else '> 0'}{self.what}"


@dataclasses.dataclass(frozen=True)
class Folder:
  """A folder path (a string); ``empty`` says what '' means."""
  empty: str

  def __call__(self, value, key: str) -> None:
    if not isinstance(value, str):
      raise ConfigError(f"{key}={value!r} must be a folder path ('' = {self.empty})")

  def __str__(self) -> str:
    return f"a folder ('' = {self.empty})"


@dataclasses.dataclass(frozen=True)
class Increasing:
  """A non-empty tuple of positive, strictly increasing whole numbers."""

  def __call__(self, value, key: str) -> None:
    items = list(value) if isinstance(value, (tuple, list)) else None
    if (not items or any(isinstance(v, bool) or not isinstance(v, int) for v in items)
        or items != sorted(set(items)) or items[0] <= 0):
      raise ConfigError(f"{key}={items if items is not None else value!r} must be positive "
                        f"and strictly increasing")

  def __str__(self) -> str:
    return "positive, strictly increasing"


FLOAT32_MAX = 3.4028234663852886e38


@dataclasses.dataclass(frozen=True)
class Float32:
  """A finite number within float32's range (what rewards are kept in)."""

  def __call__(self, value, key: str) -> None:
    in_range(value, key)
    if abs(value) > FLOAT32_MAX:
      raise ConfigError(f"{key}={value!r} is beyond float32's range (|x| <= "
                        f"{FLOAT32_MAX:.4g}), which rewards are kept in")

  def __str__(self) -> str:
    return "finite, within float32"


@dataclasses.dataclass(frozen=True)
class OffOrAbove:
  """0 (off) or a finite number above ``lo``."""
  lo: float

  def __call__(self, value, key: str) -> None:
    if value and not (isinstance(value, (int, float)) and math.isfinite(value)
                      and value > self.lo):
      raise ConfigError(f"{key}={value} must be 0 (off) or > {self.lo:g}")

  def __str__(self) -> str:
    return f"0 (off) or > {self.lo:g}"


MAX_LR = 1.0  # a step above 1 makes any optimizer of train.optim diverge on a transformer


def check_lr(lr, key: str, optimizer: str) -> None:
  """A finite learning rate in (0, MAX_LR]."""
  too_big = isinstance(lr, (int, float)) and math.isfinite(lr) and lr > MAX_LR
  in_range(lr, key, 0, MAX_LR, lo_open=True,
           note=f" (a step above {MAX_LR:g} diverges with {optimizer})" if too_big else "")


@dataclasses.dataclass(frozen=True)
class LearningRate:
  """A learning rate in (0, MAX_LR] for ``optimizer`` (an optimizer section's own ``lr``
  names its ``name`` instead: config/values.py)."""
  optimizer: str = "adamw"

  def __call__(self, value, key: str) -> None:
    check_lr(value, key, self.optimizer)

  def __str__(self) -> str:
    return f"in (0, {MAX_LR:g}]"


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A data path, or a ``builtin:<task>`` that names a registered task."""

  def __call__(self, value, key: str) -> None:
    if isinstance(value, str) and tasks.is_builtin(value):
      try:
        tasks.parse(value)
      except tasks.UnknownTaskError as e:
        raise ConfigError(f"{key}={value!r}: {e}") from None

  def __str__(self) -> str:
    return "a JSONL/Parquet path | builtin:<task>"
