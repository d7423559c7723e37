"""Errors about a Hugging Face model folder's files, each naming the file.

`ModelFileError` is a `ConfigError` (so a `ValueError`): the command line
prints it as one line and exits 2.  `ModelFileNotFoundError` is also a
`FileNotFoundError`, for callers that test for a missing file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from distflow_jax.config.errors import ConfigError


class ModelFileError(ConfigError):
  """A model folder file (config.json, safetensors, index, tokenizer files) that cannot be
  used; the message names the file."""


class ModelFileNotFoundError(ModelFileError, FileNotFoundError):
  """A file or folder a model needs is missing; the message names it."""

  def __str__(self) -> str:  # OSError would render a single argument as a tuple otherwise
    return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class GGUFError(ModelFileError):
  """A GGUF file that cannot be converted faithfully (models/gguf_import.py); the message
  names the file."""


def read_json_object(path: str | os.PathLike, what: str = "") -> dict[str, Any]:
  """``path``'s JSON object; `ModelFileError` naming the file when it cannot be read, is not
  JSON or is not an object (``what`` says what the file is for)."""
  path = Path(path)
  label = f"{path}{f' ({what})' if what else ''}"
  try:
    text = path.read_text(encoding="utf-8")
  except FileNotFoundError:
    raise ModelFileNotFoundError(f"missing {label}") from None
  except UnicodeDecodeError as e:
    raise ModelFileError(f"{label} is not UTF-8 text (byte {e.start}): not a JSON file") from None
  except OSError as e:
    raise ModelFileError(f"cannot read {label}: {e.strerror or e}") from None
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise ModelFileError(f"{label} is not valid JSON: {e.msg} at line {e.lineno} column "
                         f"{e.colno}") from None
  if not isinstance(value, dict):
    raise ModelFileError(f"{label} must hold a JSON object ({{...}}), got a "
                         f"{_json_type(value)}")
  return value


def _json_type(value: Any) -> str:
  return {list: "list", str: "string", int: "number", float: "number", bool: "boolean",
          type(None): "null"}.get(type(value), type(value).__name__)
