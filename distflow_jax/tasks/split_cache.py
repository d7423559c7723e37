"""A built-in task's generated split, kept between runs: ``write_split`` writes it into a run
and takes it from the cache when a verified copy of the same split is there.

A split is a pure function of the task's code, its level, the split, the row count, the
seed and ``unique`` (tasks/registry.py); drawing the default 20,000 training rows takes
about 0.35 s of Python, paid by every process of every run before.  The cache keys a
split by all of those, the code as the sha256 of the task's own source file and of this
package's (a changed generator is a new key), and keeps the file's sha256 beside it: a
copy whose bytes do not match is regenerated, never used.  A task whose source cannot be
read (defined in ``__main__`` or built at run time) is not cached.

``DISTFLOW_JAX_DATA_CACHE`` names the folder (``""`` = off); unset, it is
``~/.cache/distflow-jax/data``.  A folder that cannot be written only costs the time: the
split is generated as before.  The run's own copy (``run_dir/data``) is written either way.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import shutil
import sys
from typing import Any

from distflow_jax.tasks import arithmetic

ENV = "DISTFLOW_JAX_DATA_CACHE"
DEFAULT = "~/.cache/distflow-jax/data"


def folder() -> str:
  value = os.environ.get(ENV)
  return os.path.expanduser(DEFAULT if value is None else value) if value != "" else ""


@functools.lru_cache(maxsize=None)
def _package_hash() -> str:
  here = os.path.dirname(os.path.abspath(__file__))
  h = hashlib.sha256()
  for name in sorted(os.listdir(here)):
    if name.endswith(".py"):
      with open(os.path.join(here, name), "rb") as f:
        h.update(name.encode() + b"\0" + f.read())
  return h.hexdigest()


def _code_hash(task: Any) -> str | None:
  """The task's source and this package's, or None when its source cannot be read."""
  try:
    path = inspect.getsourcefile(type(task))
    with open(path, "rb") as f:  # type: ignore[arg-type]
      own = f.read()
  except (TypeError, OSError):
    return None
  return hashlib.sha256(own + _package_hash().encode()).hexdigest()


def key(task: Any, level: str, split: str, count: int, seed: int, unique: bool) -> str | None:
  code = _code_hash(task)
  if code is None:
    return None
  what = (f"{task.name}|{level}|{split}|{count}|{seed}|{unique}|{code}|"
          f"{sys.version_info[0]}.{sys.version_info[1]}")
  return f"{task.name}_{level}_{split}_" + hashlib.sha256(what.encode()).hexdigest()[:24]


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _copy(src: str, dst: str) -> None:
  """``src`` to ``dst`` under a name of this process's first (never half a file at ``dst``)."""
  os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
  tmp = f"{dst}.{os.getpid()}.tmp"
  shutil.copyfile(src, tmp)
  os.replace(tmp, dst)


def _cached(base: str) -> bool:
  """Whether ``base``.jsonl is there with the sha256 beside it matching its bytes."""
  try:
    with open(base + ".sha256") as f:
      want = f.read().strip()
    return bool(want) and _sha256(base + ".jsonl") == want
  except OSError:
    return False


def write_split(task: Any, level: str, split: str, count: int, *, seed: int, unique: bool,
                path: str) -> bool:
  """Writes the split to ``path``; returns whether it came from the cache."""
  where = folder()
  name = key(task, level, split, count, seed, unique) if where else None
  base = os.path.join(where, name) if name else ""
  if base and _cached(base):
    try:
      _copy(base + ".jsonl", path)
      return True
    except OSError:
      pass
  arithmetic.write_jsonl(task.generate_split(level, split, count, seed=seed, unique=unique), path)
  if base:
    try:  # the data first, its sha256 last: a copy without a matching sum is never read
      digest = _sha256(path)
      _copy(path, base + ".jsonl")
      tmp = f"{base}.sha256.{os.getpid()}.tmp"
      with open(tmp, "w") as f:
        f.write(digest + "\n")
      os.replace(tmp, base + ".sha256")
    except OSError:
      pass  # the cache only saves time
  return False
