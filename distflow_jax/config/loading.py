"""Loads an ml_collections config file with ``--config.x=y`` overrides.

``--config=configs/grpo.py:tiny`` calls ``get_config("tiny")`` in that file
(``grpo:tiny`` names the same shipped file, and so does ``configs/grpo.py`` from a
directory that has no such file); the config is locked, so an override of a key
that does not exist is refused.  Failures come back as ``ConfigError`` with a one-line reason (the raw
absl/ml_collections exceptions are long tracebacks that bury the culprit).
"""

from __future__ import annotations

import ast
import difflib
import os
import re
from collections.abc import Sequence
from typing import Any

import ml_collections
from absl import flags
from ml_collections import config_flags

from distflow_jax.config import declare, defaults, flag_checks, schema
from distflow_jax.config.errors import ConfigError


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
  if os.path.isdir(path):
    raise ConfigError(f"--config={path} is a folder: name a config file (a .py defining "
                      f"get_config(), e.g. configs/grpo.py:tiny)")
  _check_has_get_config(path)
  return path + sep + arg


def _check_has_get_config(path: str) -> None:
  """A config file must define ``get_config`` (ml_collections calls it): read without
  running the file, so a missing one is one line, not ml_collections' RecursionError."""
  try:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
  except (SyntaxError, UnicodeDecodeError, ValueError):
    return  # loading it reports the problem with its line
  names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
  names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Name)}
  names |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom)
            for a in n.names}
  if "get_config" not in names:
    raise ConfigError(f"config file {path} defines no get_config(): a config file is a .py "
                      f"whose get_config(arg) returns the config (see configs/grpo.py)")


def parse(fv: flags.FlagValues, argv: Sequence[str]) -> list[str]:
  """Defines --config on fv, parses argv into it; returns positional leftovers.

  config_flags discovers ``--config.x`` overrides from the argument list given
  at definition time, so the flag is defined here, with the real argv.  The
  loaded config is then held to the schema (``config/schema.py``): a key the
  file set that ``defaults.base()`` lacks, or a blank path, is refused.
  """
  argv = ["--config=" + resolve_config_path(a.split("=", 1)[1])
          if a.startswith("--config=") else a for a in _last_override_wins(argv)]
  if "--config" in argv:
    i = argv.index("--config")
    if i + 1 < len(argv):
      argv[i + 1] = resolve_config_path(argv[i + 1])
  repeated = flag_checks.repeated_problem(fv, argv)
  if repeated:
    raise ConfigError(repeated)
  dag_flag = next((a for a in argv if a.split("=", 1)[0] == "--config.dag"
                   or a.startswith("--config.dag.")), None)
  if dag_flag is not None:
    raise ConfigError(
        f"{dag_flag.split('=', 1)[0]}: the DAG (a list of node dicts) cannot be set on the "
        f"command line; write a config file -- def get_config(): c = loading.load("
        f"'grpo:tiny'); c.dag = [dict(id=..., fn=..., deps=[...]), ...]; return c (with "
        f"from distflow_jax.config import loading) -- and pass --config=FILE.py (a node's "
        f"own settings go in its config=dict(...); docs/workflows.md)")
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
    detail = " ".join(str(e).split()) or "(no message)"
    raise ConfigError(f"config file {_config_file(argv)} failed to load: "
                      f"{type(e).__name__}: {detail}") from None
  _check_loaded(cfg, _config_file(argv) if _config_spec(argv) else None)
  _check_lora_keys_while_off(cfg, argv)
  return rest[1:]


def _check_lora_keys_while_off(cfg, argv: Sequence[str]) -> None:
  """A ``model.lora.*`` key given on the command line, or set by the file to other than the
  default, while ``model.lora.enabled`` is False: the full model would train without a
  word, so it is refused."""
  lora = cfg.model.lora
  if lora.enabled:
    return
  given = [a.split("=", 1)[0][len("--config."):] for a in argv
           if a.startswith("--config.model.lora.") and not a.startswith(
               "--config.model.lora.enabled")]
  base = defaults.base().model.lora
  changed = [f"model.lora.{k}" for k in sorted(lora.keys())
             if k != "enabled" and k in base and lora[k] != base[k]]
  keys = list(dict.fromkeys(given + changed))
  if keys:
    raise ConfigError(f"{keys[0]} is set but model.lora.enabled=False, so LoRA is off and the "
                      f"full model would train; add --config.model.lora.enabled=True (or drop "
                      f"{', '.join(keys)})")


