"""``--help`` / ``-h`` of every command: its usage (the module docstring) and its flags.

    distflow-jax train --help        (also: distflow-jax help train)

The flags come from the command itself: its ``run`` is called and stopped
where it parses (``config.loading.parse`` for the absl commands,
``argparse.ArgumentParser.parse_args`` for the others), so the list is exactly
what it accepts and there is no second copy to keep in sync.
"""

from __future__ import annotations

import argparse
import importlib
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from distflow_jax.config import loading

HELP_FLAGS = ("-h", "--help")
WIDTH = 100  # help text columns
CONFIG_LINE = ("  --config=FILE[:ARG]  config file or built-in name (grpo:tiny); "
               "--config.KEY=VALUE overrides a key (`distflow-jax config` lists them)")


class _Stop(Exception):
  """Raised instead of parsing: the flags are known by then."""


def wants_help(argv: Sequence[str]) -> bool:
  """``-h``/``--help`` before a bare ``--`` (what follows belongs to a child command)."""
  argv = list(argv)
  end = argv.index("--") if "--" in argv else len(argv)
  return any(a in HELP_FLAGS for a in argv[:end])


def _absl_lines(fv: Any) -> list[str]:
  lines = [CONFIG_LINE]
  for name in fv:
    if name == "config" or name.startswith("config."):
      continue
    f = fv[name]
    kind = f.flag_type()
    shown = (f"--[no]{name}" if kind == "bool" else
             f"--{name}=" + {"int": "N", "float": "X", "enum": "CHOICE"}.get(kind, "VALUE"))
    default = "" if f.default is None else f" (default: {f.default_as_str or f.default})"
    lines.append(f"  {shown}  {f.help}{default}")
  return lines


def _argparse_lines(parser: argparse.ArgumentParser) -> list[str]:
  lines = []
  for a in parser._actions:  # pylint: disable=protected-access  - the only list of them
    if isinstance(a, argparse._HelpAction):  # pylint: disable=protected-access
      continue
    shown = ", ".join(a.option_strings) if a.option_strings else a.dest.upper()
    if a.nargs == argparse.REMAINDER:
      shown = "-- COMMAND ..."
    default = ("" if a.default in (None, argparse.SUPPRESS) or not a.option_strings
               else f" (default: {a.default})")
    req = " (required)" if getattr(a, "required", False) and a.option_strings else ""
    lines.append(f"  {shown}  {a.help or ''}{req}{default}".rstrip())
  return lines


def flag_lines(run: Callable[[Sequence[str]], int]) -> list[str]:
  """The flags ``run`` defines, one line each (stopped before it parses anything)."""

  found: list[str] = []

  def fake_parse(fv, argv):
    found.extend(_absl_lines(fv))
    raise _Stop

  def fake_parse_args(self, args=None, namespace=None):
    found.extend(_argparse_lines(self))
    raise _Stop

  saved = loading.parse, argparse.ArgumentParser.parse_args
  loading.parse, argparse.ArgumentParser.parse_args = fake_parse, fake_parse_args
  try:
    run([])
  except Exception:  # noqa: BLE001 - _Stop, or the command failed before parsing: no flags
    pass
  finally:
    loading.parse, argparse.ArgumentParser.parse_args = saved
  return found


def readable(text: str, width: int = WIDTH) -> str:
  """A docstring as terminal text: ``code`` marked with single backticks, lines longer
  than ``width`` wrapped under their own indent (a flag's help under the flag, indented)."""
  out: list[str] = []
  for line in text.replace("``", "`").splitlines():
    if len(line) <= width:
      out.append(line)
      continue
    indent = line[:len(line) - len(line.lstrip())]
    out.extend(textwrap.wrap(line.strip(), width, initial_indent=indent,
                             subsequent_indent=indent + "    ", break_on_hyphens=False))
  return "\n".join(out)


def show(name: str, run: Callable[[Sequence[str]], int]) -> int:
  """Prints command ``name``'s usage and flags; exit code 0."""
  module = importlib.import_module(f"distflow_jax.commands.{name}")
  parts = [(module.__doc__ or f"distflow-jax {name}").strip()]
  lines = flag_lines(run)
  if lines:
    parts.append("\nflags:\n" + "\n".join(lines))
  parts.append("\nCommon: --debug (or DISTFLOW_DEBUG=1) prints tracebacks; -h/--help this text.")
  print(readable("\n".join(parts)))
  return 0
