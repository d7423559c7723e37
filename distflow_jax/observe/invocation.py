"""How a hint names this package's command so that it runs when pasted into a shell.

A run ends with the commands to run next (``progress.summary_lines``).  In a fresh shell
the venv that installed ``distflow-jax`` is usually not active, and a bare
``distflow-jax`` there is "command not found".  So a hint names the script beside the
running interpreter by its full path, unless that very script is what ``PATH`` finds.

    command()  # "distflow-jax", or "/path/to/.venv/bin/distflow-jax"
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys

SCRIPT = "distflow-jax"


def command() -> str:
  """The shell words that run ``distflow-jax`` as this process runs it: the bare name when
  ``PATH`` finds this interpreter's script, else its full path, else (no script installed
  beside the interpreter) ``<python> -m distflow_jax.cli``."""
  if not sys.executable:
    return SCRIPT
  # Not resolved: a venv's python is a link to the base interpreter, outside the venv.
  script = os.path.join(os.path.dirname(sys.executable), SCRIPT)
  if not os.path.isfile(script):
    return f"{shlex.quote(sys.executable)} -m distflow_jax.cli"
  found = shutil.which(SCRIPT)
  if found is not None and os.path.samefile(found, script):
    return SCRIPT
  return shlex.quote(script)
