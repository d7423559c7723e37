"""Random-access record sources over JSONL and Parquet prompt files.

A source maps a record index to a raw row (a dict) or a :class:`BadRow` that
says why the row cannot be read.  Reading is lazy: a process only decodes the
rows its shard asks for (JSONL: one scan for line offsets, then a seek per
row; Parquet: a memory-mapped table, one row converted per access).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Protocol

SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclasses.dataclass(frozen=True)
class BadRow:
  reason: str   # one of loader.REASONS
  detail: str


class RecordSource(Protocol):
  path: str

  def __len__(self) -> int: ...

  def __getitem__(self, index: int) -> dict[str, Any] | BadRow: ...

  def where(self, index: int) -> str: ...


class JsonlSource:
  """One JSON object per non-blank line; blank lines are not records, but are counted
  (``blank_lines``, and ``first_blank_line``, 1-based) so the loader can report them."""

  def __init__(self, path: str):
    self.path = os.fspath(path)
    offsets, numbers = [], []
    self.blank_lines = 0
    self.first_blank_line: int | None = None
    with open(self.path, "rb") as f:
      pos = 0
      for number, line in enumerate(f, 1):
        if line.strip():
          offsets.append(pos)
          numbers.append(number)
        else:
          self.blank_lines += 1
          self.first_blank_line = self.first_blank_line or number
        pos += len(line)
    self._offsets = offsets
    self._line_numbers = numbers

  def __len__(self) -> int:
    return len(self._offsets)

  def where(self, index: int) -> str:
    """``path:line`` of record ``index`` (1-based line number, blank lines counted)."""
    return f"{self.path}:{self._line_numbers[index]}"

  def __getitem__(self, index: int) -> dict[str, Any] | BadRow:
    with open(self.path, "rb") as f:
      f.seek(self._offsets[index])
      raw = f.readline()
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      return BadRow("not_utf8", f"line bytes are not UTF-8 ({e.reason} at byte {e.start})")
    try:
      row = json.loads(text)
    except json.JSONDecodeError as e:
      return BadRow("bad_json", f"not valid JSON: {e.msg} at column {e.colno}")
    if not isinstance(row, dict):
      return BadRow("bad_json", f"a row must be a JSON object, got {type(row).__name__}")
    return row


class ParquetSource:
  """Rows of a Parquet file (all columns), memory-mapped."""

  def __init__(self, path: str):
    import pyarrow.parquet as pq
    self.path = os.fspath(path)
    self._table = pq.read_table(self.path, memory_map=True)

  def __len__(self) -> int:
    return self._table.num_rows

  def where(self, index: int) -> str:
    return f"{self.path} row {index}"

  def __getitem__(self, index: int) -> dict[str, Any] | BadRow:
    return self._table.slice(index, 1).to_pylist()[0]


def open_source(path: str) -> RecordSource:
  """A source for ``path``, chosen by its suffix."""
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"prompt dataset {path!r} does not exist")
  suffix = os.path.splitext(path)[1].lower()
  if suffix in (".jsonl", ".json"):
    return JsonlSource(path)
  if suffix == ".parquet":
    return ParquetSource(path)
  raise ValueError(f"cannot read {path!r}: unknown suffix {suffix!r}; valid "
                   f"suffixes are {list(SUFFIXES)}")
