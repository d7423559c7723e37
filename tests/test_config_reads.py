"""The live run config is read by attribute, never with ``.get("<key>", default)``.

The run config is built from ``defaults.base()`` and locked after loading: every key of the
schema is always there, with its default.  A ``cfg.model.get("pack_sequences", False)``
restates that default in a second place, where it can drift from the schema's.  This test
reads the package's source and refuses, naming file and line, any ``X.get("<name>", ...)``
whose ``<name>`` is the last component of a schema key, unless ``ALLOWED`` says why ``X``
is not the live config (a stored run_config.json of an older run that may lack keys, an HF
config.json, a jax mesh's shape, ...).
"""

import ast
import os

import pytest

from distflow_jax.config import defaults, schema
from test_import_graph import REPO, modules

# (file, receiver, reason): the ``.get`` calls that read no live config.  receiver None:
# every such call of the file; else only calls on that receiver (the ``X`` of ``X.get``,
# as the source spells it), for a file that reads the live config too.
ALLOWED = (
  ("distflow_jax/commands/config.py", None,
   "a flat dict of dotted keys printed by `config`"),
  ("distflow_jax/dag/planner.py", None,
   "a placement dict handed to the planner (plain, may be partial)"),
  ("distflow_jax/dag/rules.py", None, "a DAG node's config override dict (node.overrides)"),
  ("distflow_jax/data/image_loading.py", None, "an image ref of a data row"),
  ("distflow_jax/envs/parsers.py", None, "a tool call's JSON"),
  ("distflow_jax/models/config.py", None, "an HF config.json"),
  ("distflow_jax/models/tokenizer.py", None, "an HF tokenizer.json / tokenizer_config.json"),
  ("distflow_jax/models/vl.py", None, "an HF config.json"),
  ("distflow_jax/observe/health.py", None, "a step's metrics dict"),
  ("distflow_jax/persist/checkpoint_contents.py", None, "a save's checksums by section"),
  ("distflow_jax/persist/export.py", None, "a stored run_config.json from an older run"),
  ("distflow_jax/persist/lora_actor.py", None,
   "a checkpoint's stored metadata and run_config.json from an older run"),
  ("distflow_jax/persist/lora_export.py", None, "a stored run_config.json from an older run"),
  ("distflow_jax/rollout/engine/core.py", None, "a jax mesh's shape"),
  ("distflow_jax/run/model_source.py", None,
   "a checkpoint's stored metadata (its run config) from an older run"),
  ("distflow_jax/memory/report.py", "actor.shape", "a role mesh's shape (axis sizes)"),
  ("distflow_jax/memory/report.py", "rm.shape", "a role mesh's shape (axis sizes)"),
  ("distflow_jax/memory/report.py", "cm.shape", "a role mesh's shape (axis sizes)"),
  ("distflow_jax/rollout/engine/config.py", "mesh.shape", "a jax mesh's shape"),
)


def _names() -> set[str]:
  """The last component of every schema key (``pack_sequences`` of model.pack_sequences)."""
  return {k.rsplit(".", 1)[-1] for k in schema.keys(defaults.base())}


def _gets(names: set[str]) -> list[tuple[str, int, str, str]]:
  """``(file, line, receiver, call)`` of every ``X.get("<name>"[, default])`` in the package
  whose name is in ``names``."""
  out = []
  for path in sorted(modules(REPO).values()):
    rel = os.path.relpath(path, REPO).replace(os.sep, "/")
    for node in ast.walk(ast.parse(open(path).read(), path)):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant)
          and node.args[0].value in names):
        out.append((rel, node.lineno, ast.unparse(node.func.value), ast.unparse(node)))
  return out


def _allowed(rel: str, receiver: str) -> bool:
  return any(f == rel and r in (None, receiver) for f, r, _ in ALLOWED)


@pytest.mark.timeout(60)
def test_the_live_config_is_never_read_with_get_and_a_default():
  bad = [f"{rel}:{line}: {call}" for rel, line, receiver, call in _gets(_names())
         if not _allowed(rel, receiver)]
  assert not bad, ("the run config holds every schema key: read it by attribute "
                   "(cfg.model.pack_sequences, not cfg.model.get('pack_sequences', False)), "
                   "or add the file to ALLOWED saying which non-config dict it reads:\n"
                   + "\n".join(bad))


@pytest.mark.timeout(60)
def test_every_allowlist_entry_still_has_a_call():
  hits = {(rel, receiver) for rel, _, receiver, _ in _gets(_names())}
  stale = [f"{f} ({r or 'whole file'}): {why}" for f, r, why in ALLOWED
           if not any(rel == f and r in (None, receiver) for rel, receiver in hits)]
  assert not stale, "ALLOWED names calls the source no longer has:\n" + "\n".join(stale)

