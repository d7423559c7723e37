"""The config's schema: the keys ``defaults.base()`` defines, checked after a file loads.

A config file's ``get_config`` may only set keys the schema has: ml_collections locks
the config after the file returns, so a command-line typo is refused, but a typo
inside the file (``c.trainer.total_step = 3``) would create a new key and the run
would go on with the default.  ``unknown_keys`` finds such keys, ``suggest`` the
nearest valid one.  ``OPEN`` lists the keys whose contents the schema does not
fix (checked by their own code instead); ``PATHS`` the path-valued keys and what an
empty value means (``paths_problem``).  ``config.loading`` raises what these find.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Iterator, Mapping

import ml_collections



@dataclasses.dataclass(frozen=True)
class OpenKey:
  """A key whose value's inner keys are free: the schema checks only that it exists."""
  key: str
  checked_by: str  # where its contents are checked instead (for the reader of this table)


# Per-node overrides live in the DAG's node dicts (``config=dict(...)``); their keys are
# checked against the node function's section when the DAG is validated.  Plugin node
# functions read their settings from an existing section (FunctionSpec.section), so no
# other section is open.
OPEN: tuple[OpenKey, ...] = (
    OpenKey("dag", "dag/validate.py (node fields) and config/checks.py (per-node overrides)"),
)


@dataclasses.dataclass(frozen=True)
class PathKey:
  """A path-valued key; ``empty``: what ``""`` means (None: an empty value is refused)."""
  key: str
  empty: str | None
  example: str = ""


PATHS: tuple[PathKey, ...] = (
    PathKey("run_dir", None, "runs/my_run"),
    PathKey("model.path", "the built-in model.preset"),
    PathKey("model.lora.path", "fresh adapters"),
    PathKey("data.train", "none yet (train and sft refuse it)"),
    PathKey("data.eval", "no held-out evaluation"),
    PathKey("reward.model_path", "no reward model"),
    PathKey("sft.out", "<run_dir>/sft/model"),
    PathKey("trainer.compile_cache_dir", "no persistent compilation cache"),
)


def _is_section(value) -> bool:
  return isinstance(value, (ml_collections.ConfigDict, Mapping))


def _open(key: str) -> bool:
  return any(key == o.key for o in OPEN)


def keys(tree, prefix: str = "") -> Iterator[str]:
  """Every dotted key of ``tree``, sections and leaves (not inside open keys)."""
  for k, v in tree.items():
    key = prefix + str(k)
    yield key
    if _is_section(v) and not _open(key):
      yield from keys(v, key + ".")


def _absent(have, ref, stop_at: tuple[str, ...] = ()) -> list[str]:
  """Dotted keys of ``have`` that ``ref`` lacks, the first such level only; open keys and
  the sections named in ``stop_at`` are not looked into."""
  out: list[str] = []

  def walk(node, other, prefix: str) -> None:
    for k, v in node.items():
      key = prefix + str(k)
      if k not in other:
        out.append(key)
      elif (_is_section(v) and _is_section(other[k]) and not _open(key)
            and key not in stop_at):
        walk(v, other[k], key + ".")

  walk(have, ref, "")
  return out


def unknown_keys(cfg, schema) -> list[str]:
  """Dotted keys of ``cfg`` that ``schema`` lacks (the first unknown level only)."""
  return _absent(cfg, schema)


def _initials(name: str) -> str:
  return "".join(p[0] for p in name.split("_") if p)


def _nearest_leaf(leaf: str, names: list[str]) -> str | None:
  close = difflib.get_close_matches(leaf, names, n=1, cutoff=0.6)
  if close:
    return close[0]
  # learning_rate -> lr, and back: an abbreviation of the parts' initials.
  return next((n for n in names if len(n) > 1 and (n == _initials(leaf) or _initials(n) == leaf)),
              None)


