"""Tool-call parsers: where a turn's tool call ends, and what it calls.

``rollout.tool_parser`` picks one from ``TOOL_PARSERS``:

* ``tag``: ``<tool>name(args)</tool>``, arguments as the raw text between the brackets;
* ``hermes``: the Hermes / Qwen2.5 chat template's ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``, arguments a JSON object.

The episode loop ends a turn at ``call_end(text)`` (the text after the first complete
call is dropped, and its tokens with it) and hands the turn's text to the environment,
which may ``parse`` it.  A call whose body does not parse (bad JSON, no name) still ends
the turn: ``parse`` then returns a ``ToolCall`` with ``error`` set, for the environment
to answer.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from typing import Any

from distflow_jax.config.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One parsed call: ``name`` and ``arguments`` (tag: the raw text; hermes: a dict), or
  ``error`` (why the call's body did not parse; name and arguments then empty)."""
  name: str
  arguments: Any
  error: str = ""


@dataclasses.dataclass(frozen=True)
class TagParser:
  """A call delimited by ``open`` ... ``close``."""
  open: str
  close: str

  def call_end(self, text: str) -> int | None:
    """The index just past the first complete call in ``text``; None if there is none."""
    start = text.find(self.open)
    if start < 0:
      return None
    stop = text.find(self.close, start + len(self.open))
    return None if stop < 0 else stop + len(self.close)

  def body(self, text: str) -> str | None:
    end = self.call_end(text)
    if end is None:
      return None
    start = text.find(self.open)
    return text[start + len(self.open):end - len(self.close)]


_CALL = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*\((.*)\)\s*", re.S)


@dataclasses.dataclass(frozen=True)
class FunctionTagParser(TagParser):
  """``<tool>name(args)</tool>``."""

  def parse(self, text: str) -> ToolCall | None:
    body = self.body(text)
    if body is None:
      return None
    m = _CALL.fullmatch(body)
    if m is None:
      return ToolCall("", "", error=f"expected name(args) inside {self.open}...{self.close}, "
                                    f"got {body[:60]!r}")
    return ToolCall(m.group(1), m.group(2))


@dataclasses.dataclass(frozen=True)
class JsonTagParser(TagParser):
  """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

  def parse(self, text: str) -> ToolCall | None:
    body = self.body(text)
    if body is None:
      return None
    try:
      obj = json.loads(body)
    except ValueError as e:
      return ToolCall("", {}, error=f"not JSON: {e}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
      return ToolCall("", {}, error='expected {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some templates emit the arguments as a JSON string
      try:
        args = json.loads(args)
      except ValueError as e:
        return ToolCall(obj["name"], {}, error=f"arguments are not JSON: {e}")
    if not isinstance(args, dict):
      return ToolCall(obj["name"], {}, error="arguments must be a JSON object")
    return ToolCall(obj["name"], args)


class ToolParser(enum.Enum):
  """``rollout.tool_parser``'s values."""
  TAG = "tag"
  HERMES = "hermes"


TOOL_PARSERS: dict[ToolParser, TagParser] = {
    ToolParser.TAG: FunctionTagParser("<tool>", "</tool>"),
    ToolParser.HERMES: JsonTagParser("<tool_call>", "</tool_call>"),
}


def tool_parser(name: str) -> TagParser:
  """The parser ``rollout.tool_parser=name`` names; one ConfigError line otherwise."""
  try:
    return TOOL_PARSERS[ToolParser(name)]
  except ValueError:
    raise ConfigError(f"rollout.tool_parser={name!r} is unknown; valid: "
                      f"{', '.join(p.value for p in ToolParser)}") from None
