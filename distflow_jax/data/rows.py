"""One data row to one tokenized prompt example (the loader's map step).

:func:`parse_row` validates, renders and tokenizes a raw row, or says in a
:class:`~distflow_jax.data.sources.BadRow` (one of :data:`REASONS`) why it cannot be used;
:mod:`distflow_jax.data.loader` counts and skips or refuses those, and the SFT and
warm-start data read their rows through it too.

Row fields: ``prompt_key`` / ``answer_key`` / ``source_key`` are column names or dotted
paths into nested rows (``reward_model.ground_truth``, see
:func:`~distflow_jax.data.sources.field_value`), so verl's Parquet layout (``prompt`` as
chat messages, ``reward_model.ground_truth``) reads as it is.  A prompt is text or a list
of ``{"role", "content"}`` messages; messages are always rendered with the tokenizer's chat
template when it has one (``use_chat_template`` decides only for plain text), else their
contents are joined.

With ``image_key`` (a field holding an image path, base64, bytes or a list of them; see
:mod:`distflow_jax.data.image_loading`), a row's images are preprocessed as Qwen2-VL's
processor does: the example's host fields gain ``pixel_values`` and ``image_grid_thw``,
and its prompt ids hold each image's placeholder tokens (``<|image_pad|>`` repeated).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Protocol, Sequence

import numpy as np

from distflow_jax.data import images as images_lib
from distflow_jax.data.sources import BadRow, answer_text, field_value, messages_of

REASONS = ("bad_json", "not_utf8", "missing_field", "empty_prompt", "empty_answer", "too_long",
           "bad_image")


class Tokenizer(Protocol):
  def encode(self, text: str) -> Sequence[int]: ...


@dataclasses.dataclass(frozen=True)
class Example:
  record: int
  prompt_ids: np.ndarray
  host: dict[str, Any]


def parse_row(raw: dict[str, Any] | BadRow, record: int, *, tokenizer: Tokenizer,
              max_prompt_len: int, prompt_key: str = "prompt",
              answer_key: str = "answer", source_key: str = "data_source",
              default_source: str = "", use_chat_template: bool = True,
              image_key: str = "", image_dir: str = "",
              image_processor: images_lib.ImageProcessor | None = None,
              max_image_pixels: int = images_lib.DEFAULT_MAX_IMAGE_PIXELS,
              image_pad_id: int | None = None) -> Example | BadRow:
  """Validates, renders and tokenizes one raw row.

  With ``image_key``, the row's images (see :mod:`distflow_jax.data.images`) are loaded,
  preprocessed into ``host["pixel_values"]`` / ``host["image_grid_thw"]``, and each one's
  ``<|image_pad|>`` (``image_pad_id``) in the ids is repeated for its placeholder tokens;
  an unusable image makes the row a ``bad_image`` one."""
  if isinstance(raw, BadRow):
    return raw
  for key in (prompt_key, answer_key):
    if field_value(raw, key) is None:
      return BadRow("missing_field", f"no {key!r} field (row has {sorted(raw)})")
  prompt_value = field_value(raw, prompt_key)
  messages = messages_of(prompt_value, prompt_key)
  if isinstance(messages, BadRow):
    return messages
  if not any(m["content"].strip() for m in messages):
    return BadRow("empty_prompt", f"field {prompt_key!r} is empty")
  answer = answer_text(field_value(raw, answer_key), answer_key)
  if isinstance(answer, BadRow):
    return answer
  if not answer.strip():  # nothing to verify against: every completion would score 0
    return BadRow("empty_answer", f"field {answer_key!r} is empty (no ground truth to score "
                  f"against; is data.answer_key the right field?)")
  is_chat = not isinstance(prompt_value, (str, bytes))
  vision = None
  if image_key:
    try:
      refs = images_lib.image_values(field_value(raw, image_key))
      if not refs:  # an image row without an image: nothing for its placeholders
        raise images_lib.ImageError("holds no image (null or an empty list); every row of "
                                    "an image dataset needs at least one")
      loaded = [images_lib.load_image(r, image_dir, max_image_pixels) for r in refs]
      original_messages = messages
      messages = images_lib.place_images(messages, len(loaded))
      processor = image_processor or images_lib.ImageProcessor()
      vision = processor.process(loaded)
    except images_lib.ImageError as e:
      return BadRow("bad_image", f"field {image_key!r}: {e}")
  # Messages are a conversation: joined without their roles they would be another prompt.
  rendered = images_lib.render(tokenizer, messages, chat=is_chat,
                               use_chat_template=use_chat_template)
  ids = list(rendered) if not isinstance(rendered, str) else tokenizer.encode(rendered)
  ids = np.asarray(ids, dtype=np.int32)
  if vision is not None:
    pad_id = (image_pad_id if image_pad_id is not None
              else images_lib.vision_token_ids(tokenizer)[images_lib.IMAGE_PAD])
    try:
      ids = images_lib.expand_image_pads(
          ids, pad_id, [processor.num_image_tokens(g) for g in vision[1]])
    except images_lib.ImageError as e:
      return BadRow("bad_image", f"field {image_key!r}: {e}")
    messages = original_messages
  if ids.size == 0:
    return BadRow("empty_prompt", "the prompt tokenizes to nothing")
  unk = getattr(tokenizer, "unk_id", None)
  unknown = 0 if unk is None else int(np.sum(ids == unk))
  if ids.size > max_prompt_len:
    placeholders = "" if vision is None else (
        f", {sum(processor.num_image_tokens(g) for g in vision[1])} of them image "
        f"placeholders (fewer with a smaller max_pixels in preprocessor_config.json)")
    return BadRow("too_long", f"{ids.size} prompt tokens{placeholders} > data.max_prompt_len="
                  f"{max_prompt_len} (raise it, with rollout.prefill_buckets, to keep such rows)")
  source = field_value(raw, source_key)
  prompt = messages[0]["content"] if not is_chat else prompt_value
  host = {"prompt": prompt, "prompt_text": rendered if isinstance(
      rendered, str) else None, "answer": answer,
      "data_source": default_source if source is None else source,
      "record": record}
  if unknown:  # characters the vocabulary lacks (NUL, emoji, CJK for a small vocabulary)
    host["unk_tokens"] = unknown
  # The row's own other fields, for an environment's reset(row) and plugins (not the
  # image field, which can be large; ours win a name clash): JSON-plain values, as an
  # asynchronous run's checkpoint saves the fields of its in-flight samples.
  skip = {prompt_key, answer_key, source_key, image_key}
  for key, value in raw.items():
    if isinstance(key, str) and key not in skip and key not in host:
      value = plain_value(value)
      if _json_plain(value):  # bytes, dates and the like stay behind
        host[key] = value
  if vision is not None:
    host["pixel_values"], host["image_grid_thw"] = vision
  return Example(record=record, prompt_ids=ids, host=host)


def _json_plain(value: Any) -> bool:
  try:
    json.dumps(value)
  except (TypeError, ValueError):
    return False
  return True


def plain_value(value: Any) -> Any:
  """``value`` with numpy scalars and arrays (parquet and grain rows) as Python numbers
  and lists, nested through lists and dicts."""
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, np.ndarray):
    return value.tolist()
  if isinstance(value, dict):
    return {k: plain_value(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [plain_value(v) for v in value]
  return value
