"""Images for vision-language prompts: loading, Qwen2-VL preprocessing, placeholder tokens.

The processor reproduces Hugging Face's Qwen2-VL / Qwen2.5-VL image processor (the PIL
one, ``Qwen2VLImageProcessorPil``) with numpy and Pillow, value for value:

  1. RGB: an image with transparency (an alpha band, or a palette with a transparent
     colour) is composited onto white (as transformers 5 does; 4.x dropped the alpha);
     any other mode is converted to RGB.
  2. Resize (Pillow, bicubic by default) to :func:`smart_resize`'s size: both sides a
     multiple of ``factor = patch_size * merge_size``, the aspect ratio nearly kept, and
     the area within ``[min_pixels, max_pixels]``.
  3. Rescale ``uint8 * rescale_factor`` (computed in float64, stored as float32), then
     normalize ``(x - mean) / std`` per channel in float32 (OpenAI CLIP's mean and std).
  4. Patchify: a still image is one temporal patch of ``temporal_patch_size`` copies of
     the frame.  Patches are ordered by merge window (row-major over the
     ``grid_h/merge x grid_w/merge`` windows), then row-major inside each ``merge x merge``
     window; each patch flattens as ``[channel, time, row, column]``.  ``pixel_values`` is
     ``[grid_t * grid_h * grid_w, C * temporal_patch_size * patch_size**2]`` and the
     image's ``image_grid_thw`` row is ``(1, grid_h, grid_w)``.

Each image stands for ``grid_t * grid_h * grid_w / merge_size**2`` placeholder tokens in
the prompt: ``<|vision_start|>`` then that many ``<|image_pad|>`` then ``<|vision_end|>``,
as Qwen2.5-VL's chat template and processor write it (:func:`encode_with_images`).

Where images come from (:func:`load_image`): a path (absolute, or relative to the data
file's folder), a ``data:image/...;base64,`` URI or bare base64 text, raw bytes, or a
``{"bytes": ..., "path": ...}`` struct (Hugging Face ``datasets``' Image column in
Parquet).  EXIF orientation is applied, as transformers' ``load_image`` does.  Anything
unusable raises :class:`ImageError`, one line naming the image and what to do.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import json
import math
import os
import re
from typing import Any, Sequence

import numpy as np

from distflow_jax.config.loading import ConfigError

# OpenAI CLIP's per-channel mean and std (RGB), the Qwen2-VL processors' defaults.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESSOR_FILE = "preprocessor_config.json"

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
IMAGE_BLOCK = VISION_START + IMAGE_PAD + VISION_END
# A plain-text marker some datasets (verl's geo3k, ...) put where an image goes.
IMAGE_MARKER = "<image>"

# Pillow's resampling filters by the number transformers' configs use for them.
RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box",
                  5: "hamming"}
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
_BASE64 = re.compile(r"[A-Za-z0-9+/\s]+={0,2}\s*")


class ImageError(ValueError):
  """An image that cannot be used: missing, unreadable, too large or misshapen."""


@dataclasses.dataclass(frozen=True)
class ImageProcessor:
  """Qwen2-VL image preprocessing settings; :meth:`from_dir` reads a model folder's
  ``preprocessor_config.json``."""
  min_pixels: int = 56 * 56
  max_pixels: int = 28 * 28 * 1280
  patch_size: int = 14
  temporal_patch_size: int = 2
  merge_size: int = 2
  image_mean: tuple[float, ...] = CLIP_MEAN
  image_std: tuple[float, ...] = CLIP_STD
  rescale_factor: float = 1 / 255
  resample: int = 3  # bicubic
  do_resize: bool = True
  do_rescale: bool = True
  do_normalize: bool = True
  do_convert_rgb: bool = True

  def __post_init__(self):
    for name in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size",
                 "merge_size"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    if self.min_pixels > self.max_pixels:
      raise ValueError(f"min_pixels={self.min_pixels} > max_pixels={self.max_pixels}")
    if self.resample not in RESAMPLE_NAMES:
      raise ValueError(f"resample={self.resample!r} is not one of {sorted(RESAMPLE_NAMES)} "
                       f"({RESAMPLE_NAMES})")
    for name in ("image_mean", "image_std"):
      value = getattr(self, name)
      if len(value) != 3 or not all(isinstance(v, (int, float)) for v in value):
        raise ValueError(f"{name}={value!r} must be 3 numbers (R, G, B)")
    if any(v == 0 for v in self.image_std):
      raise ValueError(f"image_std={self.image_std!r} has a zero")

  @property
  def factor(self) -> int:
    return self.patch_size * self.merge_size

  @property
  def patch_dim(self) -> int:
    return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

  @classmethod
  def from_config(cls, config: dict[str, Any]) -> "ImageProcessor":
    """From a ``preprocessor_config.json``'s dict.  ``min_pixels`` / ``max_pixels`` win over
    ``size`` (``{"shortest_edge", "longest_edge"}``, or the older ``{"min_pixels",
    "max_pixels"}``), as in transformers; unknown keys are ignored."""
    kw: dict[str, Any] = {}
    size = config.get("size")
    if isinstance(size, dict):
      lo = size.get("shortest_edge", size.get("min_pixels"))
      hi = size.get("longest_edge", size.get("max_pixels"))
      if lo is not None:
        kw["min_pixels"] = lo
      if hi is not None:
        kw["max_pixels"] = hi
    for f in dataclasses.fields(cls):
      if config.get(f.name) is not None:
        kw[f.name] = config[f.name]
    for name in ("image_mean", "image_std"):
      if name in kw:
        value = kw[name]
        kw[name] = tuple(value) if isinstance(value, (list, tuple)) else (value,) * 3
    return cls(**kw)

  @classmethod
  def from_dir(cls, path: str | os.PathLike | None) -> "ImageProcessor":
    """The settings of a model folder's ``preprocessor_config.json``; the defaults (those
    of Qwen2-VL and Qwen2.5-VL) when the folder has none (or ``path`` is None)."""
    if path is None:
      return cls()
    file = os.path.join(os.fspath(path), PREPROCESSOR_FILE)
    if not os.path.exists(file):
      return cls()
    try:
      with open(file, encoding="utf-8") as f:
        config = json.load(f)
      if not isinstance(config, dict):
        raise ValueError(f"it holds a {type(config).__name__}, not a JSON object")
      return cls.from_config(config)
    except (OSError, UnicodeDecodeError, ValueError, TypeError) as e:
      raise ConfigError(f"{file}: cannot use it as a Qwen2-VL image processor config: "
                        f"{e}") from None

  def grid(self, height: int, width: int) -> tuple[int, int, int]:
    """``(grid_t, grid_h, grid_w)`` of a still image of this size."""
    if self.do_resize:
      height, width = smart_resize(height, width, self.factor, self.min_pixels,
                                   self.max_pixels)
    return 1, height // self.patch_size, width // self.patch_size

  def num_image_tokens(self, grid_thw: Sequence[int]) -> int:
    """Placeholder tokens of an image with this ``image_grid_thw`` row."""
    t, h, w = (int(v) for v in grid_thw)
    return t * h * w // (self.merge_size * self.merge_size)

  def __call__(self, image: Any) -> tuple[np.ndarray, np.ndarray]:
    """One image (a PIL image, or a ``[H, W, C]`` / ``[H, W]`` uint8 array) ->
    ``(pixel_values [n, patch_dim] float32, image_grid_thw (1, grid_h, grid_w) int64)``."""
    from PIL import Image  # pylint: disable=import-outside-toplevel
    if isinstance(image, np.ndarray):
      image = Image.fromarray(image)
    if self.do_convert_rgb:
      image = to_rgb(image)
    elif image.mode != "RGB":
      raise ImageError(f"a {image.mode} image needs do_convert_rgb=True")
    width, height = image.size
    if self.do_resize:
      height, width = smart_resize(height, width, self.factor, self.min_pixels,
                                   self.max_pixels)
      image = image.resize((width, height), resample=Image.Resampling(self.resample))
    pixels = np.asarray(image)  # [H, W, 3] uint8
    if pixels.ndim != 3 or pixels.shape[2] != 3:
      raise ImageError(f"expected an RGB image, got an array of shape {pixels.shape}")
    pixels = np.moveaxis(pixels, -1, 0)  # [3, H, W]
    if self.do_rescale:
      pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
    else:
      pixels = pixels.astype(np.float32)
    if self.do_normalize:
      mean = np.asarray(self.image_mean, np.float32)[:, None, None]
      std = np.asarray(self.image_std, np.float32)[:, None, None]
      pixels = (pixels - mean) / std
    patches, grid_h, grid_w = self._patchify(pixels)
    return patches, np.array([1, grid_h, grid_w], np.int64)

  def _patchify(self, pixels: np.ndarray) -> tuple[np.ndarray, int, int]:
    c, height, width = pixels.shape
    p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
    if height % (p * m) or width % (p * m):
      raise ImageError(f"a {height}x{width} image is not a multiple of patch_size * "
                       f"merge_size = {p * m} on both sides (do_resize=False needs that)")
    grid_h, grid_w = height // p, width // p
    # Axes: channel, merge-window row, row in window, pixel row in patch, then the same
    # three for columns.
    x = pixels.reshape(c, grid_h // m, m, p, grid_w // m, m, p)
    # -> window row, window column, row in window, column in window, channel, py, px
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)
    # A still image is one temporal patch: the frame repeated t times (after the channel).
    x = np.repeat(x[:, :, :, :, :, None], t, axis=5)
    return (np.ascontiguousarray(x).reshape(grid_h * grid_w, c * t * p * p),
            grid_h, grid_w)

  def process(self, images: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Several images -> ``(pixel_values [sum n_i, patch_dim], image_grid_thw [k, 3])``
    (concatenated in order, as transformers returns them)."""
    if not images:
      return (np.zeros((0, self.patch_dim), np.float32), np.zeros((0, 3), np.int64))
    out = [self(im) for im in images]
    return (np.concatenate([o[0] for o in out]), np.stack([o[1] for o in out]))


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
  """The ``(height, width)`` an image is resized to: each side a multiple of ``factor``
  (the nearest, Python-rounded), scaled down (floor) when the area exceeds ``max_pixels``
  or up (ceil) when it is under ``min_pixels``, by one factor on both sides so the aspect
  ratio is kept as nearly as the grid allows.  Aspect ratios above 200 are refused."""
  if min(height, width) < 1:
    raise ImageError(f"a {width}x{height} image has no pixels")
  if max(height, width) / min(height, width) > 200:
    raise ImageError(f"a {width}x{height} image has an aspect ratio above 200 "
                     f"({max(height, width) / min(height, width):.0f}:1), too thin to patch")
  h = round(height / factor) * factor
  w = round(width / factor) * factor
  if h * w > max_pixels:
    scale = math.sqrt(height * width / max_pixels)
    h = max(factor, math.floor(height / scale / factor) * factor)
    w = max(factor, math.floor(width / scale / factor) * factor)
  elif h * w < min_pixels:
    scale = math.sqrt(min_pixels / (height * width))
    h = math.ceil(height * scale / factor) * factor
    w = math.ceil(width * scale / factor) * factor
  return h, w


