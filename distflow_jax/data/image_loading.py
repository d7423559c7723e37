"""Loading the images a data row names: references to decoded PIL images.

Where images come from (:func:`load_image`): a path (relative to the data file's folder,
or ``data.image_root`` when set, and resolving inside it; absolute only under it), a ``data:image/...;base64,`` URI or bare base64 text, raw bytes, or a
``{"bytes": ..., "path": ...}`` struct (Hugging Face ``datasets``' Image column in
Parquet).  EXIF orientation is applied, as transformers' ``load_image`` does.  Anything
unusable raises :class:`~distflow_jax.data.image_processor.ImageError`, one line naming
the image and what to do.  This module owns that decoding, the pixel cap checked from the
header (``DEFAULT_MAX_IMAGE_PIXELS``), a row's image field as a list
(:func:`image_values`) and the Pillow check (:func:`require_pillow`); preprocessing is
:mod:`distflow_jax.data.image_processor`'s.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
from typing import Any

from distflow_jax.config.errors import ConfigError
from distflow_jax.data.image_processor import ImageError

DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
_BASE64 = re.compile(r"[A-Za-z0-9+/\s]+={0,2}\s*")


def require_pillow() -> None:
  """A ConfigError, one line, when Pillow (which image rows need) is not installed."""
  try:
    import PIL.Image  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    raise ConfigError("image rows (data.image_key) need Pillow: pip install Pillow (or the "
                      "package's 'vision' extra)") from None


def image_values(value: Any) -> list[Any]:
  """A row's image field as a list of image references (None: no images)."""
  if value is None:
    return []
  if isinstance(value, (list, tuple)):
    return list(value)
  return [value]


def _describe(ref: Any) -> str:
  if isinstance(ref, (bytes, bytearray, memoryview)):
    return f"<{len(ref)} bytes>"
  text = str(ref)
  return repr(text if len(text) <= 60 else text[:40] + "...")


def load_image(ref: Any, base_dir: str = "", max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
               ) -> Any:
  """One image reference -> a decoded PIL image (EXIF orientation applied).  Raises
  :class:`ImageError` naming the image when it is missing, not an image, or larger than
  ``max_pixels`` (checked from the header, before decoding).

  With ``base_dir`` (the image root: the data file's folder or ``data.image_root``), a path
  is read from it and must resolve inside it, symlinks followed: ``../`` out of it and
  absolute paths elsewhere are refused without being opened.  Without it (a caller's own
  images, not a data file's) a path is taken as it is."""
  from PIL import Image  # pylint: disable=import-outside-toplevel
  if isinstance(ref, dict):  # datasets' Image struct: {"bytes": ..., "path": ...}
    data = ref.get("bytes")
    if data is None and ref.get("path") is None:
      raise ImageError("an image struct needs 'bytes' or 'path'")
    ref = data if data is not None else ref["path"]
  name = _describe(ref)
  if isinstance(ref, (bytes, bytearray, memoryview)):
    return _decode(io.BytesIO(bytes(ref)), f"image {name}", max_pixels)
  if not isinstance(ref, str):
    raise ImageError(f"an image must be a path, base64 text, bytes or a list of them, "
                     f"got {type(ref).__name__} {_describe(ref)}")
  if ref.startswith("data:"):
    head, _, payload = ref.partition(",")
    if ";base64" not in head:
      raise ImageError(f"image {name} is a data URI without ';base64'")
    return _decode(io.BytesIO(_b64(payload, name)), f"image {name}", max_pixels)
  path = os.path.join(base_dir, os.path.expanduser(ref)) if ref else ref
  inside = not base_dir or _inside(path, base_dir)
  if ref and inside and os.path.isfile(path):
    return _decode(path, f"image file {os.path.abspath(path)}", max_pixels)
  if len(ref) >= 64 and _BASE64.fullmatch(ref):  # before the root check: JPEG's starts "/9j/"
    try:
      data = _b64(ref, name)
      return _decode(io.BytesIO(data), f"image {name} (base64)", max_pixels)
    except ImageError:
      pass
  if ref and not inside:  # not opened, whether or not it exists
    raise ImageError(f"image path {name} resolves outside the image root "
                     f"{os.path.realpath(base_dir)!r}; image paths must stay inside the data "
                     f"file's folder (or data.image_root): no '..' out of it, no absolute "
                     f"path elsewhere")
  raise ImageError(f"image {name} not found: no file {os.path.abspath(path) if ref else ''!r}"
                   f" (relative paths are from the data file's folder; base64 text or a "
                   f"data: URI also work)")


def _inside(path: str, root: str) -> bool:
  """Whether ``path`` resolves (symlinks followed, '..' applied) to ``root`` or below it."""
  real, top = os.path.realpath(path), os.path.realpath(root)
  return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def _b64(text: str, name: str) -> bytes:
  try:
    return base64.b64decode("".join(text.split()), validate=True)
  except (binascii.Error, ValueError):
    raise ImageError(f"image {name} is not valid base64") from None


def _decode(source: Any, what: str, max_pixels: int) -> Any:
  from PIL import Image, ImageOps  # pylint: disable=import-outside-toplevel
  try:
    image = Image.open(source)
  except Image.DecompressionBombError as e:
    raise ImageError(f"{what} is too large ({e}); shrink it") from None
  except Exception as e:  # pylint: disable=broad-except  (untrusted bytes: any failure)
    raise ImageError(f"{what} is not a readable image ({_reason(e)})") from None
  width, height = image.size
  if width * height > max_pixels:
    raise ImageError(f"{what} is {width}x{height} = {width * height} pixels > "
                     f"data.max_image_pixels={max_pixels} (shrink the image or raise "
                     f"data.max_image_pixels)")
  try:
    image.load()
    image = ImageOps.exif_transpose(image)
  except Image.DecompressionBombError as e:
    raise ImageError(f"{what} is too large ({e}); shrink it") from None
  except Exception as e:  # pylint: disable=broad-except  (untrusted bytes: any failure)
    raise ImageError(f"{what} cannot be decoded ({_reason(e)}; truncated or corrupt?)"
                     ) from None
  return image


def _reason(e: BaseException) -> str:
  text = str(e).splitlines()[0] if str(e) else type(e).__name__
  return text if len(text) <= 120 else text[:117] + "..."
