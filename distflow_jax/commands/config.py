"""``distflow-jax config``: print the resolved config (file + overrides), one key a line.

  distflow-jax config [--config=configs/grpo.py:tiny] [--config.x=y ...] [--diff] [--json]
  distflow-jax config --keys [--all]

``--keys`` lists every key with its type, default, what it accepts and its one-line doc,
each declared once beside its default: the keys a first run sets (``*``, about 40) first,
then the rest (``--all``: every key in declaration order).
``--diff`` prints only the keys that differ from the defaults every config file starts
from (``distflow_jax.config.defaults.base()``) and the DAG: what the config file and
the overrides set.  ``--json`` prints the same as JSON (what ``train`` writes to
``run_dir/config.json``).  Without ``--config`` it shows the built-in default
(``grpo:tiny``), like ``train``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from absl import flags

from distflow_jax.commands import with_default_config
from distflow_jax.config import declare, defaults, loading, values
from distflow_jax.config.run_sections import Config
from distflow_jax.observe import run_config

DEFAULT_CONFIG = "grpo:tiny"


def key_lines(all_keys: bool = False) -> list[str]:
  """``config --keys``: one line a key, ``* key (type) = default  [accepts]  doc``; the core
  keys first unless ``all_keys``."""
  leaves = [e for e in declare.entries(Config()) if not e.is_section]
  if not all_keys:
    leaves = ([e for e in leaves if e.info.core] + [e for e in leaves if not e.info.core])
  lines = ["* = a key a first run sets; `--config.<key>=<value>` sets one "
           "(`config` prints a resolved config)"]
  for e in leaves:
    accepts = f"  [{e.info.check}]" if e.info.check is not None else ""
    lines.append(f"{'*' if e.info.core else ' '} {e.key} ({e.type}) = {e.default!r}{accepts}  "
                 f"{e.info.doc}")
  return lines


def resolved(argv: Sequence[str]) -> tuple[dict[str, Any], flags.FlagValues]:
  """The resolved config as flat JSON values, and the parsed flags."""

  fv = flags.FlagValues()
  flags.DEFINE_boolean("diff", False, "only the keys that differ from the defaults, "
                       "and the DAG", flag_values=fv)
  flags.DEFINE_boolean("json", False, "print JSON instead of one 'key: value' a line",
                       flag_values=fv)
  flags.DEFINE_boolean("keys", False, "list every key with its type, default and doc",
                       flag_values=fv)
  flags.DEFINE_boolean("all", False, "with --keys: every key in declaration order",
                       flag_values=fv)
  rest = loading.parse(fv, with_default_config(argv, DEFAULT_CONFIG))
  if rest:
    raise loading.ConfigError(f"config takes no positional arguments, got {rest}")
  values.check_values(fv.config)  # a config plan and train refuse is not printed as fine
  flat = run_config.flatten(run_config.as_plain(fv.config))
  if fv.diff:
    base = run_config.flatten(run_config.as_plain(defaults.base()))
    flat = {k: v for k, v in flat.items() if k == "dag" or base.get(k, object()) != v}
  return flat, fv


def render(flat: dict[str, Any]) -> list[str]:
  """``key: value`` lines (JSON values); the DAG one node a line, in its order."""
  lines = [f"{k}: {json.dumps(v)}" for k, v in sorted(flat.items()) if k != "dag"]
  dag = flat.get("dag")
  if dag is not None:
    lines.append("dag:" + ("" if dag else " []"))
    lines += [f"  - {json.dumps(node)}" for node in dag]
  return lines


def run(argv: Sequence[str]) -> int:
  flat, fv = resolved(argv)
  if fv.keys:
    print("\n".join(key_lines(fv.all)))
  elif fv.json:
    print(json.dumps(declare.nested(flat), indent=2, sort_keys=True))
  else:
    print("\n".join(render(flat)))
  return 0