def to_rgb(image: Any) -> Any:
  """A PIL image as RGB: transparency composited onto white, other modes converted."""
  from PIL import Image  # pylint: disable=import-outside-toplevel
  if "A" in image.getbands() or image.info.get("transparency") is not None:
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")
  return image.convert("RGB")


# ---------------------------------------------------------------------------------------
# Loading images named by a data row


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
  ``max_pixels`` (checked from the header, before decoding)."""
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
  if ref and os.path.isfile(path):
    return _decode(path, f"image file {os.path.abspath(path)}", max_pixels)
  if len(ref) >= 64 and _BASE64.fullmatch(ref):
    try:
      data = _b64(ref, name)
      return _decode(io.BytesIO(data), f"image {name} (base64)", max_pixels)
    except ImageError:
      pass
  raise ImageError(f"image {name} not found: no file {os.path.abspath(path) if ref else ''!r}"
                   f" (relative paths are from the data file's folder; base64 text or a "
                   f"data: URI also work)")


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


# ---------------------------------------------------------------------------------------
# Placeholder tokens


def token_id(tokenizer: Any, token: str) -> int | None:
  """The id of a special token, for our Tokenizer or a transformers one; None if absent."""
  inner = getattr(tokenizer, "tok", None)
  if inner is not None and hasattr(inner, "token_to_id"):
    return inner.token_to_id(token)
  convert = getattr(tokenizer, "convert_tokens_to_ids", None)
  if convert is not None:
    i = convert(token)
    unk = getattr(tokenizer, "unk_token_id", None)
    return None if i is None or (unk is not None and i == unk) else int(i)
  ids = list(tokenizer.encode(token))
  return int(ids[0]) if len(ids) == 1 else None


def vision_token_ids(tokenizer: Any) -> dict[str, int]:
  """The ids of ``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``; a
  ConfigError naming what is missing when the tokenizer lacks them (not a VL one)."""
  ids = {t: token_id(tokenizer, t) for t in (VISION_START, IMAGE_PAD, VISION_END)}
  missing = [t for t, i in ids.items() if i is None]
  if missing:
    raise ConfigError(f"the tokenizer has no {' / '.join(missing)} token(s), which image "
                      f"prompts need (data.image_key is set); use a Qwen2-VL / Qwen2.5-VL "
                      f"tokenizer, or set data.image_key='' for text-only rows")
  return ids  # type: ignore[return-value]


def place_images(messages: list[dict[str, str]], num_images: int
                 ) -> list[dict[str, str]]:
  """Messages with one ``<|vision_start|><|image_pad|><|vision_end|>`` block per image.

  Blocks already in the text and ``<image>`` markers (turned into blocks) are where the
  images go, in order; with neither, the blocks go before the first user message's text,
  as Qwen2.5-VL's template writes an image item given before the text.  Raises
  :class:`ImageError` when the text's blocks and markers do not number the images."""
  marked = sum(m["content"].count(IMAGE_BLOCK) + m["content"].count(IMAGE_MARKER)
               for m in messages)
  pads = sum(m["content"].count(IMAGE_PAD) for m in messages)
  if pads != sum(m["content"].count(IMAGE_BLOCK) for m in messages):
    raise ImageError(f"the prompt has a {IMAGE_PAD} outside a {IMAGE_BLOCK} block")
  if marked == 0 and num_images:
    out = [dict(m) for m in messages]
    first = next((i for i, m in enumerate(out) if m["role"] == "user"), 0)
    out[first]["content"] = IMAGE_BLOCK * num_images + out[first]["content"]
    return out
  if marked != num_images:
    raise ImageError(f"the prompt marks {marked} image(s) ({IMAGE_MARKER!r} or "
                     f"{IMAGE_BLOCK!r}) but the row has {num_images}")
  return [{**m, "content": m["content"].replace(IMAGE_MARKER, IMAGE_BLOCK)} for m in messages]


