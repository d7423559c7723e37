"""What the engine's JetStream-API calls return: `ResultTokens` and one slot's `SlotData`.

Mirrors `jetstream.engine.engine_api.ResultTokens` (which `jetstream_adapter`
converts into), with a per-token logprob column JetStream's lacks.
Re-exported by `distflow_jax.rollout.engine`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import numpy as np


class SlotData(NamedTuple):
  tokens: Any
  valid: Any
  lengths: Any
  logprobs: Any


@dataclasses.dataclass(frozen=True)
class ResultTokens:
  """Tokens of one call for every slot: `[B, K]` tokens / valid / logprobs, `[B]` lengths.

  `lengths` is the number of tokens each slot has generated so far.
  """
  tokens: Any
  valid: Any
  lengths: Any
  logprobs: Any
  samples_per_slot: int = 1

  def copy_to_host_async(self) -> None:
    for x in (self.tokens, self.valid, self.lengths, self.logprobs):
      if isinstance(x, jax.Array):
        x.copy_to_host_async()

  def convert_to_numpy(self) -> "ResultTokens":
    return ResultTokens(*(np.asarray(x) for x in (self.tokens, self.valid, self.lengths,
                                                  self.logprobs)), self.samples_per_slot)

  def get_result_at_slot(self, slot: int) -> SlotData:
    lo, hi = slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot
    return SlotData(self.tokens[lo:hi], self.valid[lo:hi], self.lengths[lo:hi],
                    self.logprobs[lo:hi])
