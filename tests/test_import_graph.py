"""The house's import rules (issue 37): no import circle and no import from a lower layer
to a higher one, read from the source of ``distflow_jax/`` (imports inside functions and
under ``TYPE_CHECKING`` count too).  The layer order is the block between the ``layers``
markers of docs/architecture.md; this test reads it there, so the two cannot disagree.
"""

import ast
import os
import warnings

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "distflow_jax"
pytestmark = pytest.mark.timeout(60)


def layers(doc: str | None = None) -> list[tuple[str, tuple[str, ...]]]:
  """``[(layer name, module prefixes)]``, bottom first, from docs/architecture.md."""
  text = doc if doc is not None else open(os.path.join(REPO, "docs", "architecture.md")).read()
  block = text.split("<!-- layers -->", 1)[1].split("<!-- /layers -->", 1)[0]
  out = []
  for line in block.strip().strip("`").strip().splitlines():
    if not line.strip() or line.lstrip().startswith("#"):
      continue
    name, *mods = line.split()
    out.append((name, tuple(m if m.startswith(PKG) else f"{PKG}.{m}" for m in mods)))
  return out


def modules(root: str) -> dict[str, str]:
  """Module name -> file, for every ``.py`` under ``root/distflow_jax``."""
  out = {}
  for dp, _, fs in os.walk(os.path.join(root, PKG)):
    for f in fs:
      if f.endswith(".py"):
        path = os.path.join(dp, f)
        mod = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
        out[mod[:-len(".__init__")] if mod.endswith(".__init__") else mod] = path
  return out


def imports(mods: dict[str, str]) -> dict[str, set[str]]:
  """Module -> the modules of the package it imports (the deepest one that exists)."""
  def resolve(name: str) -> str:
    while name and name not in mods:
      name = name.rpartition(".")[0]
    return name
  edges = {}
  for mod, path in mods.items():
    pkg = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
      if isinstance(node, ast.Import):
        found |= {resolve(a.name) for a in node.names if a.name.startswith(PKG)}
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          up = pkg
          for _ in range(node.level - 1):
            up = up.rpartition(".")[0]
          base = up + ("." + base if base else "")
        if base.startswith(PKG):
          found |= {resolve(f"{base}.{a.name}") for a in node.names}
    found.discard(mod)
    found.discard("")
    edges[mod] = found
  return edges


def layer_of(mod: str, order) -> int:
  """The layer of the longest prefix naming ``mod`` (the package root only by name)."""
  best, depth = None, -1
  for i, (_, prefixes) in enumerate(order):
    for p in prefixes:
      if (mod == p or (p != PKG and mod.startswith(p + "."))) and len(p) > depth:
        best, depth = i, len(p)
  if best is None:
    raise AssertionError(f"module {mod} is in no layer of docs/architecture.md")
  return best


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (iterative Tarjan)."""
  index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
  for root in sorted(edges):
    if root in index:
      continue
    work = [(root, iter(sorted(edges[root])))]
    index[root] = low[root] = counter[0]
    counter[0] += 1
    stack.append(root)
    on.add(root)
    while work:
      v, it = work[-1]
      nxt = next(it, None)
      if nxt is not None:
        if nxt not in index:
          index[nxt] = low[nxt] = counter[0]
          counter[0] += 1
          stack.append(nxt)
          on.add(nxt)
          work.append((nxt, iter(sorted(edges.get(nxt, ())))))
        elif nxt in on:
          low[v] = min(low[v], index[nxt])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[v])
      if low[v] == index[v]:
        comp = []
        while True:
          w = stack.pop()
          on.discard(w)
          comp.append(w)
          if w == v:
            break
        if len(comp) > 1:
          out.append(sorted(comp))
  return out


def violations(root: str, doc: str | None = None) -> list[str]:
  mods = modules(root)
  edges = imports(mods)
  order = layers(doc)
  bad = [f"import circle: {' <-> '.join(c)}" for c in cycles(edges)]
  for a in sorted(edges):
    for b in sorted(edges[a]):
      la, lb = layer_of(a, order), layer_of(b, order)
      if lb > la:
        bad.append(f"upward import: {a} ({order[la][0]}) imports {b} ({order[lb][0]})")
  return bad


def test_no_import_circle_and_no_upward_import():
  bad = violations(REPO)
  assert not bad, "\n".join(bad)


def test_the_check_fails_on_a_planted_circle_and_an_upward_import(tmp_path):
  """A copy of the package with one circle and one upward import planted fails, naming
  both edges."""
  import shutil
  shutil.copytree(os.path.join(REPO, PKG), tmp_path / PKG,
                  ignore=shutil.ignore_patterns("__pycache__"))
  with open(tmp_path / PKG / "dag" / "graph.py", "a") as f:
    f.write("\nfrom distflow_jax.dag import planner  # planted\n")   # planner -> ... -> graph
  with open(tmp_path / PKG / "models" / "layers.py", "a") as f:
    f.write("\ndef _planted():\n  from distflow_jax.run import trainer  # planted\n")
  bad = violations(str(tmp_path))
  assert any(m.startswith("import circle:") and "distflow_jax.dag.graph" in m
             and "distflow_jax.dag.planner" in m for m in bad), bad
  assert ("upward import: distflow_jax.models.layers (libraries) imports "
          "distflow_jax.run.trainer (run)") in bad, bad


# Module sizes (issue 53): over REPORT_LINES a module is listed in pytest's warnings summary,
# a prompt to look at its jobs, not a reason to split one job in two; over MAX_LINES it
# fails: a room that big holds more than one job.
REPORT_LINES = 350
MAX_LINES = 450


def module_lines(root: str) -> dict[str, int]:
  return {m: sum(1 for _ in open(p)) for m, p in modules(root).items()}


def too_long(sizes: dict[str, int]) -> dict[str, int]:
  return {m: n for m, n in sizes.items() if n > MAX_LINES}


def test_module_sizes_are_reported_over_350_lines_and_capped_at_450():
  sizes = module_lines(REPO)
  over = sorted((n, m) for m, n in sizes.items() if n > REPORT_LINES)
  if over:
    warnings.warn(f"modules over {REPORT_LINES} lines (reported, not refused): "
                  + ", ".join(f"{m} {n}" for n, m in reversed(over)))
  assert not too_long(sizes), too_long(sizes)


def test_the_size_cap_fails_on_a_planted_long_module(tmp_path):
  import shutil
  shutil.copytree(os.path.join(REPO, PKG), tmp_path / PKG,
                  ignore=shutil.ignore_patterns("__pycache__"))
  (tmp_path / PKG / "models" / "planted.py").write_text("x = 1\n" * (MAX_LINES + 1))
  assert too_long(module_lines(str(tmp_path))) == {"distflow_jax.models.planted": MAX_LINES + 1}