def expand_image_pads(ids: Sequence[int], pad_id: int, counts: Sequence[int]) -> np.ndarray:
  """Token ids with the i-th ``<|image_pad|>`` repeated ``counts[i]`` times (the image's
  placeholder tokens), as transformers' Qwen2.5-VL processor expands them."""
  ids = np.asarray(ids, np.int64)
  where = np.flatnonzero(ids == pad_id)
  if where.size != len(counts):
    raise ImageError(f"the rendered prompt has {where.size} {IMAGE_PAD} token(s) for "
                     f"{len(counts)} image(s) (does the chat template keep them?)")
  repeats = np.ones(ids.size, np.int64)
  repeats[where] = np.asarray(counts, np.int64)
  return np.repeat(ids, repeats).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class VisionPrompt:
  ids: np.ndarray             # [n] int32, image pads expanded
  pixel_values: np.ndarray    # [patches, patch_dim] float32, all images in order
  image_grid_thw: np.ndarray  # [images, 3] int64
  text: str | None            # the rendered prompt, one pad per image (None if ids)


def render(tokenizer: Any, messages: list[dict[str, str]], *, chat: bool,
           use_chat_template: bool = True) -> str | list[int]:
  """A prompt's messages as text through the tokenizer's chat template (always for chat
  messages, for plain text when ``use_chat_template``), else their contents joined."""
  template = getattr(tokenizer, "apply_chat_template", None)
  if getattr(tokenizer, "chat_template", "") is None:  # our Tokenizer without a template
    template = None
  if template is not None and (use_chat_template or chat):
    return template(messages, add_generation_prompt=True)
  return "\n".join(m["content"] for m in messages)


