"""A failed write named in one line, whichever thread or library raised it.

    disk = io_errors.find(error)   # DiskError(kind, path) or None
    disk.line()                    # "no space left on device: /runs/x/checkpoints/1/...: free ..."

A full disk reaches the command in several shapes: an ``OSError`` with ``errno.ENOSPC``
(with or without a file name: a ``write`` or ``close`` inside ``with open(p) as f`` has
none), or, from orbax's background threads and TensorStore, a ``ValueError`` whose text
says ``RESOURCE_EXHAUSTED: ... Failed writing: "<path>" ... No space left on device``.  The
last one carries the word RESOURCE_EXHAUSTED that XLA uses for device memory, so this
module is asked first: a full disk is never reported as running out of memory.

Writers in Rust (``tokenizers``' ``save``, ``safetensors``' ``save_file``) raise a plain
``Exception`` whose text is ``No space left on device (os error 28)``, with no path and no
Python file object to find one in: a call to one is wrapped in ``writing(path)``, which
names the path it was given.  A copy (``shutil.copy``) names its source first and its
destination second: the destination is the file a full disk failed to write.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import os
import re

# errno -> (what it is, what to do)
KINDS: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("no space left on device", "free space on that disk or write elsewhere"),
    errno.EDQUOT: ("disk quota exceeded", "free space within the quota or write elsewhere"),
    errno.EIO: ("input/output error", "check that disk (dmesg) or write elsewhere"),
}
# The same errors as text (TensorStore / orbax / absl put them in messages).
_TEXTS = {"No space left on device": errno.ENOSPC, "os_error_code='28'": errno.ENOSPC,
          "Disk quota exceeded": errno.EDQUOT, "Input/output error": errno.EIO}
# Where such a message names the path, most specific first.
_PATHS = (re.compile(r'Failed (?:writing|to write|to open|renaming)[^"]*"([^"]+)"'),
          re.compile(r'(?:local )?file "([^"]+)"'), re.compile(r"directory: (\S+)"))


@dataclasses.dataclass(frozen=True)
class DiskError:
  code: int            # errno
  path: str | None     # the file or folder being written, when it can be told

  def line(self) -> str:
    what, todo = KINDS[self.code]
    where = f": {self.path}" if self.path else ""
    return f"{what}{where} ({todo})"


def _chain(error: BaseException):
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def _file_name(value) -> str | None:
  """The path of an open file object; None for anything else, and for a stream whose
  name is no path (``<stderr>``, pytest's capture file ``<_io.FileIO name=51 ...>``)."""
  if not isinstance(value, io.IOBase):
    return None
  name = getattr(value, "name", None)
  if not isinstance(name, str) or not name or name.startswith("<"):
    return None
  return os.path.abspath(name)


def _open_file_path(error: BaseException) -> str | None:
  """The name of a file object in the innermost frame of ``error``'s traceback that holds
  one, as a local or an attribute of one (``self._writer``): what ``with open(path, "w")
  as f`` was writing when ``write``/``close`` failed."""
  tb, frames = error.__traceback__, []
  while tb is not None:
    frames.append(tb.tb_frame)
    tb = tb.tb_next
  for frame in reversed(frames):
    values = list(frame.f_locals.values())
    for value in values + [a for v in values for a in _attributes(v)]:
      name = _file_name(value)
      if name is not None:
        return name
  return None


def _attributes(value) -> list:
  if isinstance(value, type):
    return []
  d = getattr(value, "__dict__", None)
  return list(d.values()) if isinstance(d, dict) else []


def _path_in(text: str) -> str | None:
  for pattern in _PATHS:
    m = pattern.search(text)
    if m:
      return m.group(1)
  return None


def find(error: BaseException) -> DiskError | None:
  """The disk error ``error`` is (or was caused by), with its path; None for anything else."""
  for e in _chain(error):
    if isinstance(e, OSError) and e.errno in KINDS:
      name = e.filename2 if isinstance(e.filename2, (str, bytes)) else e.filename
      path = os.fsdecode(name) if isinstance(name, (str, bytes)) else None
      return DiskError(e.errno, path or _open_file_path(e))
    text = str(e)
    code = next((c for t, c in _TEXTS.items() if t in text), None)
    if code is not None:
      return DiskError(code, _path_in(text) or _open_file_path(e))
  return None


@contextlib.contextmanager
def writing(path: str | os.PathLike):
  """Names ``path`` on a disk error raised inside that names no path of its own (a Rust
  writer's); any other error passes through unchanged."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except  - re-raised unless a disk error
    disk = find(e)
    if disk is None or disk.path is not None:
      raise
    raise OSError(disk.code, os.strerror(disk.code), os.fspath(path)) from e
