"""Named choices (estimators, modes) parsed from config strings with a clear error."""

from __future__ import annotations

import enum


class Choice(enum.Enum):
  """Base of the option enums; the first docstring line names the option in errors."""

  @classmethod
  def parse(cls, name):
    if isinstance(name, cls):
      return name
    try:
      return cls(name)
    except ValueError:
      what = (cls.__doc__ or cls.__name__).strip().splitlines()[0].rstrip(".")
      valid = ", ".join(e.value for e in cls)
      raise ValueError(f"unknown {what} {name!r}; valid: {valid}") from None
