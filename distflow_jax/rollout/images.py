"""Images of the prompts of a rollout (vision-language runs), for the backends that take them.

The generate node computes each prompt's vision features once (state/vision.py) and
hands them to the backend with the prompt's multimodal RoPE positions; decoding is text:
a token at sequence index t (t >= the prompt's length) sits at `t + rope delta` on all
three RoPE rows.  Only the `reference` backend takes images (rollout.backend=reference).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

ENGINE_REFUSES = ("rollout.backend={name!r} does not take images yet; set "
                  "rollout.backend=reference for a vision-language run")


class PromptImages(NamedTuple):
  """Per prompt q (same order as the prompts): its features, where they go, its positions."""
  embeds_QxIxD: np.ndarray            # vision features, reading order
  slots: list[np.ndarray]             # [len_q] bool: the prompt's image placeholders
  rope: list[np.ndarray]              # [3, len_q] int: the prompt's multimodal positions
  deltas_Q: np.ndarray                # max rope position + 1 - len_q

  def rows(self, prompt_of_row: np.ndarray, width: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(feats [R, I, D], slots [R, W], rope [R, 3, W])` of right-padded rows of width W
    whose row r holds prompt `prompt_of_row[r]` and then its response."""
    r = len(prompt_of_row)
    slots = np.zeros((r, width), bool)
    rope = np.zeros((r, 3, width), np.int32)
    for i, q in enumerate(prompt_of_row):
      n = len(self.slots[q])
      slots[i, :n] = self.slots[q]
      rope[i, :, :n] = self.rope[q]
      rope[i, :, n:] = np.arange(n, width) + self.deltas_Q[q]
    return np.asarray(self.embeds_QxIxD, np.float32)[prompt_of_row], slots, rope
