"""Importing the user's own modules (``config.plugins``, ``rollout.env=module:Class``).

    module = import_user_module("my_envs")            # importable, or my_envs.py here
    module = import_user_module("plugins/rewards.py")  # a file, by path

A name is imported as Python would, and then from the working directory (the
``distflow-jax`` script's own folder, not the working directory, is first on
``sys.path``, so a ``my_envs.py`` beside the user's config would otherwise be missed).
A path (ending in ``.py``) is imported from that file under its stem's name; every
process of a run imports the same path, so it must exist on each host.  Failures are one
ConfigError line naming the module (raised by the callers).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType


def import_user_module(spec: str) -> ModuleType:
  """The module ``spec`` names (see the module doc); ImportError when there is none."""
  if spec.endswith(".py"):
    path = Path(spec).expanduser()
    if not path.is_file():
      raise ImportError(f"no such file {str(path)!r}")
    name = path.stem
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(
        path.resolve()):
      return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path.resolve())
    if loader_spec is None or loader_spec.loader is None:
      raise ImportError(f"{str(path)!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
      loader_spec.loader.exec_module(module)
    except BaseException:
      sys.modules.pop(name, None)
      raise
    return module
  try:
    return importlib.import_module(spec)
  except ModuleNotFoundError as e:
    cwd = os.getcwd()
    if e.name != spec.split(".")[0] or cwd in sys.path or "" in sys.path:
      raise
    sys.path.append(cwd)  # after everything installed: an installed module still wins
    return importlib.import_module(spec)
