"""The batch's fields are named once (data/fields.py): no module of the package spells a
field's name as a string literal or a keyword argument, and the catalogue covers every field
the built-in node specs name (dag/validate.py refuses any other at plan time)."""

import ast
import pathlib

import numpy as np

from distflow_jax.dag import FUNCTIONS
from distflow_jax.data import fields

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "distflow_jax"
# Node *function* names and module names that happen to equal a field's name.
NOT_FIELDS = {
    ("dag/registry.py", "values"): "the critic's pass node function is named 'values'",
    ("nodes/passes.py", "values"): "its NODES entry and compile-cache key, the same name",
    ("lowering/catalogue.py", "values"): "the node function name of the critic's pass",
    ("memory/report.py", "values"): "the node function name of the critic's pass",
    ("config/vision_checks.py", "values"): "the node function name of the critic's pass",
    ("nodes/__init__.py", "rewards"): "the node family module nodes/rewards.py",
    ("nodes/__init__.py", "advantages"): "the node family module nodes/advantages.py",
}


# Calls whose keyword arguments become batch keys.
BATCH_BUILDERS = {"replace", "update", "put_local", "dict"}


def literals(source: str) -> list[tuple[int, str]]:
  """(line, name) of each string constant or keyword argument naming a batch field,
  docstrings and f-strings aside."""
  tree = ast.parse(source)
  skip = set()
  for n in ast.walk(tree):
    if isinstance(n, ast.JoinedStr):
      skip.update(id(m) for m in ast.walk(n))
    body = getattr(n, "body", None)
    if (isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)):
      skip.add(id(body[0].value))
  out = []
  for n in ast.walk(tree):
    if (isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in fields.FIELDS
        and id(n) not in skip):
      out.append((n.lineno, n.value))
    if isinstance(n, ast.Call):  # batch.replace(rewards=...) and its kin build a batch
      fn = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
      if fn in BATCH_BUILDERS:
        out += [(k.lineno, k.arg) for k in n.keywords if k.arg in fields.FIELDS]
  return out


def test_no_module_spells_a_field_name():
  found = []
  for path in sorted(PACKAGE.rglob("*.py")):
    rel = path.relative_to(PACKAGE).as_posix()
    if rel == "data/fields.py":
      continue
    for line, name in literals(path.read_text()):
      if (rel, name) not in NOT_FIELDS:
        found.append(f"{rel}:{line}: {name!r} (import it from distflow_jax.data.fields)")
  assert found == []


def test_the_reader_finds_a_planted_literal_and_keyword():
  src = ('"""Doc: old_logprobs."""\n'
         'x = batch.data["old_logprobs"]\n'
         'y = batch.replace(rewards=1)\n'
         'z = f"{name} needs \'ref_logprobs\'"\n')
  assert sorted(literals(src)) == [(2, "old_logprobs"), (3, "rewards")]


def test_every_field_a_builtin_spec_names_is_in_the_catalogue():
  for name in FUNCTIONS.names():
    spec = FUNCTIONS.spec(name)
    for field in spec.requires | spec.produces:
      assert field in fields.FIELDS, (name, field)


def test_each_field_has_a_doc_a_shape_key_and_a_dtype():
  keys = {"P", "N", "PN", "I", "D", "3"}
  for f in fields.FIELDS.values():
    assert f.doc and set(f.trail) <= keys and np.dtype(f.dtype).kind in "biuf", f