def suggest(key: str, valid: Iterable[str]) -> str | None:
  """The valid dotted key nearest ``key``: a near spelling among its siblings, else the
  same name in another section, else a near spelling anywhere.  ``key``'s first unknown
  level is replaced and the rest kept where that makes a valid key."""
  valid = list(valid)
  known = set(valid)
  parts = key.split(".")
  depth = next((i for i in range(len(parts)) if ".".join(parts[:i + 1]) not in known),
               len(parts))
  if depth == len(parts):
    return None
  parent, leaf, rest = ".".join(parts[:depth]), parts[depth], parts[depth + 1:]
  siblings = [k.rpartition(".")[2] for k in valid if k.rpartition(".")[0] == parent]
  near = _nearest_leaf(leaf, siblings)
  if near is not None:
    fixed = ".".join([p for p in (parent, near) if p])
    whole = ".".join([fixed] + rest)
    return whole if whole in known else fixed
  elsewhere = sorted(k for k in valid if k.rpartition(".")[2] == ".".join([leaf] + rest)
                     or k.endswith("." + ".".join([leaf] + rest)))
  if elsewhere:
    return elsewhere[0]
  close = difflib.get_close_matches(key, valid, n=1, cutoff=0.75)
  return close[0] if close else None


def unknown_key_message(key: str, valid: Iterable[str], source: str) -> str:
  """``unknown config key 'a.b' (<source>); did you mean 'a.c'?`` in one line."""
  near = suggest(key, valid)
  hint = (f"did you mean {near!r}?" if near else
          "`distflow-jax config --keys` lists every key with its doc")
  return f"unknown config key {key!r} ({source}); {hint}"


def file_keys_problem(cfg, schema, path: str) -> str | None:
  """What is wrong when the config file ``path`` set keys the schema lacks (else None)."""
  bad = unknown_keys(cfg, schema)
  if not bad:
    return None
  more = f" (and {len(bad) - 1} more: {bad[1:4]})" if len(bad) > 1 else ""
  return f"{path}: " + unknown_key_message(bad[0], keys(schema),
                                           "set by the config file") + more


# Sections whose inner keys a config may leave out, and who reads them with their meaning:
# a role's placement may name only its devices, or some mesh axes (the others are 1).
PARTIAL: tuple[OpenKey, ...] = (
    OpenKey("placement", "dag/planner.role_mesh (devices 'all', mesh {'fsdp': -1}, an axis "
                         "left out is 1)"),
)


def missing_keys(cfg, schema) -> list[str]:
  """Dotted keys of ``schema`` that ``cfg`` lacks (the first missing level only; inside a
  ``PARTIAL`` section only its own keys)."""
  return _absent(schema, cfg, tuple(p.key for p in PARTIAL))


def file_missing_problem(cfg, schema, path: str) -> str | None:
  """What is wrong when the config file ``path`` returned a config lacking schema keys: the
  code reads every key, so a config is the schema's defaults plus what the file sets."""
  gone = missing_keys(cfg, schema)
  if not gone:
    return None
  more = f" (and {len(gone) - 1} more: {gone[1:4]})" if len(gone) > 1 else ""
  return (f"{path}: the config lacks key {gone[0]!r}{more}; start get_config() from "
          f"distflow_jax.config.defaults.base() and set what differs")


def paths_problem(cfg) -> str | None:
  """What is wrong with a path-valued key that is blank, or empty where empty means
  nothing (else None)."""
  for p in PATHS:
    section, _, leaf = p.key.rpartition(".")
    if section and section not in cfg:
      continue
    node = cfg[section] if section else cfg
    if leaf not in node:
      continue
    value = node[leaf]
    if not isinstance(value, str):
      return f"{p.key}={value!r} must be a path (a string)"
    if value and not value.strip():
      meaning = f", or '' for {p.empty}" if p.empty is not None else ""
      return f"{p.key}={value!r} is blank: give a path{meaning}"
    if not value and p.empty is None:
      return f"{p.key} is empty: give a path, e.g. --config.{p.key}={p.example}"
  return None
