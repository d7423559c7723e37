"""Loads an ml_collections config file with ``--config.x=y`` overrides.

``--config=configs/grpo.py:tiny`` calls ``get_config("tiny")`` in that file
(``grpo:tiny`` names the same shipped file, and so does ``configs/grpo.py`` from a
directory that has no such file); the config is locked, so an override of a key
that does not exist is refused.  Failures come back as ``ConfigError`` with a one-line reason (the raw
absl/ml_collections exceptions are long tracebacks that bury the culprit).
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Sequence

import ml_collections
from absl import flags
from ml_collections import config_flags


class ConfigError(ValueError):
  """A config, config file or override that cannot be used; names the key."""


def configs_dir() -> str:
  """The shipped configs: ``distflow_jax/configs`` in an installed wheel.

  pyproject.toml maps the repository's top-level configs/ folder (the single source)
  into the package.  An editable install or a plain checkout imports the package from
  the source tree, where that folder sits next to ``distflow_jax/`` instead.
  """
  pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  packaged = os.path.join(pkg, "configs")
  if os.path.isdir(packaged):
    return packaged
  return os.path.join(os.path.dirname(pkg), "configs")


def resolve_config_path(spec: str) -> str:
  """Accepts 'path/to/file.py[:arg]' or a built-in name such as 'grpo:tiny'.

  A user file wins; 'configs/<file>' that is not on disk (run outside the checkout,
  or from an installed wheel) means the shipped config of that name.
  """
  path, sep, arg = spec.partition(":")
  if not os.path.exists(path):
    rel = os.path.normpath(path)
    head, _, rest = rel.partition(os.sep)
    if head == "configs" and rest:
      candidate = os.path.join(configs_dir(), rest)
    elif not path.endswith(".py"):
      candidate = os.path.join(configs_dir(), path + ".py")
    else:
      candidate = ""
    if candidate and os.path.exists(candidate):
      path = candidate
  if not os.path.exists(path):
    avail = sorted(f[:-3] for f in os.listdir(configs_dir()) if f.endswith(".py")
                   and not f.startswith("_")) if os.path.isdir(configs_dir()) else []
    raise ConfigError(f"config file {path!r} not found; built-in configs: {avail}")
  return path + sep + arg


def parse(fv: flags.FlagValues, argv: Sequence[str]) -> list[str]:
  """Defines --config on fv, parses argv into it; returns positional leftovers.

  config_flags discovers ``--config.x`` overrides from the argument list given
  at definition time, so the flag is defined here, with the real argv.
  """
  argv = ["--config=" + resolve_config_path(a.split("=", 1)[1])
          if a.startswith("--config=") else a for a in _last_override_wins(argv)]
  if "--config" in argv:
    i = argv.index("--config")
    if i + 1 < len(argv):
      argv[i + 1] = resolve_config_path(argv[i + 1])
  full = ["distflow-jax"] + list(argv)
  config_flags.DEFINE_config_file("config", None, "ml_collections config file[:arg]",
                                  flag_values=fv, lock_config=True, sys_argv=full)
  try:
    rest = fv(full)
    cfg = fv["config"].value
  except flags.UnrecognizedFlagError as e:
    raise ConfigError(_unknown_flag(e, fv)) from None
  except (flags.IllegalFlagValueError, flags.Error) as e:
    raise ConfigError(_first_and_last_line(str(e) or repr(e))) from None
  except (KeyError, AttributeError) as e:
    raise ConfigError(_bad_override(e, argv)) from None
  except OSError as e:
    raise ConfigError(str(e)) from None
  except Exception as e:  # noqa: BLE001 - the user's config file raised (or did not compile)
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "--config")
    detail = " ".join(str(e).split()) or "(no message)"
    raise ConfigError(f"config file {spec.partition(':')[0]} failed to load: "
                      f"{type(e).__name__}: {detail}") from None
  if cfg is None or not isinstance(cfg, ml_collections.ConfigDict):
    raise ConfigError("no config given: pass --config=configs/grpo.py:tiny (or another file)")
  return rest[1:]


def _last_override_wins(argv: Sequence[str]) -> list[str]:
  """``argv`` with only the last of each repeated ``--config.<key>=value``.  absl takes
  the last value of a repeated flag, except for a tuple-valued override, which it
  appends to the earlier one: ``rollout.prefill_buckets=(40,)`` then ``=(16,40)`` gave
  ``(40, 16, 40)``, a silently different run (a launcher's flags plus the user's)."""
  last = {a.split("=", 1)[0]: i for i, a in enumerate(argv)
          if a.startswith("--config.") and "=" in a}
  return [a for i, a in enumerate(argv)
          if not (a.startswith("--config.") and "=" in a) or last[a.split("=", 1)[0]] == i]


def load(spec: str, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """Loads ``spec`` with override strings like 'actor.optimizer.lr=1e-5'."""
  fv = flags.FlagValues()
  parse(fv, [f"--config={spec}"] + [f"--config.{o}" for o in overrides])
  return fv.config


def _unknown_flag(e: Exception, fv: flags.FlagValues) -> str:
  m = re.search(r"'([^']+)'", str(e))
  name = m.group(1) if m else str(e)
  if name.startswith("config."):
    return f"unknown config key {name[len('config.'):]!r}"
  close = difflib.get_close_matches(name, [n for n in fv if not n.startswith("config.")], n=3)
  hint = f"; did you mean {' or '.join('--' + c for c in close)}?" if close else ""
  return f"unknown flag --{name}{hint}"


def _bad_override(e: Exception, argv: Sequence[str]) -> str:
  msg = e.args[0] if e.args else repr(e)
  msg = str(msg).strip("'\"")
  key = next((a.split("=", 1)[0][2:] for a in argv if a.startswith("--config.")
              and str(msg).split("\n")[0].strip("'\"") in a), None)
  head = f"override --{key}: " if key else "config override: "
  return head + "unknown key " + msg.replace("\n", " ")


def _first_and_last_line(msg: str) -> str:
  """A config file that raised: keep the flag and the exception, drop the traceback."""
  lines = [l for l in msg.splitlines() if l.strip()]
  if len(lines) <= 1:
    return msg
  return f"{lines[0].rstrip(':')}: {lines[-1].strip()}"