def encode_with_images(tokenizer: Any, prompt: str | list[dict[str, str]],
                       images: Sequence[Any], processor: ImageProcessor | None = None, *,
                       use_chat_template: bool = True) -> VisionPrompt:
  """Prompt ids with each image's ``<|image_pad|>`` repeated
  ``grid_t * grid_h * grid_w / merge_size**2`` times, and the images' pixel arrays.

  ``prompt`` is text or ``{"role", "content"}`` messages; images go where the text marks
  them (``<image>`` or a vision block), else before the first user message's text (see
  :func:`place_images`).  ``images`` are PIL images or uint8 arrays."""
  require_pillow()
  processor = processor or ImageProcessor()
  vision = vision_token_ids(tokenizer)
  chat = not isinstance(prompt, str)
  messages = ([dict(m) for m in prompt] if chat
              else [{"role": "user", "content": prompt}])
  messages = place_images(messages, len(images))
  pixel_values, grid = processor.process(images)
  rendered = render(tokenizer, messages, chat=chat, use_chat_template=use_chat_template)
  ids = rendered if not isinstance(rendered, str) else tokenizer.encode(rendered)
  ids = expand_image_pads(ids, vision[IMAGE_PAD],
                          [processor.num_image_tokens(g) for g in grid])
  return VisionPrompt(ids, pixel_values, grid, rendered if isinstance(rendered, str) else None)
