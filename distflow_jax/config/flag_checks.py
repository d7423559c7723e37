"""A command's own flags given twice with different values (``--resume --noresume``).

absl keeps the last value of a repeated flag, so a contradiction on the command line
(a script's flags plus the user's) silently picks one side.  ``repeated_problem``
names the flag instead; ``config.loading.parse`` raises it.  ``--config.<key>``
overrides are not this module's: a later one replaces an earlier one on purpose
(``loading._last_override_wins``).
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import flags

CONFIG = "config"


def _parsed(flag: flags.Flag, text: str):
  try:
    return flag.parser.parse(text)
  except (ValueError, TypeError, flags.Error):
    return text  # absl refuses it when it parses; compare the text meanwhile


def _occurrences(fv: flags.FlagValues, argv: Sequence[str]):
  """``(flag name, value, as written)`` for each command flag in ``argv`` (before ``--``)."""
  args = list(argv)
  i = 0
  while i < len(args):
    a = args[i]
    i += 1
    if a == "--":
      return
    if not a.startswith("-") or a == "-":
      continue
    body = a.lstrip("-")
    name, eq, text = body.partition("=")
    if name == CONFIG or name.startswith(CONFIG + "."):
      if name == CONFIG:
        if not eq and i < len(args):
          text, i = args[i], i + 1
        yield CONFIG, text, f"--config={text}"
      continue
    if name in fv:
      flag = fv[name]
      if flag.boolean:
        yield name, _parsed(flag, text) if eq else True, a
      elif eq:
        yield name, _parsed(flag, text), a
      elif i < len(args):
        yield name, _parsed(flag, args[i]), f"{a} {args[i]}"
        i += 1
    elif name.startswith("no") and name[2:] in fv and fv[name[2:]].boolean and not eq:
      yield name[2:], False, a


def repeated_problem(fv: flags.FlagValues, argv: Sequence[str]) -> str | None:
  """The first command flag ``argv`` gives twice with different values (else None)."""
  seen: dict[str, tuple[object, str]] = {}
  for name, value, written in _occurrences(fv, argv):
    if name in seen and seen[name][0] != value:
      return (f"--{name} is given twice with different values ({seen[name][1]} and "
              f"{written}); give it once")
    seen.setdefault(name, (value, written))
  return None
