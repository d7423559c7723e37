"""``plan --programs``: how many programs a run compiles before step 2, by node and kind.

The count is of the catalogue ``plan --lower`` lowers (``catalogue.programs``): every
program a run builds by the end of its first step with ``trainer.compile_ahead`` on (the
first step's own programs, then every prompt width and prefill shape ahead, and a save's
checksums).  A program jax compiles as several executables (the cache's layer-by-layer
grow: ``trace(...).parts``) counts each; the same jitted function with the same abstract
arguments twice counts once, as jax's cache compiles it once.  A run logs the number it
built as ``compile/programs`` in its first step's row (run/compile_cache.py), eager
operations aside, as here.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax

from distflow_jax.lowering.program import Catalogue, Program
from distflow_jax.rollout.engine import cache_growth


@dataclasses.dataclass(frozen=True)
class Count:
  total: int
  by_node: dict[str, dict[str, int]]   # node -> program kind (name before "[") -> count


def _signature(p: Program) -> Any:
  leaves, treedef = jax.tree.flatten((p.args, p.kwargs))
  sig = tuple((x.shape, str(x.dtype), getattr(x, "sharding", None))
              if hasattr(x, "shape") and hasattr(x, "dtype") else x for x in leaves)
  return id(p.fn), treedef, sig


def _executables(p: Program) -> int:
  """How many executables ``p`` compiles as (a program of several parts: each)."""
  if not isinstance(p.fn, cache_growth.Grower):
    return 1
  return len(p.trace().parts)


def count(cat: Catalogue) -> Count:
  by_node: dict[str, collections.Counter] = {}
  seen, total = set(), 0
  for p in cat.programs:
    try:
      sig = _signature(p)
    except TypeError:  # an unhashable static argument: count it as its own
      sig = (id(p),)
    if sig in seen:
      continue
    seen.add(sig)
    n = _executables(p)
    by_node.setdefault(p.node, collections.Counter())[p.name.split("[")[0]] += n
    total += n
  return Count(total, {k: dict(v) for k, v in by_node.items()})


def render(c: Count) -> str:
  lines = [f"programs a run compiles before step 2 (trainer.compile_ahead on): {c.total}"]
  for node, kinds in c.by_node.items():
    body = ", ".join(f"{k} {v}" for k, v in kinds.items())
    lines.append(f"  {node:<16} {sum(kinds.values()):>4}  {body}")
  return "\n".join(lines)
