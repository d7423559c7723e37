"""Images in prompts: placeholder tokens and prompt encoding for vision-language rows.

Each image stands for ``grid_t * grid_h * grid_w / merge_size**2`` placeholder tokens in
the prompt: ``<|vision_start|>`` then that many ``<|image_pad|>`` then ``<|vision_end|>``,
as Qwen2.5-VL's chat template and processor write it (:func:`encode_with_images`).  This
module owns those tokens: finding their ids, placing one block per image in the messages,
rendering, and expanding each ``<|image_pad|>`` to its image's count.

The rest of the image path lives beside it and is re-exported here under its old names:
:mod:`distflow_jax.data.image_processor` (the Qwen2-VL processor, :func:`smart_resize`,
:class:`ImageError`) and :mod:`distflow_jax.data.image_loading` (:func:`load_image`:
paths, base64, bytes and ``datasets`` structs to PIL images).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from distflow_jax.config.errors import ConfigError
from distflow_jax.data.image_loading import (  # noqa: F401 (re-exported)
    DEFAULT_MAX_IMAGE_PIXELS, image_values, load_image, require_pillow)
from distflow_jax.data.image_processor import (  # noqa: F401 (re-exported)
    CLIP_MEAN, CLIP_STD, PREPROCESSOR_FILE, RESAMPLE_NAMES, ImageError, ImageProcessor,
    smart_resize, to_rgb)

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
IMAGE_BLOCK = VISION_START + IMAGE_PAD + VISION_END
# A plain-text marker some datasets (verl's geo3k, ...) put where an image goes.
IMAGE_MARKER = "<image>"


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