def _config_spec(argv: Sequence[str]) -> str | None:
  """The ``--config`` value of ``argv`` (the last one), if any."""
  argv = list(argv)
  spec = None
  for i, a in enumerate(argv):
    if a.startswith("--config="):
      spec = a.split("=", 1)[1]
    elif a == "--config" and i + 1 < len(argv):
      spec = argv[i + 1]
  return spec


def _config_file(argv: Sequence[str]) -> str:
  spec = _config_spec(argv)
  return spec.partition(":")[0] if spec else "--config"


def _type_problem(cfg, path: str) -> str | None:
  if isinstance(cfg, ml_collections.ConfigDict):
    return None
  got = "None" if cfg is None else type(cfg).__name__
  return (f"{path}: get_config() returned {got}, expected an ml_collections "
          f"ConfigDict (start from distflow_jax.config.defaults.base())")


def _check_loaded(cfg, path: str | None) -> None:
  """The loaded config is a ConfigDict of the schema's keys with usable paths."""
  if path is None and cfg is None:
    raise ConfigError("no config given: pass --config=configs/grpo.py:tiny (or another file)")
  problem = (_type_problem(cfg, path or "--config")
             or schema.file_keys_problem(cfg, defaults.base(), path or "--config")
             or schema.file_missing_problem(cfg, defaults.base(), path or "--config")
             or schema.paths_problem(cfg))
  if problem:
    raise ConfigError(problem)


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
  """An override ml_collections could not apply: the first ``--config.<key>`` the file's
  config (loaded again, alone) lacks, with the nearest valid key."""
  spec = _config_spec(argv)
  try:
    cfg = load(spec) if spec else None
  except ConfigError as loaded:  # the file itself is wrong (e.g. not a ConfigDict)
    return str(loaded)
  if isinstance(cfg, ml_collections.ConfigDict):
    valid = set(schema.keys(cfg))
    for a in argv:
      if not (a.startswith("--config.") and "=" in a):
        continue
      key = a.split("=", 1)[0][len("--config."):]
      parts = key.split(".")
      if any(".".join(parts[:i]) in {o.key for o in schema.OPEN} for i in range(1, len(parts))):
        continue
      if key not in valid:
        return schema.unknown_key_message(key, sorted(valid), f"from --config.{key}")
  msg = str(e.args[0] if e.args else repr(e)).strip("'\"")
  return "config override: " + " ".join(msg.split())


def _first_and_last_line(msg: str) -> str:
  """A config file that raised: keep the flag and the exception, drop the traceback."""
  lines = [l for l in msg.splitlines() if l.strip()]
  if len(lines) <= 1:
    return msg
  return f"{lines[0].rstrip(':')}: {lines[-1].strip()}"


def with_values(cfg: Any, updates: dict[str, object]) -> Any:
  """A locked copy of ``cfg`` with the dotted keys of ``updates`` set: how a command puts
  its own flags (``--model``, ``--data``) or a resolved path into a config; the loaded
  config itself is never changed.  Given a typed view (``ctx.cfg``), a new view."""
  if not isinstance(cfg, ml_collections.ConfigDict):
    return declare.replaced(cfg, declare.nested(updates))
  new = cfg.copy_and_resolve_references()
  with new.unlocked():
    for dotted, value in updates.items():
      *parents, leaf = dotted.split(".")
      node = new
      for p in parents:
        node = node[p]
      if leaf not in node:
        raise KeyError(f"with_values: {dotted!r} is not a config key")
      node[leaf] = value
  new.lock()
  return new
