"""The Qwen2-VL / Qwen2.5-VL image processor: one image to ``pixel_values`` and its grid.

This module owns the preprocessing, which reproduces Hugging Face's Qwen2-VL / Qwen2.5-VL
image processor (the PIL one, ``Qwen2VLImageProcessorPil``) with numpy and Pillow, value
for value, and :class:`ImageError`, the one error of the image path
(:mod:`distflow_jax.data.image_loading` decodes the images, :mod:`distflow_jax.data.images`
turns them into prompt tokens):

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
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Sequence

import numpy as np

from distflow_jax.config.errors import ConfigError

# OpenAI CLIP's per-channel mean and std (RGB), the Qwen2-VL processors' defaults.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESSOR_FILE = "preprocessor_config.json"

# Pillow's resampling filters by the number transformers' configs use for them.
RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box",
                  5: "hamming"}


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
