"""Imports inside functions (issue 53): under 5% of the package's imports, and each one has
a reason a reader can check, so the import graph is what a module's head says.

A function-level import is accepted for one of these reasons, read from the source:
- ``keeps jax out``: the importing module imports no jax at module level (the planner, the
  CLI, the config checks start without it) and the imported one does;
- ``guarded``: it sits in a ``try`` that handles its absence (an optional package, a jax
  version without a private module);
- ``deferred``: a heavy library only one feature needs (``DEFERRED``: plots, parquet,
  images, TensorBoard, chat templates, GGUF files, wandb), imported when that feature runs;
- ``private jax``: a ``jax._src`` module, looked up only where it is used.
Any other is refused, naming the file and line: move it to the module's head.
"""

import ast
import os

import pytest

from test_import_graph import PKG, REPO, imports, modules

pytestmark = pytest.mark.timeout(60)

LIMIT = 0.05
JAX = ("jax", "jaxlib", "flax", "optax", "orbax")
DEFERRED = {"matplotlib", "pyarrow", "PIL", "tensorboardX", "jinja2", "gguf", "wandb",
            "jetstream", "tokenizers", "math_verify", "transformers", "torch"}


def _external_heads(path: str) -> set[str]:
  """The top-level names of the packages a module imports at module level (not in a
  function, not under ``TYPE_CHECKING``)."""
  heads = set()
  tree = ast.parse(open(path).read(), path)
  for node in _module_level(tree):
    if isinstance(node, ast.Import):
      heads |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
      heads.add(node.module.split(".")[0])
  return heads


def _module_level(tree):
  stack = list(tree.body)
  while stack:
    node = stack.pop()
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      if isinstance(node, ast.ClassDef):
        stack.extend(node.body)
      continue
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      continue
    yield node
    stack.extend(ast.iter_child_nodes(node))


def _top_edges(mods):
  """Module -> package modules it imports at module level (with its parent packages)."""
  edges = {}
  for mod, path in mods.items():
    tree = ast.parse(open(path).read(), path)
    top = ast.Module(body=[n for n in _module_level(tree)
                           if isinstance(n, (ast.Import, ast.ImportFrom))], type_ignores=[])
    edges[mod] = _resolve_imports(top, mods, mod)
  return edges


def _resolve_imports(tree, mods, mod):
  def resolve(name):
    while name and name not in mods:
      name = name.rpartition(".")[0]
    return name
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found |= {resolve(a.name) for a in node.names if a.name.startswith(PKG)}
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PKG):
      found |= {resolve(f"{node.module}.{a.name}") for a in node.names}
  found.discard(mod)
  found.discard("")
  return found


def _closure(mod, edges, mods):
  seen, todo = set(), [mod]
  while todo:
    m = todo.pop()
    if m in seen:
      continue
    seen.add(m)
    parts = m.split(".")
    todo.extend(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in mods)
    todo.extend(edges.get(m, ()))
  return seen


def function_imports(root: str = REPO):
  """``(module, line, statement, reason or None)`` for each import inside a function, and
  the package's import count."""
  mods = modules(root)
  edges = _top_edges(mods)
  heads = {m: _external_heads(p) for m, p in mods.items()}
  jaxy = {}

  def uses_jax(m):
    if m not in jaxy:
      jaxy[m] = any(h in JAX for x in _closure(m, edges, mods) for h in heads.get(x, ()))
    return jaxy[m]

  out, total = [], 0
  for mod, path in sorted(mods.items()):
    tree = ast.parse(open(path).read(), path)
    parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    for node in ast.walk(tree):
      if not isinstance(node, (ast.Import, ast.ImportFrom)):
        continue
      total += 1
      chain, p = [], parents.get(node)
      while p is not None:
        chain.append(p)
        p = parents.get(p)
      if not any(isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)) for p in chain):
        continue
      out.append((mod, node.lineno, ast.unparse(node), _reason(node, chain, mod, mods,
                                                                uses_jax)))
  return out, total


def _reason(node, chain, mod, mods, uses_jax):
  names = ([a.name for a in node.names] if isinstance(node, ast.Import)
           else [node.module or ""])
  if any(isinstance(p, ast.Try) and any(_handles_absence(h) for h in p.handlers)
         for p in chain):
    return "guarded"
  if all(n.startswith("jax._src") for n in names):
    return "private jax"
  if all(n.split(".")[0] in DEFERRED for n in names):
    return "deferred"
  if not uses_jax(mod):
    pulled = [n for n in names if n.split(".")[0] in JAX]
    pulled += [t for t in _resolve_imports(ast.Module(body=[node], type_ignores=[]), mods, mod)
               if uses_jax(t)]
    if pulled:
      return "keeps jax out"
  return None


def _handles_absence(handler: ast.ExceptHandler) -> bool:
  if handler.type is None:
    return True
  kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
  return any(isinstance(k, ast.Name) and k.id in ("ImportError", "ModuleNotFoundError",
                                                    "Exception") for k in kinds)


def test_function_level_imports_are_few_and_each_has_a_reason():
  found, total = function_imports()
  unexplained = [f"{m}:{line} {stmt}" for m, line, stmt, why in found if why is None]
  assert not unexplained, ("imports inside functions with no reason to be there (move them "
                           "to the module's head): " + "; ".join(unexplained))
  assert len(found) < LIMIT * total, (f"{len(found)} of {total} imports are inside "
                                      f"functions, over {LIMIT:.0%}")


def test_a_planted_function_import_without_a_reason_is_named(tmp_path):
  import shutil
  shutil.copytree(os.path.join(REPO, PKG), tmp_path / PKG,
                  ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copytree(os.path.join(REPO, "docs"), tmp_path / "docs")
  with open(tmp_path / PKG / "algos" / "masked.py", "a") as f:
    f.write("\n\ndef planted():\n  import math\n  from distflow_jax.algos import kl\n"
            "  return math, kl\n")
  found, _ = function_imports(str(tmp_path))
  bad = sorted(stmt for m, _, stmt, why in found if m == f"{PKG}.algos.masked" and why is None)
  assert bad == ["from distflow_jax.algos import kl", "import math"], bad
  # the same import kept out of a jax-free module has its reason
  with open(tmp_path / PKG / "dag" / "spec.py", "a") as f:
    f.write("\n\ndef planted():\n  from distflow_jax.algos import kl\n  return kl\n")
  found, _ = function_imports(str(tmp_path))
  assert [why for m, _, stmt, why in found if m == f"{PKG}.dag.spec"] == ["keeps jax out"]
