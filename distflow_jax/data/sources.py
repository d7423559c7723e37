"""Random-access record sources over JSONL and Parquet prompt files.

A source maps a record index to a raw row (a dict) or a :class:`BadRow` that
says why the row cannot be read.  Reading is lazy: a process only decodes the
rows its shard asks for (JSONL: one scan for line offsets, then a seek per
row; Parquet: a memory-mapped table, one row converted per access).  The
helpers below read a row's fields: dotted paths into nested rows, text, chat
messages, answers.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Protocol

from distflow_jax.config.errors import ConfigError

SUFFIXES = (".jsonl", ".json", ".parquet")


class DataFileError(ConfigError):
  """A data file that cannot be read as a whole (not Parquet, truncated, corrupt, no rows,
  an unknown suffix); one line naming the file and what is wrong."""


@dataclasses.dataclass(frozen=True)
class BadRow:
  reason: str   # one of rows.REASONS
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
      return BadRow("bad_json", f"a row must be a JSON object, got {type(row).__name__} "
                    f"(.json files are read as JSON Lines: one object per line)")
    return row


class ParquetSource:
  """Rows of a Parquet file (all columns), memory-mapped."""

  def __init__(self, path: str):
    import pyarrow as pa
    import pyarrow.parquet as pq
    self.path = os.fspath(path)
    try:  # reads (and decompresses) every column now, so a corrupt page is met here
      self._table = pq.read_table(self.path, memory_map=True)
    except (pa.ArrowException, OSError) as e:
      if isinstance(e, OSError) and e.errno is not None:
        raise  # the file system's own error (missing, a folder, no permission): names it
      raise DataFileError(f"data file {self.path}: not a readable Parquet file "
                          f"({_first_line(e)}); is it truncated, corrupt or another "
                          f"format?") from None

  def __len__(self) -> int:
    return self._table.num_rows

  def where(self, index: int) -> str:
    return f"{self.path} row {index}"

  def __getitem__(self, index: int) -> dict[str, Any] | BadRow:
    return self._table.slice(index, 1).to_pylist()[0]


def _first_line(e: BaseException) -> str:
  lines = [l.strip() for l in str(e).splitlines() if l.strip()]
  text = lines[0] if lines else type(e).__name__
  return text if len(text) <= 160 else text[:157] + "..."


def field_value(row: dict[str, Any], key: str) -> Any:
  """``row[key]``, or for a dotted ``key`` the value down that path through nested dicts
  (``"reward_model.ground_truth"``); None when any step is missing.  A column whose own
  name contains dots is found first."""
  if key in row:
    return row[key]
  value: Any = row
  for part in key.split("."):
    if not isinstance(value, dict) or part not in value:
      return None
    value = value[part]
  return value


def answer_text(value: Any, field: str) -> str | BadRow:
  """An answer field as text (numbers written out); else why it is unusable."""
  if isinstance(value, (str, bytes)):
    return text_of(value, field)
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return str(value)
  return BadRow("missing_field", f"field {field!r} must be text or a number, got "
                f"{type(value).__name__} (point data.answer_key at the text inside it, e.g. "
                f"data.answer_key=reward_model.ground_truth)")


def text_of(value: Any, field: str) -> str | BadRow:
  """A text field as str (UTF-8 bytes decoded); else why it is unusable."""
  if isinstance(value, bytes):
    try:
      value = value.decode("utf-8")
    except UnicodeDecodeError:
      return BadRow("not_utf8", f"field {field!r} holds bytes that are not UTF-8")
  if not isinstance(value, str):
    return BadRow("missing_field", f"field {field!r} must be text, got "
                  f"{type(value).__name__}")
  try:
    value.encode("utf-8")
  except UnicodeEncodeError:
    return BadRow("not_utf8", f"field {field!r} holds unpaired surrogates")
  return value


def messages_of(prompt: Any, field: str) -> list[dict[str, str]] | BadRow:
  """A prompt as chat messages: plain text becomes one user message."""
  if isinstance(prompt, (str, bytes)):
    text = text_of(prompt, field)
    return text if isinstance(text, BadRow) else [{"role": "user", "content": text}]
  if isinstance(prompt, (list, tuple)):
    out = []
    for m in prompt:
      if not isinstance(m, dict) or "content" not in m:
        return BadRow("missing_field", f"field {field!r} must be text or a list "
                      f"of {{'role', 'content'}} messages")
      text = text_of(m["content"], f"{field}.content")
      if isinstance(text, BadRow):
        return text
      out.append({"role": str(m.get("role", "user")), "content": text})
    return out
  return BadRow("missing_field", f"field {field!r} must be text or messages, "
                f"got {type(prompt).__name__}")


def open_source(path: str) -> RecordSource:
  """A source for ``path``, chosen by its suffix."""
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"prompt dataset {path!r} does not exist")
  suffix = os.path.splitext(path)[1].lower()
  if suffix not in SUFFIXES:
    raise DataFileError(f"cannot read data file {path}: unknown suffix {suffix!r}; valid "
                        f"suffixes are {list(SUFFIXES)} (convert it to JSON Lines or Parquet)")
  source: RecordSource = ParquetSource(path) if suffix == ".parquet" else JsonlSource(path)
  if len(source) == 0:
    raise DataFileError(f"data file {path} has no rows (an empty file"
                        f"{' or only blank lines' if suffix != '.parquet' else ''})")
  return source
