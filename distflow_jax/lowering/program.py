"""One program of a run as ``plan --lower`` holds it: its node, a name with its shape, the
jitted function and its abstract arguments (``Program``), and the list ``catalogue``
returns (``Catalogue``)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Program:
  """One program: the plan node (or phase) it belongs to, a name with its shape, the
  jitted function and its abstract arguments."""
  node: str
  name: str
  fn: Any
  args: tuple
  kwargs: dict = dataclasses.field(default_factory=dict)  # static keyword arguments

  def trace(self) -> Any:
    return self.fn.trace(*self.args, **self.kwargs)


class _Refused:
  """A program that failed while the catalogue was built: lowering it re-raises."""

  def __init__(self, error: Exception):
    self.error = error

  def trace(self, *args):
    raise self.error


@dataclasses.dataclass
class Catalogue:
  programs: list[Program]
  notes: list[str]
